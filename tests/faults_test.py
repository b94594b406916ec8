"""Issue 30's faults, each reproduced: a poisoned "last good" checkpoint, an unverified newest
step after kill -9, metrics lost without a word, a refused resume that writes the workdir,
and errors that end in tracebacks (full disk, all-too-long data, unknown family, no config)."""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import flip_a_byte, micro_config, save_tiny_tokenizer

from ebpo_jax import cli
from ebpo_jax.config import ConfigError, default_config
from ebpo_jax.data import DataError
from ebpo_jax.runtime.checkpoint import MANIFEST, Checkpointer, list_steps
from ebpo_jax.runtime.metrics import MetricsWriter, read_metrics
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task
from ebpo_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*flags, timeout=600, devices=1, **popen):
    """experiments/train.py on `devices` CPU devices (one: as a user runs it)."""
    xla = f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *flags]
    if popen:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, **popen)
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def _nonfinite(tree) -> int:
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return sum(int((~np.isfinite(x)).sum()) for x in leaves if x.dtype.kind == "f")


_micro = micro_config


# 1. A step whose update makes the params or Adam moments non-finite is skipped; 3. metrics
# rows are durable at each checkpoint. One in-process run serves both.
@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A micro run at lr 1e30, checkpointed every step, spying on fsync: (workdir, error
    message, names of the files fsynced).

    Step 1's AdamW update leaves the params huge but finite; step 2's makes them inf
    although its loss and gradient are finite (before issue 30, checkpoint 2 held them).
    """
    workdir = tmp_path_factory.mktemp("poisoned")
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    mp = pytest.MonkeyPatch()
    mp.setattr(os, "fsync", spy)
    try:
        with pytest.raises(loop.NonFiniteError) as e:
            loop.train(_poisoned(workdir, total_steps=6), log=lambda *_: None)
    finally:
        mp.undo()
    return workdir, str(e.value), synced


def _poisoned(workdir, **fields):
    base = {
        "optimizer.learning_rate": 1e30,
        "checkpoint_every": 1,
        "max_nonfinite_steps": 2,
        "eval_every": 6,
    }
    return _micro(workdir, **{**base, **fields})


def _check_finite(workdir) -> list[int]:
    """Every checkpoint's params and Adam moments are finite, none is of a skipped step;
    returns the checkpointed steps."""
    steps = list_steps(os.path.join(workdir, "checkpoints"))
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ck:
        for step in steps:
            tree, _ = ck.restore(step)
            assert _nonfinite({"p": tree["params"], "o": tree["opt_state"]}) == 0, step
    rows = read_metrics(str(workdir))
    skipped = [r["step"] for r in rows if r.get("train/skipped_updates")]
    assert skipped and steps and not set(skipped) & set(steps[:-1]), (skipped, steps)
    return steps


def _check_poisoned(workdir, message):
    """_check_finite, and `message` names the last checkpoint as the last good one."""
    steps = _check_finite(workdir)
    assert steps[-1] not in [
        r["step"] for r in read_metrics(str(workdir)) if r.get("train/skipped_updates")
    ]
    assert message.startswith("2 steps in a row")
    assert f"last good checkpoint: step {steps[-1]} in" in message, (steps, message)


def test_a_step_that_makes_the_state_nonfinite_is_skipped(poisoned):
    _check_poisoned(poisoned[0], poisoned[1])


def test_a_nonfinite_stop_is_one_error_line_and_exit_1(monkeypatch, capsys):
    def main(_):
        raise loop.NonFiniteError("2 steps in a row ...; last good checkpoint: step 1 in x")

    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        cli.run(main)
    assert e.value.code == 1
    assert (
        capsys.readouterr().err
        == "error: 2 steps in a row ...; last good checkpoint: step 1 in x\n"
    )


@pytest.mark.slow  # a CLI run
def test_a_nonfinite_stop_through_the_cli(tmp_path):
    out = _cli(
        "--config=configs/micro.py",
        f"--config.workdir={tmp_path}",
        "--config.optimizer.learning_rate=1e30",
        "--config.total_steps=8",
        "--config.checkpoint_every=1",
        "--config.max_nonfinite_steps=2",
    )
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[-20:]
    _check_poisoned(tmp_path, lines[0].removeprefix("error: "))


@pytest.mark.slow  # two more runs
@pytest.mark.parametrize(
    "fields",
    [
        {"steps_per_jit": 2, "checkpoint_every": 2},
        {"rollout.max_staleness": 1, "sampler.mesh": "data=1", "mesh.shape": (1,)},
    ],
)
def test_skipped_steps_in_the_scan_runner_and_at_staleness_1(tmp_path, fields):
    """A stop inside the streak saves the state the skipped steps kept: finite."""
    c = _poisoned(tmp_path, total_steps=8, max_nonfinite_steps=100, **fields)
    s = loop.train(c, log=lambda *_: None, stop_after=4)
    assert s["step"] == 4 and _check_finite(tmp_path)[-1] == 4


# 2. The newest step is verifiable the moment it is committed (a kill -9 right after).
def test_the_newest_step_carries_its_checksums_from_its_commit(tmp_path):
    directory = str(tmp_path / "checkpoints")
    ck = Checkpointer(directory, max_to_keep=None)
    for step in (1, 2):
        ck.save(step, {"w": np.arange(256, dtype=np.float32) + step}, {"step": step})
    t0 = time.monotonic()
    while 2 not in list_steps(directory):  # committed; the process is then abandoned
        assert time.monotonic() - t0 < 60
        time.sleep(0.01)
    assert os.path.exists(os.path.join(directory, "2", MANIFEST))
    flip_a_byte(os.path.join(directory, "2"))
    lines = []
    with Checkpointer(directory) as fresh:
        step, tree, _ = fresh.restore_intact({"w": np.zeros(256, np.float32)}, log=lines.append)
    assert step == 1 and "SHA-256" in lines[0] and "falling back to step 1" in lines[0]
    np.testing.assert_array_equal(tree["w"], np.arange(256, dtype=np.float32) + 1)
    ck.close()


# 3. Metrics rows are durable at each checkpoint; a loss is said once and recorded.
def test_metrics_rows_are_fsynced_at_each_checkpoint(poisoned):
    assert "metrics.jsonl" in poisoned[2]


def _resume(poisoned, tmp_path, damage):
    """Resume a copy of the poisoned run's workdir (at its checkpoint, step 1: no step runs)
    after `damage(metrics path)`; (log lines, metrics rows)."""
    workdir = tmp_path / "run"
    shutil.copytree(poisoned[0], workdir)
    damage(workdir / "metrics.jsonl")
    logs = []
    loop.train(_poisoned(workdir, total_steps=1), log=logs.append)
    return logs, read_metrics(str(workdir))


def test_a_resume_names_metrics_lost_since_the_checkpoint(poisoned, tmp_path):
    logs, rows = _resume(poisoned, tmp_path, os.remove)
    said = [line for line in logs if "no rows for steps" in line]
    assert (
        len(said) == 1 and "no rows for steps 1, which the checkpoint covers (steps 1-1)" in said[0]
    ), logs
    assert rows == [{"step": 1, "metrics_gap": [[1, 1]]}]


def test_a_torn_row_of_a_checkpointed_step_is_named(poisoned, tmp_path):
    def tear(path):  # step 1's row last (what followed was never checkpointed), cut short
        lines = path.read_text().splitlines(keepends=True)
        assert [json.loads(x)["step"] for x in lines[:2]] == [0, 1]
        path.write_text(lines[0] + lines[1][:-20])

    logs, rows = _resume(poisoned, tmp_path, tear)
    assert any("torn last line" in line and "the row of step 1" in line for line in logs), logs
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["metrics_gap"] == [[1, 1]]


def test_metrics_flush_fsyncs(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    with MetricsWriter(str(tmp_path), remote=False, tensorboard=False) as w:
        w.write(1, {"x": 1.0})
        w.flush()
    assert len(synced) == 1


# 4. A refused resume writes nothing to the workdir.
def _listing(workdir):
    return {
        os.path.relpath(os.path.join(r, f), workdir): os.path.getmtime(os.path.join(r, f))
        for r, _, fs in os.walk(workdir)
        for f in fs
        if f != ".lock"
    }


def test_a_refused_lora_resume_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    with Checkpointer(str(workdir / "checkpoints")) as ck:  # adapters of rank 2, no config.json
        ck.save(2, {"params": np.zeros(4, np.float32)}, {"lora_base": {"rank": 2}, "data": {}})
    before = _listing(workdir)
    with pytest.raises(ConfigError, match="rank: checkpoint 2 vs config 4"):
        loop.train(_micro(workdir, **{"model.lora.rank": 4}), log=lambda *_: None)
    assert _listing(workdir) == before  # no config.json: the original rank still resumes


# 5. One error line, and the workdir untouched, for what a user gets wrong.
def test_an_unknown_task_family_is_refused_before_the_workdir_exists(tmp_path):
    with pytest.raises(ConfigError, match="task.family='nope'"):
        loop.train(_micro(tmp_path / "run", **{"task.family": "nope"}), log=lambda *_: None)
    assert not os.path.exists(tmp_path / "run")


def test_a_missing_config_file_is_one_error_line():
    out = _cli("--config=configs/no_such_file.py", "--config.total_steps=3", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: config file: No such file or directory: 'configs/no_such_file.py'"
    ]


def test_a_data_set_of_only_too_long_prompts_is_a_data_error(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"problem": "what is one plus two", "answer": "3"}] * 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = default_config()
    c.workdir = str(tmp_path / "run")
    c.model.tokenizer_path = save_tiny_tokenizer(tmp_path / "tok")
    c.data.path, c.data.schema, c.data.template, c.data.max_prompt_len = (
        str(path),
        "math500",
        "plain",
        2,
    )
    with pytest.raises(DataError, match=r"all 4 prompts exceed .*data.max_prompt_len"):
        build_task(resolve(c).task, log=lambda *_: None)


def test_orbax_logs_go_to_a_file_and_the_rest_to_stderr(tmp_path):
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    filters, root = list(handler.filters), logging.getLogger()
    handlers = list(root.handlers)
    orbax, other = (
        logging.LogRecord("absl", logging.ERROR, path, 1, "boom", (), None)
        for path in (f"{os.sep}x{os.sep}orbax{os.sep}a.py", f"{os.sep}x{os.sep}other.py")
    )
    try:
        cli.divert_logs(str(tmp_path / "orbax.log"))
        assert not handler.filter(orbax) and handler.filter(other)  # absl's stderr handler
        for h in root.handlers[len(handlers) :]:
            h.handle(orbax)
            h.handle(other)
    finally:
        handler.filters[:] = filters
        for h in root.handlers[len(handlers) :]:
            h.close()
        root.handlers[:] = handlers
    text = (tmp_path / "orbax.log").read_text()
    assert "orbax" in text and "other.py" not in text


def _mount_tmpfs(path, size) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(cmd, check=False, capture_output=True).returncode == 0


@pytest.mark.slow  # a CLI run on a tmpfs that fills up mid-run (root only)
def test_a_full_disk_mid_run_is_one_error_line(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1100m"):  # the run wants 1 GiB free at its start
        pytest.skip("needs root to mount a tmpfs")
    try:
        workdir = disk / "run"
        flags = (
            "--config.total_steps=200",
            "--config.checkpoint_every=2",
            "--config.eval_every=200",
        )
        proc = _cli(
            "--config=configs/micro.py",
            f"--config.workdir={workdir}",
            *flags,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        while not os.path.isdir(workdir / "checkpoints" / "2") and proc.poll() is None:
            time.sleep(0.1)
        # Fill it up, 1 MiB at a time.
        with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
            for offset in range(0, 1 << 40, 1 << 20):
                os.posix_fallocate(f.fileno(), offset, 1 << 20)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
        assert "No space left" in lines[0] or "RESOURCE_EXHAUSTED" in lines[0]
        os.remove(disk / "filler")  # the user makes room, then resumes
        steps = list_steps(str(workdir / "checkpoints"))
        with Checkpointer(str(workdir / "checkpoints")) as ck:  # the saved ones stay intact
            assert ck.restore_intact(log=print)[0] == steps[-1]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
