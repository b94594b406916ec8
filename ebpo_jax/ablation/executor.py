"""The executor seam: a grid hands its runs to an executor and collects the finished ones.

`LocalPool` trains on this machine (in this process, or a pool of spawned processes);
`ebpo_jax.ablation.ray_executor.RayExecutor` places runs on a Ray cluster. Both call
`train_run` for each run and report to one `Progress`, so results, claims, power and
`--rerun` do not depend on which executor trained the runs.
"""

import json
import os
import sys
from typing import NamedTuple, Protocol

_PARENT_PID = None  # set in pool workers


class GridStopped(Exception):
    """A signal stopped the run in progress at a checkpoint: the grid stops with it."""


class Job(NamedTuple):
    """One run handed to an executor: its id and its finalized training config (JSON)."""

    run_id: str
    config_json: str


class Progress:
    """Runs done / running / retried / failed: the grid bar's postfix and one line per event."""

    def __init__(self, bar, total: int, done: int, log=print):
        self.bar, self.total, self.log = bar, total, log
        self.counts = {"done": done, "running": 0, "retried": 0, "failed": 0}
        self.failures: dict[str, str] = {}

    def line(self) -> str:
        """'3/8 done, 2 running, 1 retried, 0 failed'."""
        c = self.counts
        return (
            f"{c['done']}/{self.total} done, {c['running']} running, "
            f"{c['retried']} retried, {c['failed']} failed"
        )

    def _show(self, event: str) -> None:
        self.bar.set_postfix_str(self.line())
        self.log(f"  {event} ({self.line()})")

    def started(self, run_id: str) -> None:
        self.counts["running"] += 1
        self.bar.set_postfix_str(self.line())

    def finished(self, run_id: str) -> None:
        self.counts["running"] -= 1
        self.counts["done"] += 1
        self.bar.update()
        self._show(f"done {run_id}")

    def retried(self, run_id: str, why: str) -> None:
        """A failed attempt that goes back in the queue: no longer running until relaunched."""
        self.counts["running"] -= 1
        self.counts["retried"] += 1
        self._show(f"retry {run_id}: {why}")

    def failed(self, run_id: str, why: str) -> None:
        self.counts["running"] -= 1
        self.counts["failed"] += 1
        self.failures[run_id] = why
        self._show(f"FAILED {run_id}: {why}")


class Executor(Protocol):
    """Trains `jobs` (each through `train_run`), reporting to `progress`; returns the ids trained."""

    def train(self, jobs: list[Job], cache_dir: str, stamp: dict, progress: Progress) -> list[str]:
        """Train every job; a run that keeps failing is in progress.failures, not returned."""
        ...

    def close(self) -> None:
        """Give back what the executor started (a cluster, processes)."""
        ...


def _quiet(*_):
    pass


def _setup_jax(cache_dir: str) -> None:
    """Share compiled programs across runs: seeds and repeats hit the persistent cache."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _orphaned() -> bool:
    """A pool worker whose grid process has died (its queued runs must not start)."""
    return _PARENT_PID is not None and os.getppid() != _PARENT_PID


def train_run(config_json: str, cache_dir: str, stamp: dict | None = None) -> dict:
    """Train one run from its config (JSON); write summary.json (with provenance, the warm
    start's SHA-256 and `stamp`, e.g. the claims file's SHA-256) when done."""
    if _orphaned():
        os._exit(0)
    import ml_collections

    from ebpo_jax.ablation.provenance import code_version, provenance
    from ebpo_jax.config import finalize

    _setup_jax(cache_dir)
    from ebpo_jax.trainer.loop import train

    code_version()  # the source as imported, before a run that may outlast the checkout

    config = finalize(ml_collections.ConfigDict(json.loads(config_json)))
    summary = train(config, log=_quiet)
    if _orphaned():  # the death signal stopped this run at a checkpoint; take no other
        os._exit(0)
    from ebpo_jax.runtime import distributed

    if not summary["stopped_early"] and distributed.is_main_process():  # one writer per run
        warm = {"warm_start_sha256": summary.get("base_sha256") or ""}
        summary["provenance"] = {**provenance(), **warm, **(stamp or {})}
        with open(os.path.join(config.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _worker_init():
    global _PARENT_PID
    _PARENT_PID = os.getppid()
    os.environ["TQDM_DISABLE"] = "1"
    # When the grid process dies, SIGTERM stops the run in progress at a checkpoint (the
    # trainer's preemption path), then the worker exits instead of taking queued runs.
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalPool:
    """Today's executor: runs in order in this process (workers <= 1) or on a pool of
    `workers` spawned processes; a failed run stops the grid with its error."""

    def __init__(self, workers: int = 1):
        self.workers = workers

    def train(self, jobs: list[Job], cache_dir: str, stamp: dict, progress: Progress) -> list[str]:
        if self.workers <= 1:
            return _train_serial(jobs, cache_dir, stamp, progress)
        return _train_pool(jobs, cache_dir, stamp, progress, self.workers)

    def close(self) -> None:
        """Nothing to give back: each pool ends with its train()."""


def _train_serial(jobs, cache_dir, stamp, progress) -> list[str]:
    """Train `jobs` one after the other in this process."""
    trained = []
    os.environ["TQDM_DISABLE"] = "1"  # the per-run step bars; the grid bar stays
    try:
        for job in jobs:
            progress.started(job.run_id)
            summary = train_run(job.config_json, cache_dir, stamp)
            if summary["stopped_early"]:  # the trainer took the signal meant for the grid
                raise GridStopped(
                    f"a signal stopped run {job.run_id} at step {summary['step']} with a "
                    "checkpoint; the same command resumes the grid"
                )
            trained.append(job.run_id)
            progress.finished(job.run_id)
    finally:
        os.environ.pop("TQDM_DISABLE", None)
    return trained


def _train_pool(jobs, cache_dir, stamp, progress, workers: int) -> list[str]:
    """Train `jobs` on a pool of `workers` spawned processes."""
    import concurrent.futures as cf
    import multiprocessing as mp

    trained = []
    # One XLA thread per worker (they share the cores); the spawned workers inherit it,
    # this process (jax already loaded) does not use it, and it is restored after.
    flags_before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = (flags_before or "") + " --xla_cpu_multi_thread_eigen=false"
    ctx = mp.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futs = {pool.submit(train_run, j.config_json, cache_dir, stamp): j.run_id for j in jobs}
            queued = [j.run_id for j in jobs]  # the pool starts them in order
            for run_id in queued[:workers]:
                progress.started(run_id)
            for fut in cf.as_completed(futs):
                fut.result()  # a failed run stops the grid with its error
                trained.append(futs[fut])
                progress.finished(futs[fut])
                if len(queued) > workers + len(trained) - 1:
                    progress.started(queued[workers + len(trained) - 1])
    finally:
        if flags_before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags_before
    return trained
