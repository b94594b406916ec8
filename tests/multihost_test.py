"""A real 2-process CPU run of experiments/train.py (4 fake devices each, one 8-device mesh):
both exit 0, process 0 alone writes metrics, and a second run resumes from the checkpoint."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, *flags):
    """Runs train.py as two processes; returns their (returncode, output)."""
    addr = f"127.0.0.1:{_free_port()}"
    procs = []
    for i in range(2):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",  # CPU cross-process collectives
            JAX_COORDINATOR_ADDRESS=addr,
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        cmd = [
            sys.executable,
            os.path.join(ROOT, "experiments", "train.py"),
            "--config=configs/micro.py",
            f"--config.workdir={workdir}",
            "--config.mesh.shape=(-1,)",
            *flags,
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


@pytest.mark.slow  # ~5 min on a busy 2-core CPU: two processes compiling the micro programs, twice
def test_two_process_train_writes_metrics_once_and_resumes(tmp_path):
    first = _launch(tmp_path, "--config.total_steps=2")
    for rc, out in first:
        assert rc == 0, out[-3000:]
    assert "held-out pass@1" in first[0][1] and "held-out pass@1" not in first[1][1]
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]  # one writer: no duplicated lines
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
    second = _launch(tmp_path, "--config.total_steps=4")
    for rc, out in second:
        assert rc == 0, out[-3000:]
    assert "resumed from step 2" in second[0][1]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3, 4]
