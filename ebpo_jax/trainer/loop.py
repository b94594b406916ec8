"""The host loop: jitted steps on a task (task_setup), eval, checkpoints, metrics, signals."""

import math
import os
import time

import jax
import numpy as np

from ebpo_jax import config as config_lib
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.checkpoint import Checkpointer, PreemptionGuard
from ebpo_jax.trainer.rollout import make_rollout_fn
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_multi_step, make_train_step, make_update_fn
from ebpo_jax.trainer.task_setup import (  # noqa: F401  (load_tasks, model_config_from: re-exported)
    Task,
    build_task,
    load_tasks,
    model_config_from,
)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def make_mesh(config):
    """The device mesh the config asks for (Auto axes, so model code needs no annotations)."""
    shape = config_lib.mesh_shape(config, jax.device_count())
    axes = tuple(config.mesh.axes)
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _to_host(metrics) -> list[dict]:
    """Stacked [K] device metrics -> K dicts of Python floats."""
    host = jax.device_get(metrics)
    k = len(next(iter(host.values())))
    return [{name: float(v[i]) for name, v in host.items()} for i in range(k)]


def _state_for_checkpoint(state: TrainState) -> dict:
    return {k: v for k, v in state._asdict().items() if v is not None}


def load_params(workdir: str):
    """The policy params of the latest checkpoint in `workdir` (host numpy arrays)."""
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        state, _ = ckpt.restore()
    return state["params"]


def train(config, *, reward_fn=None, host_reward=None, log=print, stop_after=None) -> dict:
    """Run (or resume) training as `config` says; returns pass@1 before/after and paths.

    What the run trains on (synthetic tasks or `data.path`'s math records) comes from
    `task_setup.build_task`. `reward_fn` replaces the task's jittable reward (same signature);
    `host_reward(rollout) -> rewards [P, G]` is a Python reward on host arrays (math data
    has one: math-verify): the step then runs as jit (sample) -> host (reward) -> jit (update).
    `stop_after=n` stops after n steps of this call as SIGTERM would (checkpoint, return).
    """
    config_lib.validate(config, jax.device_count())
    if host_reward is not None and config.steps_per_jit != 1:
        raise config_lib.ConfigError("a host reward needs steps_per_jit=1 (jit -> host -> jit)")
    t_start = time.time()
    os.makedirs(config.workdir, exist_ok=True)
    with open(os.path.join(config.workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    mesh = make_mesh(config)
    task = build_task(config, mesh=mesh, log=log)
    if reward_fn is None and host_reward is None:
        reward_fn, host_reward = task.reward_fn, task.host_reward
    try:
        summary = _run(config, task, mesh, reward_fn, host_reward, log, stop_after)
    finally:
        task.close()  # reward worker processes, also when a step raised
    return {**summary, "wall_time_s": time.time() - t_start}


def _run(config, task: Task, mesh, reward_fn, host_reward, log, stop_after) -> dict:
    """The host loop of train() over a built task."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    model_config, source, evaluate = task.model_config, task.source, task.evaluate
    optimizer = make_optimizer(config)
    state = init_train_state(
        task.params,
        optimizer,
        seed=config.seed,
        num_clusters=task.num_clusters,
        with_ref=config.loss.kl_coef > 0,
    )
    state = jax.device_put(state, replicated)
    K = config.steps_per_jit
    ckpt = Checkpointer(
        os.path.join(config.workdir, "checkpoints"),
        max_to_keep=config.keep_checkpoints,
        save_every=config.checkpoint_every,
    )
    metrics_path = os.path.join(config.workdir, "metrics.jsonl")
    extra = {}
    if ckpt.latest_step() is not None:
        restored, extra = ckpt.restore(target=_state_for_checkpoint(state))
        state = state._replace(**restored)
        source.restore(extra["data"])
        log(f"resumed from step {int(state.step)} in {ckpt.directory}")
    resumed_from = int(state.step) if extra else None

    stops, eos = task.stop_ids, task.eos_id
    if K == 1:
        rollout = jax.jit(make_rollout_fn(config, model_config, reward_fn, stops, mesh))
        update = jax.jit(make_update_fn(config, model_config, optimizer, eos), donate_argnums=0)
    else:
        multi = jax.jit(
            make_multi_step(
                make_train_step(config, model_config, optimizer, reward_fn, stops, mesh=mesh)
            ),
            donate_argnums=0,
        )

    step = int(state.step)
    # Rows of steps <= the restored one stay; later ones are rewritten exactly once.
    writer = metrics_lib.MetricsWriter(config.workdir, start_step=step + 1 if extra else 0)
    bar = metrics_lib.ProgressBar(config.total_steps, initial=step)
    if "pass@1_start" in extra:
        pass_start = math.nan if extra["pass@1_start"] is None else extra["pass@1_start"]
    elif evaluate is None:
        pass_start = math.nan
    else:
        pass_start = evaluate(state.params)
        writer.write(step, {"eval/pass@1": pass_start})
    if evaluate is not None:
        log(f"held-out pass@1 at the warm start: {100 * pass_start:.1f}%")
    pass_now, first, stopped = pass_start, step, False
    with PreemptionGuard() as guard:
        while step < config.total_steps:
            batches = source.next_batches(K)
            batches = jax.device_put(batches, replicated)
            t0 = time.perf_counter()
            if K == 1:
                one = jax.tree.map(lambda x: x[0], batches)
                key = jax.random.wrap_key_data(state.rng)
                ro = jax.block_until_ready(rollout(state.params, one, jax.random.fold_in(key, 1)))
                if host_reward is not None:
                    rewards_PG = np.asarray(host_reward(jax.device_get(ro)), np.float32)
                    ro = ro._replace(rewards=jax.device_put(rewards_PG, replicated))
                t1 = time.perf_counter()
                state, m = update(state, ro)
                m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
                t2 = time.perf_counter()
                times = {"perf/sample_time_s": t1 - t0, "perf/update_time_s": t2 - t1}
            else:
                state, m = jax.block_until_ready(multi(state, batches))
                times = {"perf/sample_time_s": math.nan, "perf/update_time_s": math.nan}
            dt = (time.perf_counter() - t0) / K
            rows = _to_host(m)
            for row in rows:
                step += 1
                row.update(
                    times,
                    **{"perf/step_time_s": dt, "perf/tokens_per_s": row["perf/step_tokens"] / dt},
                )
                # eval_every and total_steps are multiples of K: this is the chunk's last step.
                due = step % config.eval_every == 0 or step == config.total_steps
                if due and evaluate is not None:
                    pass_now = row["eval/pass@1"] = evaluate(state.params)
                writer.write(step, row)
                bar.update(step - 1, row)
            # JSON has no NaN: a run without eval stores None.
            start = None if math.isnan(pass_start) else pass_start
            extra = {"data": source.state(), "pass@1_start": start}
            if ckpt.should_save(step):
                ckpt.save(step, _state_for_checkpoint(state), extra)
            if rows[-1]["train/nonfinite_run"] >= config.max_nonfinite_steps:
                writer.close()
                bar.close()
                raise NonFiniteError(
                    f"{int(rows[-1]['train/nonfinite_run'])} steps in a row had a non-finite loss or "
                    f"gradient (max_nonfinite_steps={config.max_nonfinite_steps}); stopped at step "
                    f"{step}, last good checkpoint in {ckpt.directory}"
                )
            stopped = guard.requested or (stop_after is not None and step - first >= stop_after)
            if stopped:
                ckpt.save(step, _state_for_checkpoint(state), extra, force=True)
                why = f"signal {guard.signum}" if guard.requested else f"stop_after={stop_after}"
                log(f"{why}: saved step {step} to {ckpt.directory}; exiting")
                break
    ckpt.close()
    writer.close()
    bar.close()
    return {
        "pass@1_start": pass_start,
        "pass@1_end": pass_now,
        "step": step,
        "stopped_early": stopped,
        "resumed_from": resumed_from,
        "workdir": config.workdir,
        "metrics": metrics_path,
        "checkpoints": ckpt.directory,
    }
