"""The host loop: data, warm start, jitted steps, eval, checkpoints, metrics, signals."""

import math
import os
import time

import jax
import numpy as np

from ebpo_jax import config as config_lib
from ebpo_jax import metrics as metrics_lib
from ebpo_jax import models, sampler, tasks
from ebpo_jax.checkpoint import Checkpointer, PreemptionGuard
from ebpo_jax.trainer import sft
from ebpo_jax.trainer.rollout import batch_rounds, make_rollout_fn, num_clusters
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_multi_step, make_train_step, make_update_fn


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def make_mesh(config):
    """The device mesh the config asks for (Auto axes, so model code needs no annotations)."""
    shape = config_lib.mesh_shape(config, jax.device_count())
    axes = tuple(config.mesh.axes)
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def load_tasks(config):
    """(tokenizer, train problems, held-out problems) for the synthetic arithmetic tasks."""
    t = config.task
    topics = tuple(x for x in t.topics.split(",") if x) or tasks.TOPICS
    levels = tuple(d for d in tasks.DIFFICULTIES if not t.max_difficulty or d <= t.max_difficulty)
    train, test = tasks.make_splits(
        t.seed,
        train_per_cell=t.train_per_cell,
        test_per_cell=t.test_per_cell,
        topics=topics,
        difficulties=levels,
    )
    return tasks.CharTokenizer(), train, test


def model_config_from(config, tokenizer):
    """The policy's ModelConfig: the preset, the tokenizer's vocabulary, then overrides."""
    return models.get_config(
        config.model.preset, **{"vocab_size": tokenizer.vocab_size, **config.model.overrides}
    )


def make_evaluator(config, model_config, problems, tokenizer, mesh=None):
    """evaluate(params) -> held-out pass@1: the mean exact-answer reward over
    `eval_samples` samples per problem at `eval_temperature` (0 = greedy, one sample)."""
    data = tasks.encode_problems(problems, tokenizer)
    n, bs = len(problems), min(config.eval_batch_size, len(problems))
    pad = (-n) % bs  # repeat the first rows so every chunk has one shape (one compile)
    arrays = [np.concatenate([a, a[:pad]]) for a in data]
    temperature = config.eval_temperature
    k = config.eval_samples if temperature > 0 else 1
    reward = jax.jit(lambda *a: tasks.reward_fn(*a, eos_id=tokenizer.eos_id))

    def evaluate(params) -> float:
        total = []
        for i, s in enumerate(range(0, n + pad, bs)):
            chunk = tasks.PromptBatch(*(a[s : s + bs] for a in arrays))
            gen = sampler.generate(
                model_config,
                params,
                chunk.prompt_tokens,
                chunk.prompt_lengths,
                max_new_tokens=config.sampler.max_new_tokens,
                rng=jax.random.fold_in(jax.random.key(config.seed), i),  # same draws every eval
                temperature=temperature,
                eos_id=tokenizer.eos_id,
                num_samples=k,
                mesh=mesh,
            )
            rep = lambda x: np.repeat(x, k, axis=0)
            r = reward(gen.tokens, gen.lengths, rep(chunk.answer_tokens), rep(chunk.answer_lengths))
            total.append(np.asarray(r).reshape(bs, k))
        return float(np.concatenate(total)[:n].mean())

    return evaluate


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

    `reward_fn` replaces the task's jittable exact-answer reward (same signature).
    `host_reward(rollout) -> rewards [P, G]` is a Python reward on host arrays (e.g.
    math-verify): the step then runs as jit (sample) -> host (reward) -> jit (update).
    `stop_after=n` stops after n steps of this call as SIGTERM would (checkpoint, return).
    """
    config_lib.validate(config, jax.device_count())
    t_start = time.time()
    os.makedirs(config.workdir, exist_ok=True)
    with open(os.path.join(config.workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    mesh = make_mesh(config)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tokenizer, train_problems, test_problems = load_tasks(config)
    model_config = model_config_from(config, tokenizer)
    eos = tokenizer.eos_id
    if host_reward is not None and config.steps_per_jit != 1:
        raise config_lib.ConfigError("a host reward needs steps_per_jit=1 (jit -> host -> jit)")
    if reward_fn is None and host_reward is None:
        reward_fn = lambda *a: tasks.reward_fn(*a, eos_id=eos)

    params = models.init_params(model_config, jax.random.key(config.seed))
    params = sft.warm_start(config, model_config, params, train_problems, tokenizer, log=log)
    optimizer = make_optimizer(config)
    state = init_train_state(
        params,
        optimizer,
        seed=config.seed,
        num_clusters=num_clusters(config),
        with_ref=config.loss.kl_coef > 0,
    )
    state = jax.device_put(state, replicated)
    P, K = config.prompts_per_step, config.steps_per_jit
    source = tasks.PromptSource(
        train_problems,
        tokenizer,
        batch_rounds(config) * P,
        seed=config.seed,
        order=config.task.order,
    )
    evaluate = make_evaluator(config, model_config, test_problems, tokenizer, mesh)
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

    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if K == 1:
        rollout = jax.jit(make_rollout_fn(config, model_config, reward_fn, eos, mesh))
        update = jax.jit(make_update_fn(config, model_config, optimizer, eos), donate_argnums=0)
    else:
        multi = jax.jit(
            make_multi_step(
                make_train_step(config, model_config, optimizer, reward_fn, eos, mesh=mesh)
            ),
            donate_argnums=0,
        )

    step = int(state.step)
    # Rows of steps <= the restored one stay; later ones are rewritten exactly once.
    writer = metrics_lib.MetricsWriter(config.workdir, start_step=step + 1 if extra else 0)
    bar = metrics_lib.ProgressBar(config.total_steps, initial=step)
    if "pass@1_start" in extra:
        pass_start = extra["pass@1_start"]
    else:
        pass_start = evaluate(state.params)
        writer.write(step, {"eval/pass@1": pass_start})
    log(f"held-out pass@1 at the warm start: {100 * pass_start:.1f}%")
    pass_now, first, stopped = pass_start, step, False
    with PreemptionGuard() as guard:
        while step < config.total_steps:
            batches = source.next_batches(K)
            batches = jax.device_put(batches, batch_sharding)
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
                if step % config.eval_every == 0 or step == config.total_steps:
                    pass_now = row["eval/pass@1"] = evaluate(state.params)
                writer.write(step, row)
                bar.update(step - 1, row)
            extra = {"data": source.state(), "pass@1_start": pass_start}
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
    summary = {
        "pass@1_start": pass_start,
        "pass@1_end": pass_now,
        "step": step,
        "stopped_early": stopped,
        "resumed_from": resumed_from,
        "wall_time_s": time.time() - t_start,
        "workdir": config.workdir,
        "metrics": metrics_path,
        "checkpoints": ckpt.directory,
    }
    return summary
