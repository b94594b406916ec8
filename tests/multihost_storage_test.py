"""Two processes as two hosts with nothing shared but object storage: each sees its own disk at
the same path (`unshare -m` + a bind mount, as root) and has its own HOME and TMPDIR.

A local workdir they do not share is refused at start in one line; a gs:// workdir trains
with nothing written to the hosts' disks, survives a kill -9 of one host, and resumes bitwise
equal to an uninterrupted run.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import gcs_emulator
import jax
import numpy as np
import pytest

from ebpo_jax.runtime import compile_cache, metrics, storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="per-host disks need unshare -m and bind mounts (root)",
)


@pytest.fixture(scope="module")
def gcs():
    with gcs_emulator.running() as server:
        yield server


def _hosts(tmp_path, workdir, *flags, caches=None):
    """Starts train.py as 2 processes, each with its own disk bound at tmp_path/disk (and
    its own compilation cache folder from `caches`, kept across launches as a host keeps it)."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir(parents=True, exist_ok=True)
    addr = f"127.0.0.1:{gcs_emulator.free_port()}"
    procs = []
    for i in range(2):
        own = tmp_path / f"host{i}"
        for sub in ("disk", "home", "tmp"):
            (own / sub).mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            HOME=str(own / "home"),
            TMPDIR=str(own / "tmp"),
            PYTHONPATH=ROOT,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
            JAX_COORDINATOR_ADDRESS=addr,
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        if caches is not None:
            env[compile_cache.ENV] = str(caches / f"host{i}")
        else:  # each host's own HOME holds its cache, not the test run's shared folder
            env.pop(compile_cache.ENV, None)
        train = [sys.executable, os.path.join(ROOT, "experiments", "train.py")]
        train += ["--config=" + os.path.join(ROOT, "configs", "micro.py")]
        train += [f"--config.workdir={workdir}", "--config.mesh.shape=(-1,)", *flags]
        script = f'mount --bind "{own / "disk"}" "{mountpoint}" && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "bash", "-c", script, "host", *train]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=own / "disk",
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def _finish(procs, timeout=900):
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_local_workdir_the_hosts_do_not_share_is_refused_in_one_line(tmp_path):
    procs = _hosts(tmp_path, str(tmp_path / "disk" / "run"))
    outs = _finish(procs, timeout=300)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 1, out[-3000:]
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, out[-3000:]
        assert "is not shared by the 2 processes (process 1 cannot see" in errors[0]
        assert "gs://" in errors[0]
    assert not os.path.exists(tmp_path / "host0" / "disk" / "run" / "checkpoints" / "2")


def _rows(workdir):
    keep = lambda k: not k.startswith(("perf/", "phase/")) or "tokens_total" in k
    return [{k: v for k, v in r.items() if keep(k)} for r in metrics.read_metrics(workdir)]


@pytest.fixture(scope="module")
def reference(gcs, tmp_path_factory):
    """An uninterrupted 2-host run on gs://runs/mh/ref; its folder holds the hosts' disks
    ("a") and compilation caches, which later launches reuse as a host keeps them."""
    tmp = tmp_path_factory.mktemp("mh")
    procs = _hosts(tmp / "a", "gs://runs/mh/ref", caches=tmp / "caches")
    for p, out in zip(procs, _finish(procs), strict=True):
        assert p.returncode == 0, out[-3000:]
    return tmp


def test_two_hosts_train_on_gs_and_write_nothing_to_their_disks(reference):
    from ebpo_jax.runtime.checkpoint import load_params

    assert [r["step"] for r in _rows("gs://runs/mh/ref")] == [0, 1, 2, 3, 4]
    assert storage.exists("gs://runs/mh/ref/checkpoints/4/commit_success.txt")
    assert jax.tree.leaves(load_params("gs://runs/mh/ref"))
    for i in range(2):
        assert os.listdir(reference / "a" / f"host{i}" / "disk") == []


def test_two_hosts_on_gs_survive_a_kill_9_of_one_and_resume_bitwise(reference):
    from ebpo_jax.runtime.checkpoint import load_params

    tmp_path = reference
    hosts = lambda name, workdir, *flags: _hosts(
        tmp_path / name, workdir, *flags, caches=tmp_path / "caches"
    )
    procs = hosts("b", "gs://runs/mh/cut", "--config.total_steps=400")
    t0 = time.time()
    while not storage.exists("gs://runs/mh/cut/checkpoints/2/commit_success.txt"):
        assert all(p.poll() is None for p in procs), _finish(procs)[0][-3000:]
        assert time.time() - t0 < 900, "step 2 never committed"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)  # host 1 is preempted; the job restarts every host
    procs[0].send_signal(signal.SIGKILL)
    _finish(procs)
    for p, out in zip(procs := hosts("c", "gs://runs/mh/cut"), _finish(procs)):
        assert p.returncode == 0, out[-3000:]
    assert _rows("gs://runs/mh/cut") == _rows("gs://runs/mh/ref")
    assert [r["step"] for r in _rows("gs://runs/mh/ref")] == [0, 1, 2, 3, 4]
    a, b = (load_params(f"gs://runs/mh/{n}") for n in ("ref", "cut"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    for host in ("b", "c"):
        for i in range(2):
            assert os.listdir(tmp_path / host / f"host{i}" / "disk") == []
