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
