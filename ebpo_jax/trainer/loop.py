"""The host loop: jitted steps on a task (task_setup), eval, checkpoints, metrics, signals."""

import math
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from ebpo_jax import config as config_lib
from ebpo_jax import distributed, sharding
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.checkpoint import Checkpointer, PreemptionGuard
from ebpo_jax.trainer.rollout import Rollout, batch_rounds, make_rollout_fn
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer, state_shardings
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
    """The device mesh the config asks for (Auto axes, so model code needs no annotations).

    It spans every device, or the first `mesh.devices` of them (one process only).
    """
    n = config_lib.mesh_devices(config, jax.device_count())
    if n < jax.device_count() and jax.process_count() > 1:
        raise config_lib.ConfigError(
            f"mesh.devices={n}: a multi-process run's mesh must span all {jax.device_count()}"
        )
    shape = config_lib.mesh_shape(config, jax.device_count())
    axes = tuple(config.mesh.axes)
    if n == jax.device_count():
        return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    return sharding.make_mesh(list(zip(axes, shape)), jax.devices()[:n])


def _sampler_mesh(config, mesh):
    """`sampler.mesh` over the trainer mesh's devices, or the trainer mesh itself."""
    spec = config_lib.sampler_mesh_spec(config)
    if not spec:
        return mesh
    try:
        return sharding.make_mesh(spec, mesh.devices.flat)
    except ValueError as e:
        raise config_lib.ConfigError(f"sampler.mesh={config.sampler.mesh!r}: {e}") from None


def _silent(*_args, **_kwargs) -> None:
    pass


def _any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on any (a signal reaches one host first)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def _put(tree, shardings):
    """Host arrays (identical on every process) -> global arrays placed by `shardings`."""

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def _rollout_shardings(mesh, prompts: int) -> Rollout:
    """A Rollout of shardings: per-prompt fields over the batch axes (if they divide P)."""
    rows = jax.sharding.NamedSharding(mesh, sharding.rows_spec(mesh, prompts))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    scalars = ("generated_tokens", "all_same_frac")
    return Rollout(*(rep if f in scalars else rows for f in Rollout._fields))


def _to_host(metrics) -> list[dict]:
    """Stacked [K] device metrics (replicated) -> K dicts of Python floats."""
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
    main = distributed.is_main_process()
    if not main:  # every process runs the same steps; process 0 alone speaks and writes metrics
        log = _silent
    if host_reward is not None and config.steps_per_jit != 1:
        raise config_lib.ConfigError("a host reward needs steps_per_jit=1 (jit -> host -> jit)")
    if config.sampler.mesh and config.steps_per_jit != 1:
        raise config_lib.ConfigError(
            f"sampler.mesh={config.sampler.mesh!r} needs steps_per_jit=1 (the K-step scan "
            "samples on the trainer's mesh)"
        )
    t_start = time.time()
    os.makedirs(config.workdir, exist_ok=True)
    if main:
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

    def init(params):
        return init_train_state(
            params,
            optimizer,
            seed=config.seed,
            num_clusters=task.num_clusters,
            with_ref=config.loss.kl_coef > 0,
        )

    # Params, Adam moments and the reference policy are laid out by the config's rules; the
    # state is built inside jit so no replicated copy of it ever exists.
    state_sh = state_shardings(model_config, optimizer, jax.eval_shape(init, task.params), mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=state_sh)(task.params)
    K = config.steps_per_jit
    ckpt = Checkpointer(
        os.path.join(config.workdir, "checkpoints"),
        max_to_keep=config.keep_checkpoints,
        save_every=config.checkpoint_every,
    )
    metrics_path = os.path.join(config.workdir, "metrics.jsonl")
    extra = {}
    if ckpt.latest_step() is not None:
        # The target's shardings are the ones restored into: each host reads its own shards.
        restored, extra = ckpt.restore(target=_state_for_checkpoint(state))
        state = state._replace(**restored)
        source.restore(extra["data"])
        log(f"resumed from step {int(state.step)} in {ckpt.directory}")
    resumed_from = int(state.step) if extra else None

    stops, eos = task.stop_ids, task.eos_id
    # Prompt rows (axis 1 of the K-stacked batches) are split over the batch axes.
    prompt_rows = batch_rounds(config) * config.prompts_per_step
    if K == 1:
        ro_sh = _rollout_shardings(mesh, config.prompts_per_step)
        s_mesh = _sampler_mesh(config, mesh)
        rollout = jax.jit(
            make_rollout_fn(config, model_config, reward_fn, stops, s_mesh),
            out_shardings=_rollout_shardings(s_mesh, config.prompts_per_step),
        )
        s_params_sh = sharding.param_shardings(model_config, state.params, s_mesh)
        update = jax.jit(
            make_update_fn(config, model_config, optimizer, eos),
            in_shardings=(state_sh, ro_sh),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )
    else:
        multi = jax.jit(
            make_multi_step(
                make_train_step(config, model_config, optimizer, reward_fn, stops, mesh=mesh)
            ),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )

    step = int(state.step)
    # Rows of steps <= the restored one stay; later ones are rewritten exactly once.
    main = distributed.is_main_process()
    writer = metrics_lib.open_writer(
        config.workdir, start_step=step + 1 if extra else 0, enabled=main
    )
    bar = metrics_lib.ProgressBar(config.total_steps, initial=step, disable=None if main else True)
    # Counted on host in Python ints: the device counter is int32, and a pod run generates
    # up to P x G x N = 16.8M tokens a step (int32 wraps after ~128 such steps).
    tokens_total = extra.get("generated_tokens", int(state.generated_tokens))
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
            batches = _put(
                batches, sharding.batch_sharded(batches, mesh, prompt_rows, axis=1, strict=False)
            )
            t0 = time.perf_counter()
            if K == 1:
                one = jax.tree.map(lambda x: x[0], batches)
                key = jax.random.wrap_key_data(state.rng)
                params, key = state.params, jax.random.fold_in(key, 1)
                if s_mesh is not mesh:  # weights move device to device, not through the host
                    params = jax.device_put(params, s_params_sh)
                    s_rows = sharding.batch_sharded(one, s_mesh, prompt_rows, strict=False)
                    one = jax.device_put(one, s_rows)
                    key = jax.device_put(key, jax.sharding.NamedSharding(s_mesh, P()))
                with jax.set_mesh(s_mesh):
                    ro = rollout(params, one, key)
                ro = jax.block_until_ready(jax.device_put(ro, ro_sh))
                if host_reward is not None:
                    rewards_PG = np.asarray(host_reward(distributed.to_host(ro)), np.float32)
                    ro = ro._replace(rewards=_put(rewards_PG, ro_sh.rewards))
                t1 = time.perf_counter()
                with jax.set_mesh(mesh):
                    state, m = update(state, ro)
                m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
                t2 = time.perf_counter()
                times = {"perf/sample_time_s": t1 - t0, "perf/update_time_s": t2 - t1}
            else:
                with jax.set_mesh(mesh):
                    state, m = multi(state, batches)
                state, m = jax.block_until_ready((state, m))
                times = {"perf/sample_time_s": math.nan, "perf/update_time_s": math.nan}
            dt = (time.perf_counter() - t0) / K
            rows = _to_host(m)
            for row in rows:
                step += 1
                tokens_total += int(row["perf/step_tokens"])
                row["perf/generated_tokens_total"] = float(tokens_total)
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
            extra = {
                "data": source.state(),
                "pass@1_start": start,
                "generated_tokens": tokens_total,
            }
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
            requested = _any_process(guard.requested)
            stopped = requested or (stop_after is not None and step - first >= stop_after)
            if stopped:
                ckpt.save(step, _state_for_checkpoint(state), extra, force=True)
                why = (
                    f"signal {guard.signum or '(another process)'}"
                    if requested
                    else f"stop_after={stop_after}"
                )
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
