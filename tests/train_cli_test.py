"""The CLI: a short run on configs/micro.py writes metrics with the fixed names; bad flags fail fast."""

import json
import os
import subprocess
import sys

from ebpo_jax.metrics import METRIC_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*flags, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device, as a user would run it
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_micro_run_writes_fixed_metric_names(tmp_path):
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out pass@1" in out.stdout and str(tmp_path) in out.stdout
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows[1:]:
        missing = set(METRIC_NAMES) - {"eval/pass@1"} - set(row)
        assert not missing, missing
    assert all("eval/pass@1" in rows[s] for s in (0, 2, 4))
    assert rows[-1]["perf/generated_tokens_total"] == sum(r["perf/step_tokens"] for r in rows[1:])
    assert os.listdir(tmp_path / "tb")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_bad_fields_fail_before_compiling(tmp_path):
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}", "--config.gruop_size=2")
    assert out.returncode != 0 and "gruop_size" in out.stderr
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}", "--config.group_size=0")
    assert out.returncode != 0
    assert "ConfigError: group_size must be >= 1, got 0" in out.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")
