"""The host loop: resolve the config, build the task and the step, then step, log, evaluate,
checkpoint, and stop on signals or a run of non-finite steps."""

import dataclasses
import json
import math
import os
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from ebpo_jax.config import checks, default_config
from ebpo_jax.evaluation.evaluator import write_per_problem
from ebpo_jax.runtime import distributed, tracing
from ebpo_jax.runtime import metrics as metrics_lib
from ebpo_jax.runtime import progress as progress_lib
from ebpo_jax.runtime import watchdog as watchdog_lib
from ebpo_jax.runtime import workdir as workdir_lib
from ebpo_jax.runtime.checkpoint import Checkpointer, PreemptionGuard
from ebpo_jax.sharding import make_mesh
from ebpo_jax.spec import RunSpec, resolve
from ebpo_jax.tasks import episodes
from ebpo_jax.tasks.protocol import Reward, Task, build_task, mean_pass
from ebpo_jax.tasks.protocol import get as get_family
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.shardings import bundle
from ebpo_jax.trainer.state import make_optimizer
from ebpo_jax.trainer.update import SAMPLE_ADVANTAGES


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss, gradient or updated state."""


def _silent(*_args, **_kwargs) -> None:
    pass


def _any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on any (a signal reaches one host first)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def _to_host(metrics) -> list[dict]:
    """Stacked [K] device metrics (replicated) -> K dicts of Python floats (scalars only)."""
    host = {k: v for k, v in jax.device_get(metrics).items() if k != SAMPLE_ADVANTAGES}
    k = len(next(iter(host.values())))
    return [{name: float(v[i]) for name, v in host.items()} for i in range(k)]


def _caller_reward(reward_fn, host_reward) -> Reward | None:
    """A caller's jittable or host reward, which replaces the task family's; None if neither."""
    if reward_fn is not None:
        return Reward(reward_fn, jittable=True)
    if host_reward is not None:
        return Reward(host_reward, jittable=False)
    return None


def train(config, *, reward_fn=None, host_reward=None, log=print, stop_after=None) -> dict:
    """Run (or resume) training as `config` says; returns pass@1 before/after and paths.

    The task family (`task.family`) gives the data, policy and reward; `reward_fn` replaces
    it with a jittable reward (same signature), `host_reward(rollout) -> rewards [P, G]` with
    a Python reward on host arrays (the step then runs jit -> host -> jit; with several
    processes each calls it on its own block of the P prompts, so it scores rows independently).
    `stop_after=n` stops after n steps of this call as SIGTERM would (checkpoint, return).
    """
    spec = resolve(config, jax.device_count())
    if host_reward is not None:
        checks.host_reward_steps(spec.run.steps_per_jit)
    main = distributed.is_main_process()
    if not main:  # process 0 alone speaks and writes metrics
        log = _silent
    t_start = time.time()
    # Writable, free space, locked, resumable, config compatible: before anything compiles.
    get_family(spec.task.family)  # an unknown family is refused before the workdir is touched
    # multi-host: a local workdir must be one every host sees
    workdir_lib.check_shared(spec.workdir, remote=spec.remote)
    defaults = default_config().to_dict()  # fields added since a run was saved keep these
    lock = (
        workdir_lib.prepare_workdir(spec, log=log, write_config=False, defaults=defaults)
        if main
        else None
    )
    save = (lambda: workdir_lib.save_config(spec, defaults)) if main else (lambda: None)
    task = None
    try:
        mesh = make_mesh(spec.mesh)
        reward = _caller_reward(reward_fn, host_reward)
        task = build_task(spec.task, mesh=mesh, log=log, reward=reward)
        summary = _run(spec, task, mesh, log, stop_after, save)
    finally:
        if task is not None:
            task.close()  # reward worker processes, also when a step raised
        if lock is not None:
            lock.release()
    return {**summary, "wall_time_s": time.time() - t_start}


def _init_state(spec: RunSpec, view: policy_lib.Policy, task: Task, mesh):
    """The step-0 TrainState (built inside jit on its shardings), the shardings bundle and
    the optimizer. No replicated copy of the params, Adam moments or reference policy
    ever exists."""
    optimizer = make_optimizer(spec.optim)
    init = lambda params: view.init(
        params, optimizer, seed=spec.run.seed, num_clusters=task.num_clusters
    )
    sh = bundle(spec, view, optimizer, jax.eval_shape(init, task.params), mesh)
    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=sh.state)(task.params), sh, optimizer


class _Log:
    """Metrics rows, the progress display, the token count and the latest pass@1 (and its step)."""

    def __init__(self, spec: RunSpec, step: int, extra: dict, policy, state, evaluate, log):
        main = distributed.is_main_process()
        self.evaluate, self.spec = evaluate, spec
        self.now, self.now_step = math.nan, None  # the latest evaluation and its step
        self.sample_adv = None  # [G] advantages of the latest step's first prompt
        # A fresh run's warm start (`policy`: its weights), written once the rows are open.
        row = None if policy is None else self.eval_row(policy, {}, step)
        # Rows of steps <= the restored one stay; later ones are rewritten exactly once.
        start = step + 1 if extra else 0
        self.writer = metrics_lib.open_writer(
            spec.workdir,
            remote=spec.remote,
            start_step=start,
            enabled=main,
            wandb=dataclasses.asdict(spec.wandb) if spec.wandb.project else None,
            run_config=json.loads(spec.config_json),
            log=log,
        )
        if extra:  # rows lost since the checkpoint was saved (a deleted file, a torn row)
            self.writer.record_gap(step)
        # Counted on host in Python ints: the device counter is int32, and a pod run makes up
        # to P x G x N = 16.8M tokens a step (int32 wraps after ~128 such steps).
        self.tokens = extra.get("generated_tokens", int(state.generated_tokens))
        if "pass@1_start" in extra:
            self.start = math.nan if extra["pass@1_start"] is None else extra["pass@1_start"]
            latest = metrics_lib.latest(self.writer.kept, "eval/pass@1", step)  # rows kept
            if latest is not None:  # a resume reports what the run reached, not its start
                self.now, self.now_step = latest
        elif row is None:
            self.start = math.nan
        else:
            self.start = row["eval/pass@1"]
            self.writer.write(step, row)
        finished = step >= spec.run.total_steps  # the closing summary says it all
        if evaluate is not None and self.now_step and not finished:  # a resume: how far
            now = f"{100 * self.now:.1f}% at step {self.now_step}"
            log(f"held-out pass@1: {100 * self.start:.1f}% at the warm start, {now}")
        elif evaluate is not None and not self.now_step:
            log(f"held-out pass@1 at the warm start: {100 * self.start:.1f}%")
        # After the lines above: a bar must not have them printed into its line.
        self.bar = progress_lib.progress(
            spec.run.total_steps,
            initial=step,
            every=spec.run.log_every,
            every_s=spec.run.log_every_s,
            enabled=main,
        )

    def eval_row(self, params, row: dict, step: int) -> dict:
        """`row` with eval/pass@1 (the sets' mean) and, for several sets, eval/<set>/pass@1."""
        per_set = self.evaluate(params)
        self.now = row["eval/pass@1"] = mean_pass(per_set)
        self.now_step = step
        if len(per_set) > 1:
            row.update({f"eval/{name}/pass@1": v for name, v in per_set.items()})
        return row

    def evaluates(self, step: int) -> bool:
        """Whether the rows up to `step` end with an evaluation."""
        run = self.spec.eval.run
        due = step % run.eval_every == 0 or step == self.spec.run.total_steps
        return due and self.evaluate is not None

    def rows(self, first_step: int, metrics, times: dict, dt: float, policy) -> list[dict]:
        """Write one row per step of a K-step call; eval on its last step when due."""
        rows = _to_host(metrics)
        if SAMPLE_ADVANTAGES in metrics:  # the last step's, as samples() logs its rollout
            self.sample_adv = np.asarray(jax.device_get(metrics[SAMPLE_ADVANTAGES]))[-1]
        for i, row in enumerate(rows):
            step = first_step + i + 1
            self.tokens += int(row["perf/step_tokens"])
            row["perf/generated_tokens_total"] = float(self.tokens)
            row.update(times)
            row.update({"perf/step_time_s": dt, "perf/tokens_per_s": row["perf/step_tokens"] / dt})
            # eval_every and total_steps are multiples of K: this is the call's last step.
            if self.evaluates(step):
                self.eval_row(policy(), row, step)
                if step == self.spec.run.total_steps and distributed.is_main_process():
                    write_per_problem(self.evaluate, self.spec.workdir)
            self.writer.write(step, row)
            self.bar.update(step - 1, row)
        return rows

    def final_eval(self, step: int, policy) -> None:
        """Evaluate once more when the last step reached has no evaluation (e.g. a run that
        was already finished with another eval_every), so the summary is the run's end.

        Single-process only: only process 0 reads metrics.jsonl, and an evaluation needs
        every process to take part.
        """
        if self.evaluate is None or self.now_step == step or jax.process_count() > 1:
            return
        self.eval_row(policy(), {}, step)
        self.bar.write(f"held-out pass@1 at step {step}: {100 * self.now:.1f}%")

    def samples(self, step: int, tokenizer, ro, rows: int = 4) -> None:
        """The first `rows` completions of the step's first prompt, decoded, to samples.jsonl."""
        if (
            ro is None
            or not self.spec.run.log_samples_every
            or step % self.spec.run.log_samples_every
        ):
            return
        ro = distributed.to_host(ro)
        plen = int(ro.prompt_lengths[0])
        prompt = tokenizer.decode(np.asarray(ro.prompt_tokens[0, :plen]).tolist())
        n = min(rows, ro.tokens.shape[1])
        # Whole episodes, observations marked (a single-turn row is all actions: plain text).
        texts = [
            episodes.episode_text(
                tokenizer, ro.tokens[0, g], ro.action_mask[0, g], ro.lengths[0, g]
            )
            for g in range(n)
        ]
        rewards = [float(r) for r in ro.rewards[0, :n]]
        adv = None if self.sample_adv is None else [float(a) for a in self.sample_adv[:n]]
        self.writer.write_samples(step, [prompt] * n, texts, rewards, adv)

    def extra(self, task: Task, policy_extra: dict) -> dict:
        """What a checkpoint saves besides the state (JSON has no NaN: no eval stores None);
        `policy_extra`: the policy's own entries (LoRA: the base's name)."""
        start = None if math.isnan(self.start) else self.start
        out = {"data": task.source.state(), "pass@1_start": start, "generated_tokens": self.tokens}
        return {**out, **policy_extra}

    def close(self):
        self.writer.close()
        self.bar.close()


def _restore(ckpt: Checkpointer, state, runner, check, task: Task, log):
    """The newest intact checkpoint's state and extra (the data position), else (state, {});
    the runner takes back its own checkpoint entries, if it has any.

    `check(extra)` refuses a checkpoint of another policy layout (policy.check_checkpoint).
    Corrupt newer steps are named and moved aside (Checkpointer.restore_intact).
    """
    if ckpt.latest_step() is None:
        return state, {}
    target = state.saved()
    try:
        saved = ckpt.saved_tree()
        saved_extra = ckpt.saved_extra()
    except Exception:  # noqa: BLE001  unreadable metadata: restore_intact names the fault
        saved, saved_extra = {}, None
    if saved_extra is not None:  # before restoring: adapters of another rank would look corrupt
        check(saved_extra)
    target.update(runner.restore_targets(saved, ckpt.directory))
    # The target's shardings are the ones restored into: each host reads its own shards.
    got = ckpt.restore_intact(target, log=log)
    if got is None:
        return state, {}
    _, restored, extra = got
    check(extra)
    runner.restored(restored)
    state = state._replace(**restored)
    task.source.restore(extra["data"])
    log(f"resumed from step {int(state.step)} in {ckpt.directory}")
    return state, extra


def _check_finite(spec: RunSpec, rows: list[dict], step: int, ckpt) -> None:
    """NonFiniteError once a streak reaches max_nonfinite_steps (at any step of a K-step call)."""
    streak = max(int(r["train/nonfinite_run"]) for r in rows)
    if streak >= spec.run.max_nonfinite_steps:
        ckpt.wait()  # a save in flight is a good one: updates are only committed when finite
        steps = ckpt.all_steps()
        good = f"step {steps[-1]} in {ckpt.directory}" if steps else "none (no checkpoint yet)"
        raise NonFiniteError(
            f"{streak} steps in a row had a non-finite loss, gradient or update "
            f"(max_nonfinite_steps={spec.run.max_nonfinite_steps}); stopped at step {step}; "
            f"last good checkpoint: {good}"
        )


def _run(spec: RunSpec, task: Task, mesh, log, stop_after, save_config) -> dict:
    """The host loop of train() over a built task; `save_config()` once the resume checks
    (the checkpoint's too) have passed, before anything else is written to the workdir."""
    view = policy_lib.of(spec, task.model_config)  # the one policy view of the run
    state, sh, optimizer = _init_state(spec, view, task, mesh)
    ckpt = Checkpointer(
        os.path.join(spec.workdir, "checkpoints"),
        max_to_keep=spec.run.keep_checkpoints,
        save_every=spec.run.checkpoint_every,
        checksums=distributed.is_main_process(),
    )
    out = None
    watch = watchdog_lib.Watchdog(spec.run.step_timeout_s, spec.workdir, jax.process_index())
    watch.start()
    try:  # a save in flight is always committed (or named as failed), whatever happens
        runner = make_runner(spec, task, optimizer, sh, view)
        policy_extra = view.checkpoint_extra(spec.task.model, task.base_source)  # every save's
        check = lambda extra: view.check_checkpoint(extra, policy_extra)
        state, extra = _restore(ckpt, state, runner, check, task, log)
        save_config()
        resumed_from = int(state.step) if extra else None
        first_eval = task.evaluate is not None and "pass@1_start" not in extra
        policy = runner.policy(state) if first_eval else None
        first = int(state.step)
        out = _Log(spec, first, extra, policy, state, task.evaluate, log)
        if first < spec.run.total_steps:
            out.bar.compiling()
        host = _Host(ckpt, out, watch, policy_extra)
        step, stopped = _loop(spec, task, runner, state, host, stop_after)
        if step == first:  # nothing left to train: `state` is the run's last one (not donated)
            out.final_eval(step, lambda: runner.policy(state))
    finally:
        if out is not None:
            out.close()
        watch.enter("checkpoint")  # the last save's commit waits on every process
        try:
            ckpt.close()
        finally:
            watch.stop()
    return {
        "pass@1_start": out.start,
        "pass@1_end": out.now,
        "pass@1_end_step": out.now_step,
        "step": step,
        "stopped_early": stopped,
        "resumed_from": resumed_from,
        "base_sha256": task.base_sha256,
        "workdir": spec.workdir,
        "metrics": os.path.join(spec.workdir, "metrics.jsonl"),
        "checkpoints": ckpt.directory,
    }


class _Host(NamedTuple):
    """What the loop reports to, built once by `_run`: the checkpointer (and the policy's
    entries of every checkpoint), the log (metrics rows, progress bar, evaluations) and the
    watchdog, which hears each phase."""

    ckpt: Checkpointer
    out: _Log
    watch: watchdog_lib.Watchdog
    policy_extra: dict


def _loop(spec: RunSpec, task: Task, runner, state, host: _Host, stop_after):
    """Steps until total_steps or a stop; returns (step reached, stopped early).

    The runner's phase times and the previous step's checkpoint time go into each step's row
    (`phase/<name>_s`).
    """
    ckpt, out, watch, policy_extra = host
    step = first = int(state.step)
    stopped = False
    log = out.bar.write
    timer, trace = runner.timer, tracing.StepTrace(spec.run.profile_steps, spec.workdir)
    watch.attach(timer)

    def next_batches():  # on the host: the runner places them
        return task.source.next_batches(spec.run.steps_per_jit)

    with PreemptionGuard() as guard, trace:
        while step < spec.run.total_steps:
            due = out.evaluates(step + spec.run.steps_per_jit)  # this call's last step
            trace.before(step, spec.run.steps_per_jit)
            t0 = time.perf_counter()
            state, m, times = runner(state, step, next_batches)
            dt = (time.perf_counter() - t0) / spec.run.steps_per_jit
            trace.after(step + spec.run.steps_per_jit)
            watch.step_done(step + spec.run.steps_per_jit, dt * spec.run.steps_per_jit)
            watch.enter("evaluate" if due else "log")
            times = {**times, **timer.take()}
            rows = out.rows(step, m, times, dt, lambda state=state: runner.policy(state))
            step += len(rows)
            out.samples(step, task.tokenizer, runner.last_rollout)
            extra = out.extra(task, policy_extra)  # the position counts every batch drawn
            saved = {**state.saved(), **runner.checkpoint_entries()}
            ckpt.check()  # a failed asynchronous save ends the run now, not in a log
            # No regular save inside a non-finite streak: the kept checkpoints stay good ones.
            if ckpt.should_save(step) and rows[-1]["train/nonfinite_run"] == 0:
                with timer("checkpoint"):
                    out.writer.flush()  # rows durable before the checkpoint that covers them
                    ckpt.save(step, saved, extra)
            _check_finite(spec, rows, step, ckpt)
            watch.enter("collective")  # every process's stop flag
            requested = _any_process(guard.requested)
            stopped = requested or (stop_after is not None and step - first >= stop_after)
            if stopped:
                watch.enter("checkpoint")
                out.writer.flush()
                ckpt.save(step, saved, extra, force=True)
                why = f"signal {guard.signum or '(another process)'}" if requested else None
                why = why or f"stop_after={stop_after}"
                log(f"{why}: saved step {step} to {ckpt.directory}; exiting")
                break
    watch.idle()
    return step, stopped
