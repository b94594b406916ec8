"""A real 2-process CPU run of experiments/train.py (4 fake devices each, one 8-device mesh):
both exit 0, process 0 alone writes metrics, and a second run resumes from the checkpoint."""

import json
import os

import pytest
from helpers import start_trainers


def _launch(workdir, *flags):
    """Runs train.py as two processes; returns their (returncode, output)."""
    procs = start_trainers(workdir, *flags)
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


_HOST_REWARD_RUN = """
import sys
import numpy as np
from ebpo_jax.runtime import distributed
distributed.initialize()
from ebpo_jax.config import load_sibling
from ebpo_jax.trainer import loop
c = load_sibling(sys.argv[2], "micro.py").get_config()
c.unlock()
c.workdir, c.total_steps, c.steps_per_jit, c.mesh.shape = sys.argv[1], 1, 1, (-1,)
def host_reward(ro):  # a reward that differs row to row, so a misplaced block changes the step
    return (np.asarray(ro.tokens).sum(-1) % 3 / 2).astype(np.float32)
loop.train(c, host_reward=host_reward)
"""


@pytest.mark.slow  # two processes and then one compile micro's step
def test_two_processes_each_score_their_block_of_a_host_reward(tmp_path):
    """Each process scores its 2 of the 4 prompts (distributed.map_row_blocks): the step's
    rewards, loss and gradient are those of one process scoring all 4 on the same mesh."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_HOST_REWARD_RUN)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = os.path.join(root, "configs", "x.py")

    def as_script(i, cmd, name="two"):
        return [sys.executable, str(script), str(tmp_path / name), configs]

    procs = start_trainers(tmp_path / "two", wrap=as_script)
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-3000:] for o in outs]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    one = subprocess.run(as_script(0, None, "one"), cwd=root, env=env, capture_output=True,
                         text=True, timeout=400)  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    rows = {}
    for name in ("two", "one"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows[name] = [json.loads(line) for line in f][-1]
    assert rows["two"]["step"] == rows["one"]["step"] == 1
    assert rows["two"]["reward/std"] > 0  # the rows' rewards differ
    assert rows["two"]["reward/mean"] == rows["one"]["reward/mean"]
    for key in ("actor/pg_loss", "actor/grad_norm"):  # rows scored out of place move these
        assert rows["two"][key] == pytest.approx(rows["one"][key], rel=1e-5), key
