"""The Ray executor on a real local Ray cluster (started here, stopped at the
end): the micro grid equals the local pool's, a killed task is retried and resumes to the
same results, a TPU slice (faked with Ray's TPU resource names) gets all its hosts or none,
and every host gets the same coordinator. The cluster tests are marked slow (1-4 min each on
a loaded 2-core CPU; `make test-all` runs them)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pandas as pd
import pytest

from ebpo_jax.ablation import executor, ray_executor, ray_slice, runner
from ebpo_jax.ablation import grid as grid_lib
from ebpo_jax.ablation import rerun as rerun_lib
from ebpo_jax.runtime.workdir import list_steps

ray = pytest.importorskip("ray")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE = "v5p-16"  # 8 chips: 2 hosts of 4
POD = "fake-slice"


@pytest.fixture(scope="module")
def cluster():
    """One node that advertises what a v5p-16's hosts do: TPU chips, the slice's name per
    host and the slice's head resource (TPU_NAME is how Ray reads a slice's name)."""
    before = os.environ.get("TPU_NAME")
    os.environ["TPU_NAME"] = POD  # the raylet and its workers inherit it
    ray.init(
        address="local",
        num_cpus=2,
        resources={"TPU": 8, POD: 2, f"TPU-{SLICE}-head": 1},
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _system_config=ray_executor.LOCAL_SYSTEM_CONFIG,
        log_to_driver=False,
    )
    if before is None:
        os.environ.pop("TPU_NAME")
    else:
        os.environ["TPU_NAME"] = before
    yield
    ray.shutdown()


def _grid(out_dir):
    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(out_dir)
    grid.fixed = {"total_steps": 4, "eval_every": 4, "checkpoint_every": 1}
    grid.blocks = [
        {
            "name": "main",
            "axes": {"method": ["grpo", "ebpo"], "group_size": [2]},
            "rollouts_per_step": 8,
            "fixed": {"mesh.devices": 1},
        }
    ]
    return grid


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The micro grid on the local pool (in this process): the reference rows."""
    out = runner.run_grid(_grid(tmp_path_factory.mktemp("local")), log=lambda *_: None)
    return pd.read_csv(out["results"])


def _same_rows(a, b):
    assert sorted(a.run_id.unique()) == sorted(b.run_id.unique())
    for run_id in a.run_id.unique():
        same = rerun_lib.compare_rows(a[a.run_id == run_id], b[b.run_id == run_id])
        assert same["match"], (run_id, same)


@pytest.mark.slow  # a Ray cluster and real runs: minutes on a loaded 2-core CPU
def test_micro_grid_through_ray_equals_the_local_pool(cluster, local, tmp_path):
    lines = []
    out = runner.run_grid(_grid(tmp_path), executor=ray_executor.RayExecutor(), log=lines.append)
    assert len(out["trained"]) == 2 and out["failed"] == {}
    assert any("2/2 done, 0 running, 0 retried, 0 failed" in line for line in lines), lines
    _same_rows(local, pd.read_csv(out["results"]))  # pass@1 and every curve, bitwise
    # Stopped and started again with the other executor: the finished runs are adopted.
    again = runner.run_grid(_grid(tmp_path), executor=executor.LocalPool(1), log=lambda *_: None)
    assert again["trained"] == []


def _kill_after_checkpoint(workdir: str, killed: list) -> None:
    """SIGKILL the process training in `workdir` (the pid in its lock) once it has a checkpoint."""
    deadline = time.time() + 600
    while time.time() < deadline:
        lock = os.path.join(workdir, ".lock")
        if list_steps(os.path.join(workdir, "checkpoints")) and os.path.exists(lock):
            with open(lock) as f:
                pid = int(f.read().split()[0])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.02)


@pytest.mark.slow  # a Ray cluster and real runs: minutes on a loaded 2-core CPU
def test_a_killed_task_is_retried_and_resumes_to_the_same_results(cluster, local, tmp_path):
    grid = _grid(tmp_path)
    run_id = next(r for r in local.run_id.unique() if "grpo" in r)
    killed, lines = [], []
    workdir = os.path.join(tmp_path, "runs", run_id)
    killer = threading.Thread(target=_kill_after_checkpoint, args=(workdir, killed))
    killer.start()
    out = runner.run_grid(
        grid,
        select=runner.Selection(only="grpo"),
        executor=ray_executor.RayExecutor(),
        log=lines.append,
    )
    killer.join()
    assert killed and out["trained"] == [run_id] and out["failed"] == {}
    assert any(f"retry {run_id}" in line for line in lines), lines
    assert any("1/1 done, 0 running, 1 retried, 0 failed" in line for line in lines), lines
    _same_rows(local[local.run_id == run_id], pd.read_csv(out["results"]))


def _command(out_dir: str, code: str) -> ray_executor.CommandWork:
    return ray_executor.CommandWork((sys.executable, "-c", code, out_dir))


# Each host writes its coordinates, then starts jax.distributed with them (2 CPU processes).
_HOST = """
import json, os, sys
keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
env = {k: os.environ[k] for k in keys}
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.distributed.initialize(*(env[k] for k in keys[:1]), *(int(env[k]) for k in keys[1:]))
env["process_count"] = jax.process_count()
with open(os.path.join(sys.argv[1], env["JAX_PROCESS_ID"]), "w") as f:
    json.dump(env, f)
"""


@pytest.mark.slow  # a Ray cluster and real runs: minutes on a loaded 2-core CPU
def test_launch_gets_a_slice_all_its_hosts_or_none_with_one_coordinator(cluster, tmp_path):
    """experiments/launch.py --slice=v5p-16 -- CMD, joining this cluster: CMD waits while
    one host of the slice is busy, then runs on both hosts with the same coordinator."""

    @ray.remote(num_cpus=0, resources={"TPU": 4, POD: 1})
    class Busy:  # holds one host of the slice
        def ping(self):
            return True

    busy = Busy.remote()
    assert ray.get(busy.ping.remote())
    address = ray.get_runtime_context().gcs_address
    launch = [sys.executable, os.path.join(REPO, "experiments", "launch.py")]
    flags = [f"--ray_address={address}", f"--slice={SLICE}", "--retries=0", "--"]
    proc = subprocess.Popen([*launch, *flags, sys.executable, "-c", _HOST, str(tmp_path)])
    try:
        time.sleep(15)  # one host is free, the other busy: neither may start
        assert os.listdir(tmp_path) == [] and proc.poll() is None
        ray.kill(busy)
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    hosts = [json.loads((tmp_path / str(i)).read_text()) for i in range(2)]
    assert hosts[0]["JAX_COORDINATOR_ADDRESS"] == hosts[1]["JAX_COORDINATOR_ADDRESS"]
    node = ray.nodes()[0]["NodeManagerAddress"]  # host 0's address as Ray's nodes reach it
    assert hosts[0]["JAX_COORDINATOR_ADDRESS"].startswith(f"{node}:")
    assert [h["process_count"] for h in hosts] == [2, 2]
    assert ray.available_resources().get(POD) == 2  # the slice is given back


def _progress(total: int, log) -> executor.Progress:
    """A grid's progress without a bar: only the counts and the logged lines."""
    bar = types.SimpleNamespace(set_postfix_str=lambda _: None, update=lambda: None)
    return executor.Progress(bar, total=total, done=0, log=log)


@pytest.mark.slow  # a Ray cluster and real runs: minutes on a loaded 2-core CPU
def test_a_run_that_fails_the_same_way_twice_is_reported_and_the_rest_go_on(cluster, tmp_path):
    lines = []
    progress = _progress(total=2, log=lines.append)
    works = [
        ("bad", _command(str(tmp_path), "raise SystemExit('no such dataset')")),
        ("good", _command(str(tmp_path), "pass")),
    ]
    assert ray_executor.RayExecutor(retries=5).run(works, progress) == ["good"]
    assert list(progress.failures) == ["bad"] and "no such dataset" in progress.failures["bad"]
    assert progress.counts == {"done": 1, "running": 0, "retried": 1, "failed": 1}


def test_running_counts_the_attempts_in_flight_not_the_retries_waiting_in_the_queue():
    lines = []
    progress = _progress(total=2, log=lines.append)
    progress.started("a"), progress.started("b")
    progress.retried("a", "WorkerCrashedError")  # a waits behind the queue: one in flight
    assert lines[-1].endswith("(0/2 done, 1 running, 1 retried, 0 failed)"), lines
    progress.started("a")
    progress.finished("b"), progress.finished("a")
    assert progress.counts == {"done": 2, "running": 0, "retried": 1, "failed": 0}


def test_a_started_cluster_holds_as_many_runs_as_its_slots():
    cpus = lambda n: ray_executor.RayResources(cpus=n)
    assert ray_executor.slots({"CPU": 2.0}, cpus(1)) == 2
    assert ray_executor.slots({"CPU": 16.0, "GPU": 1.0}, ray_executor.RayResources(1, 0.5)) == 2
    assert ray_executor.slots({"CPU": 2.0}, cpus(4)) == 1  # Ray says when it cannot place it
    ex = ray_executor.RayExecutor()
    ex._slots = 2
    assert ex._room({}) and ex._room({"a": None}) and not ex._room({"a": None, "b": None})
    ex._slots = 0  # a joined cluster: every run queues in Ray
    assert ex._room({str(i): None for i in range(50)})


def test_slice_types_parse_to_hosts_and_chips():
    assert ray_slice.parse_slice("v5p-64") == ray_slice.SliceSpec("v5p-64", 8, 4)
    assert ray_slice.parse_slice("v4-8") == ray_slice.SliceSpec("v4-8", 1, 4)
    assert ray_slice.parse_slice("v5litepod-16") == ray_slice.SliceSpec("v5litepod-16", 4, 4)
    assert ray_slice.parse_slice("v6e-8") == ray_slice.SliceSpec("v6e-8", 1, 8)
    assert ray_slice.parse_slice("v5p-16").head == "TPU-v5p-16-head"
    with pytest.raises(ValueError, match="--slice='v9-8': not a TPU slice type"):
        ray_slice.parse_slice("v9-8")


@pytest.mark.slow
def test_executor_bench_smoke():
    """benchmarks/executor_bench.py runs both executors once and finds equal results."""
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="")  # one device, as a user runs it
    run = subprocess.run(
        [sys.executable, "benchmarks/executor_bench.py", "--repeats=1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "results equal" in run.stdout and "overhead per run" in run.stdout
