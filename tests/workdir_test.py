"""The run's folder: writability, free space, the exclusive lock, refusing silent restarts,
and the saved-config comparison on resume (issue 22)."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from ebpo_jax.config import default_config
from ebpo_jax.runtime import workdir as W
from ebpo_jax.spec import resolve


def test_checkpoints_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "checkpoints").write_text("oops")
    with pytest.raises(W.WorkdirError, match=r"checkpoints is a file, not a folder"):
        W.check_writable(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_workdir_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(W.WorkdirError, match="not writable"):
            W.check_writable(str(tmp_path))
    finally:
        tmp_path.chmod(0o700)


def test_unwritable_workdir_is_refused(tmp_path):
    # What a read-only workdir looks like to root too: a folder that cannot be created.
    (tmp_path / "file").write_text("x")
    with pytest.raises(W.WorkdirError, match=r"cannot create workdir .*file/run"):
        W.check_writable(str(tmp_path / "file" / "run"))


def test_free_space_is_checked(tmp_path):
    W.check_writable(str(tmp_path), min_free_bytes=1)
    with pytest.raises(W.WorkdirError, match=r"MiB free, the run needs at least"):
        W.check_writable(str(tmp_path), min_free_bytes=1 << 62)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".write-probe")]


def test_checkpoint_bytes():
    import jax
    import jax.numpy as jnp

    tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16)}
    assert W.checkpoint_bytes(tree) == 3 * 4 * 4 + 8 * 2


def test_lock_is_exclusive_and_names_the_owner(tmp_path):
    with W.WorkdirLock(str(tmp_path)):
        # Another process (flock locks are per open file, so a second process is the test).
        code = (
            "import sys; from ebpo_jax.runtime import workdir as W\n"
            "try:\n    W.WorkdirLock(sys.argv[1]).acquire()\n"
            "except W.WorkdirError as e:\n    print(e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        ).stdout
        assert out.strip() == f"workdir {tmp_path} is in use by pid {os.getpid()}"
    # Released: a new holder gets it.
    with W.WorkdirLock(str(tmp_path)) as again:
        assert again._fd is not None


def test_lock_file_is_removed_on_release_and_a_lock_on_a_removed_file_is_not_taken(tmp_path):
    lock = W.WorkdirLock(str(tmp_path)).acquire()
    assert (tmp_path / W.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    # A second opener of the same file that locks only after the release (the race a removal
    # opens) must notice that its file is gone and lock the path's new file instead.
    stale = os.open(tmp_path / W.LOCK_FILE, os.O_RDWR)
    lock.release()
    assert not (tmp_path / W.LOCK_FILE).exists()
    other = W.WorkdirLock(str(tmp_path))
    fds = [stale]

    def lock_once():  # first the stale fd (opened before the removal), then the real path
        if fds:
            fcntl.flock(fds[0], fcntl.LOCK_EX)
            return fds.pop()
        return W.WorkdirLock._lock_once(other)

    other._lock_once = lock_once
    other.acquire()
    assert os.fstat(other._fd).st_ino == os.stat(tmp_path / W.LOCK_FILE).st_ino
    other.release()
    assert not (tmp_path / W.LOCK_FILE).exists()


def test_lock_of_a_killed_process_is_free(tmp_path):
    code = "import sys, os; from ebpo_jax.runtime import workdir as W\nW.WorkdirLock(sys.argv[1]).acquire()\nos._exit(0)\n"
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    W.WorkdirLock(str(tmp_path)).acquire().release()  # the stale .lock file does not block


def test_metrics_without_checkpoints_refuses_to_start_over(tmp_path):
    assert W.check_workdir(str(tmp_path), restart=False) == "fresh"
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(W.WorkdirError, match=r"has metrics.jsonl but no checkpoint.*restart=True"):
        W.check_workdir(str(tmp_path), restart=False)
    assert W.check_workdir(str(tmp_path), restart=True) == "restart"
    os.makedirs(tmp_path / "checkpoints" / "50")
    assert W.check_workdir(str(tmp_path), restart=False) == "resume"


def _cfg(**changes):
    c = default_config()
    for k, v in changes.items():
        node = c
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return c.to_dict()


def test_resume_with_another_config_is_refused_and_harmless_changes_kept(tmp_path):
    wd = str(tmp_path)
    assert W.reconcile_config(wd, _cfg(), resuming=False) == []
    saved = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(W.WorkdirError, match=r"optimizer.learning_rate: 1e-06 -> 0.001"):
        W.reconcile_config(wd, _cfg(**{"optimizer.learning_rate": 1e-3}), resuming=True)
    assert json.loads((tmp_path / "config.json").read_text()) == saved  # not overwritten
    logs = []
    changed = W.reconcile_config(wd, _cfg(total_steps=500), resuming=True, log=logs.append)
    assert changed == ["total_steps"] and "total_steps" in logs[0]
    assert json.loads((tmp_path / "config.1.json").read_text()) == saved  # history
    assert json.loads((tmp_path / "config.json").read_text())["total_steps"] == 500
    # A field added later with a None default (an estimator option) is no change.
    old = _cfg(total_steps=500)
    del old["estimator_options"]["forgetting"]
    assert W.config_diff(old, _cfg(total_steps=500)) == []
    # The same config again: nothing changes, no new history file.
    assert W.reconcile_config(wd, _cfg(total_steps=500), resuming=True) == []
    assert not (tmp_path / "config.2.json").exists()


def test_prepare_workdir_runs_every_check(tmp_path):
    c = default_config()
    c.workdir = str(tmp_path / "run")
    spec = resolve(c)
    lock = W.prepare_workdir(spec, min_free_bytes=1)
    try:
        assert (tmp_path / "run" / "config.json").exists()
        with pytest.raises(W.WorkdirError, match="in use by pid"):
            # flock is per open file description: a second acquire in-process conflicts too.
            W.prepare_workdir(spec, min_free_bytes=1)
    finally:
        lock.release()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(W.WorkdirError, match="no checkpoint"):
        W.prepare_workdir(spec, min_free_bytes=1)
    c.restart = True
    W.prepare_workdir(resolve(c), min_free_bytes=1).release()  # the lock is released on errors too


def test_a_field_added_since_the_run_was_saved_at_its_default_is_no_change(tmp_path):
    """Upgrading the code adds config fields: a run saved before them still resumes."""
    c = default_config()
    old = c.to_dict()
    del old["log_every_s"], old["sft"]["seed"]  # as a config.json written before they existed
    (tmp_path / "config.json").write_text(json.dumps(old))
    defaults = default_config().to_dict()  # what the loop passes
    got = W.reconcile_config(str(tmp_path), c.to_dict(), resuming=True, defaults=defaults)
    assert got == []
    with pytest.raises(W.WorkdirError, match=r"sft.seed: '<absent>' -> -1"):  # no defaults given
        W.reconcile_config(str(tmp_path), c.to_dict(), resuming=True, write=False)
    c.sft.seed = 3  # not the default: a real change, refused as before
    with pytest.raises(W.WorkdirError, match=r"sft.seed: '<absent>' -> 3"):
        W.reconcile_config(str(tmp_path), c.to_dict(), resuming=True, defaults=defaults)
