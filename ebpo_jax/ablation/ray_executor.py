"""The Ray executor: each run is a Ray task (one per host on a TPU slice); a run whose task
dies is retried and resumes from the checkpoint in its workdir.

Tasks, not Ray jobs: a task carries its run in and its summary back to the one grid process
(the only writer of the tables), declares its resources (CPUs, a GPU node's GPUs, a TPU
slice's hosts through a placement group), and its death reaches the grid at once as an
exception (worker crashed, node died, out of memory); a job is a whole driver script
submitted from outside, with no per-run resources and no result. Ray's own task retries are
off: the grid retries, so it counts retries, starts over a run stopped before its first
checkpoint, and reports a run that fails the same way twice (the same error at the same
checkpoint: no progress between them) while the other runs go on.
Each task runs in a fresh worker process (`max_calls=1`: one JAX runtime per run) with the
grid process's XLA_FLAGS and matmul precision, the settings that change the numbers.
Workdirs must be on a disk every node sees (NFS; gs:// with the storage issue's paths).
"""

import collections
import os
import subprocess
from typing import NamedTuple

from ebpo_jax.ablation import executor, ray_slice
from ebpo_jax.ablation.executor import Job, Progress

# Ray starts its workers at nice 15 so that drivers stay responsive; a grid's driver only
# waits, and its runs must not yield to every other process of a shared machine.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


class RayResources(NamedTuple):
    """What one run asks of the cluster: CPUs and GPUs per task, or a TPU slice type (one
    task per host, gang-scheduled)."""

    cpus: float = 1.0
    gpus: float = 0.0
    slice: str = ""


class GridWork(NamedTuple):
    """Train one grid run (executor.train_run) on this host."""

    job: Job
    cache_dir: str
    stamp: dict

    def checkpoint(self):
        """The run's latest checkpoint step (None without one): its progress."""
        import json

        from ebpo_jax.runtime.workdir import CHECKPOINTS, list_steps

        workdir = json.loads(self.job.config_json)["workdir"]
        steps = list_steps(os.path.join(workdir, CHECKPOINTS))
        return max(steps) if steps else None

    def __call__(self, attempt: int) -> dict:
        config_json = _start_over_if_uncheckpointed(self.job.config_json) if attempt else None
        return executor.train_run(config_json or self.job.config_json, self.cache_dir, self.stamp)


class CommandWork(NamedTuple):
    """Run a command (e.g. `python experiments/train.py --config=...`) on this host."""

    argv: tuple

    def checkpoint(self) -> None:
        """Unknown: a command's progress is its own."""

    def __call__(self, attempt: int) -> dict:
        done = subprocess.run(list(self.argv), check=False, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [""])[-1][:300]
            raise RuntimeError(f"{self.argv[0]} exited with status {done.returncode}: {last}")
        return {"stopped_early": False}


def _start_over_if_uncheckpointed(config_json: str) -> str | None:
    """The config with restart=True when its workdir has metrics but no checkpoint (the task
    died before its first one: nothing to resume from); None otherwise."""
    import json

    from ebpo_jax.runtime.workdir import WorkdirError, check_workdir

    config = json.loads(config_json)
    try:
        check_workdir(config["workdir"], restart=False)
    except WorkdirError:
        return json.dumps({**config, "restart": True})
    return None


def _host_task(work, env: dict, attempt: int, coordinator: str, hosts: int, host: int) -> dict:
    """One host's part of a run, in a fresh worker process: its environment, then the work."""
    ray_slice.apply_env({**env, "TQDM_DISABLE": "1"})
    if coordinator:
        ray_slice.apply_env(ray_slice.host_env(coordinator, hosts, host))
        from ebpo_jax.runtime import distributed

        if isinstance(work, GridWork):  # a command starts its own runtime
            distributed.initialize()
    return work(attempt)


def process_env() -> dict:
    """This process's settings that change a run's numbers, for every task to run with."""
    import jax

    env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    if jax.config.jax_default_matmul_precision:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
    return env


def failure(error: BaseException) -> str:
    """One line naming how a task failed; two failures are "the same way" when equal."""
    import ray.exceptions

    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause if error.cause is not None else error
        text = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {text[-1] if text else ''}"[:300]
    return type(error).__name__  # worker crashed, node died, OOM: the kind is the signature


def slots(cluster: dict, resources: RayResources) -> int:
    """How many runs asking `resources` fit at once on a cluster of `cluster` (Ray's
    cluster_resources()); at least 1."""
    asks = [
        (cluster.get(k, 0.0), need)
        for k, need in (("CPU", resources.cpus), ("GPU", resources.gpus))
    ]
    return max(1, int(min((have // need for have, need in asks if need > 0), default=1)))


class _Flight(NamedTuple):
    run_id: str
    work: object
    attempt: int
    last: str  # the previous attempt's failure ("" on the first)
    refs: list
    reservation: ray_slice.Reservation | None
    done: set


class RayExecutor:
    """Runs on a Ray cluster (`address`: "" starts one on this machine, "auto" joins the local
    one, "ray://host:10001" a remote head), each with `resources`; a run is retried up to
    `retries` times, and reported failed when it fails the same way twice; `slices` runs on
    TPU slices at once."""

    def __init__(self, address="", resources=None, retries=3, slices=1):
        resources = resources or RayResources()
        if resources.slice:
            ray_slice.parse_slice(resources.slice)  # a bad name fails before anything starts
        self.address, self.resources = address, resources
        self.retries, self.slices = retries, slices
        self._started, self._slots = False, 0

    def connect(self) -> None:
        """Join (or start) the cluster once."""
        import ray

        if ray.is_initialized():
            return
        if self.address:
            ray.init(address=self.address, log_to_driver=False)
        else:  # a cluster of this machine's cores
            ray.init(
                address="local",  # never a cluster some earlier session left an address of
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _system_config=LOCAL_SYSTEM_CONFIG,
                log_to_driver=False,
            )
            self._started = True
            self._slots = slots(ray.cluster_resources(), self.resources)

    def close(self) -> None:
        """Stop the cluster this executor started (a joined one keeps running)."""
        import ray

        if self._started:
            ray.shutdown()
            self._started = False

    def train(self, jobs: list[Job], cache_dir: str, stamp: dict, progress: Progress) -> list[str]:
        return self.run([(j.run_id, GridWork(j, cache_dir, stamp)) for j in jobs], progress)

    def run(self, works: list, progress: Progress) -> list[str]:
        """Run each (id, work) to the end or to its failure; returns the ids that finished."""
        import ray

        self.connect()
        env, finished, flights = process_env(), [], {}
        queue = collections.deque((rid, work, 0, "") for rid, work in works)
        while queue or flights:
            while queue and self._room(flights):
                flight = self._launch(*queue.popleft(), env)
                flights.update({ref: flight for ref in flight.refs})
                progress.started(flight.run_id)
            (ref,), _ = ray.wait(list(flights), num_returns=1)
            flight = flights.pop(ref)
            why = _outcome(ref, flight.work)
            if why is None and len(flight.done | {ref}) < len(flight.refs):
                flight.done.add(ref)  # the other hosts of the slice are still running
                continue
            _land(flight, flights)
            if why is None:
                finished.append(flight.run_id)
                progress.finished(flight.run_id)
            elif why == flight.last or flight.attempt >= self.retries:
                progress.failed(flight.run_id, f"{why} (attempt {flight.attempt + 1})")
            else:
                progress.retried(flight.run_id, why)
                queue.append((flight.run_id, flight.work, flight.attempt + 1, why))
        return finished

    def _room(self, flights: dict) -> bool:
        """Runs on slices wait for a slice; on a cluster this executor started, for a free
        slot; on a joined one, CPU and GPU runs queue in Ray itself."""
        if self.resources.slice:
            return len({f.run_id for f in flights.values()}) < self.slices
        # Ray starts queued tasks in no set order, so a fixed-size cluster gets no more runs
        # than it holds and they start in the grid's order (ablation.runner.dispatch_order); a
        # joined cluster may scale up on queued demand, so every run queues there.
        return not self._slots or len(flights) < self._slots

    def _launch(self, run_id, work, attempt: int, last: str, env: dict) -> _Flight:
        import ray

        task = ray.remote(max_calls=1, max_retries=0)(_host_task)
        if not self.resources.slice:
            opts = {"num_cpus": self.resources.cpus, "num_gpus": self.resources.gpus}
            refs = [task.options(**opts).remote(work, env, attempt, "", 1, 0)]
            return _Flight(run_id, work, attempt, last, refs, None, set())
        res = ray_slice.reserve(ray_slice.parse_slice(self.resources.slice))
        hosts = res.spec.hosts
        refs = [
            task.options(**ray_slice.host_options(res, i)).remote(
                work, env, attempt, res.coordinator, hosts, i
            )
            for i in range(hosts)
        ]
        return _Flight(run_id, work, attempt, last, refs, res, set())


def _outcome(ref, work) -> str | None:
    """None when the task finished its run; else how it failed, with the run's latest
    checkpoint (a run preempted again after progress has not failed "the same way"); a stop
    at a checkpoint by SIGTERM, the preemption notice, is a failure to retry."""
    import ray

    try:
        summary = ray.get(ref)
        if not summary.get("stopped_early"):
            return None
        why = "stopped by SIGTERM (preempted?)"
    except Exception as e:  # noqa: BLE001 (every way a task can die is a retry)
        why = failure(e)
    step = work.checkpoint()
    return why if step is None else f"{why}, last checkpoint at step {step}"


def _land(flight: _Flight, flights: dict) -> None:
    """End a run's flight: stop its other hosts' tasks and give its slice back."""
    import ray

    for ref in flight.refs:
        if ref in flights:
            flights.pop(ref)
            ray.cancel(ref, force=True)
    if flight.reservation is not None:
        ray_slice.release(flight.reservation)
