"""The CLI: a short run on configs/micro.py writes metrics with the fixed names; bad flags fail fast."""

import json
import os
import subprocess
import sys

import pytest

from ebpo_jax.runtime.metrics import METRIC_NAMES

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
    # Not a terminal: progress lines; the summary names the last evaluation and its step.
    assert "step 1/4: compiling" in out.stdout and "step 4/4 | reward" in out.stdout
    end = f"-> {100 * rows[-1]['eval/pass@1']:.1f}% (step 4)"
    assert end in out.stdout and not os.path.exists(tmp_path / ".lock")
    again = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}")  # finished
    assert again.returncode == 0 and end in again.stdout, again.stderr[-3000:]
    assert "Metadata file does not exist" not in again.stderr


def test_bad_fields_fail_before_compiling(tmp_path):
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}", "--config.gruop_size=2")
    assert out.returncode == 2 and "gruop_size" in out.stderr
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}", "--config.group_size=0")
    assert out.returncode == 2
    assert "error: group_size must be >= 1, got 0" in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.slow  # two CLI runs, each compiling: ~40 s idle, 4 min on a loaded 2-core CPU
def test_sigterm_saves_and_resumes(tmp_path):
    """A real SIGTERM mid-run: the step in progress finishes, is checkpointed, and the process
    exits 0; running the same command again continues from that step."""
    import signal
    import time

    flags = [
        "--config=configs/micro.py",
        f"--config.workdir={tmp_path}",
        "--config.total_steps=100000",
        "--config.eval_every=100000",
        "--config.checkpoint_every=100000",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:  # eval + 3 steps
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = int(max(os.listdir(tmp_path / "checkpoints"), key=int))
    assert "signal 15" in out + err and saved == steps[-1] >= 3
    assert steps == list(range(saved + 1))  # every step logged once, none after the save
    again = _run(*flags[:2], f"--config.total_steps={saved + 2}", "--config.eval_every=100000")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {saved}" in again.stdout + again.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(saved + 3))


@pytest.mark.slow  # one more micro run (~50 s on the loaded 2-core machine)
def test_micro_run_with_clip_cov(tmp_path):
    flags = ("--config.loss.name=clip_cov", "--config.loss.clip_cov_lb=-1e9")
    out = _run("--config=configs/micro.py", f"--config.workdir={tmp_path}", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f][1:]
    assert all(r["actor/cov_frac"] > 0 for r in rows), [r["actor/cov_frac"] for r in rows]
