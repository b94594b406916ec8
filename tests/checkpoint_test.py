"""Tests for orbax checkpointing of arbitrary pytrees and the preemption guard."""

import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import flip_a_byte
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax.runtime.checkpoint import Checkpointer, CheckpointError, PreemptionGuard, list_steps


def _tree(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "params": {
            "w": jax.random.normal(k[0], (8, 4), jnp.float32),
            "emb": jax.random.normal(k[1], (16, 8), jnp.bfloat16),
        },
        "opt": (jnp.int32(7 + seed), jnp.zeros((3,), jnp.float32) + seed),
        "eb": {"count": jnp.arange(4, dtype=jnp.uint32), "flag": jnp.array([True, False])},
        "rng": k[2],  # a typed PRNG key
        "raw_key": jax.random.key_data(jax.random.PRNGKey(seed)),
    }


def _assert_tree_equal(a, b):
    ta, tb = jax.tree.structure(a), jax.tree.structure(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_pytree_and_extra(tmp_path):
    np_rng = np.random.default_rng(123)
    np_rng.random(5)
    extra = {
        "data": {"epoch": 2, "position": 17},
        "np_rng": np_rng.bit_generator.state,  # holds 128-bit integers
        "note": "hi",
    }
    tree = _tree()
    # An optax state brings NamedTuples, empty nodes and schedule counters.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    tree["opt"] = tx.update(tree["params"], tx.init(tree["params"]), tree["params"])[1]
    tree["ref"] = None
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.latest_step() is None
        assert ck.save(5, tree, extra)
    # A fresh manager (as after a restart) restores onto an abstract target.
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.latest_step() == 5
        got, got_extra = ck.restore(target=jax.eval_shape(lambda: tree))
    _assert_tree_equal(got, tree)
    assert got_extra == extra
    resumed = np.random.default_rng()
    resumed.bit_generator.state = got_extra["np_rng"]
    np.testing.assert_array_equal(resumed.random(4), np_rng.random(4))


def test_keep_last_k_save_every_and_restore_latest(tmp_path):
    with Checkpointer(tmp_path / "ck", max_to_keep=2, save_every=3) as ck:
        saved = [s for s in range(10) if ck.save(s, _tree(s), {"step": s})]
        assert saved == [0, 3, 6, 9]
        assert not ck.save(9, _tree(0), force=True)  # an existing step is never overwritten
        assert ck.save(10, _tree(10), {"step": 10}, force=True)  # e.g. on preemption
        ck.wait()
        assert ck.all_steps() == [9, 10] and ck.latest_step() == 10
        assert sorted(os.listdir(tmp_path / "ck")) == ["10", "9"]
        assert not ck.should_save(10) and ck.should_save(12) and not ck.should_save(13)
        got, extra = ck.restore(target=_tree(0))
        _assert_tree_equal(got, _tree(10))
        assert extra == {"step": 10}
        got, extra = ck.restore(9, target=_tree(0))
        _assert_tree_equal(got, _tree(9))
        with pytest.raises(FileNotFoundError, match="step 3"):
            ck.restore(3)


def test_restore_without_checkpoint_names_directory(tmp_path):
    with Checkpointer(tmp_path / "empty") as ck, pytest.raises(FileNotFoundError, match="empty"):
        ck.restore()


def test_unfinished_save_never_hides_previous_checkpoint(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, _tree(1), {"step": 1})
    # Simulate a crash mid-save of step 2: its data sits in orbax's tmp dir, never renamed,
    # one copy complete and one with its array data missing.
    shutil.copytree(tmp_path / "ck" / "1", tmp_path / "ck" / "2.orbax-checkpoint-tmp-1700000000")
    partial = tmp_path / "ck" / "3.orbax-checkpoint-tmp-1700000001"
    shutil.copytree(tmp_path / "ck" / "1", partial)
    shutil.rmtree(partial / "state" / "d")
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.latest_step() == 1
        got, extra = ck.restore(target=_tree(0))
        _assert_tree_equal(got, _tree(1))
        assert extra == {"step": 1}
        assert ck.save(2, _tree(2), {"step": 2})  # the next save of that step still works
        ck.wait()
        _assert_tree_equal(ck.restore(target=_tree(0))[0], _tree(2))


_CRASH_SCRIPT = """
import os, sys
import jax.numpy as jnp
from ebpo_jax.runtime.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1])
ck.save(1, {"w": jnp.full((4,), 1.0)}, {"step": 1})
ck.wait()
ck.save(2, {"w": jnp.full((2048, 2048), 2.0)}, {"step": 2})  # async: returns before commit
os._exit(1)  # die while the background write of step 2 is in flight
"""


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    ckdir = str(tmp_path / "ck")
    env = dict(os.environ, XLA_FLAGS="")
    subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, ckdir], env=env, check=False)
    with Checkpointer(ckdir) as ck:
        step = ck.latest_step()
        assert step in (1, 2)  # 2 only if the write won the race; never a broken step
        got, extra = ck.restore()
        assert extra == {"step": step} and float(got["w"].reshape(-1)[0]) == step


def test_restore_onto_sharding(tmp_path):
    devices = jax.devices()
    assert len(devices) == 8
    tree = {"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.arange(8, dtype=jnp.int32)}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(0, jax.device_put(tree, devices[0]))
        mesh = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        shardings = {"w": NamedSharding(mesh, P("data", "tp")), "b": NamedSharding(mesh, P("tp"))}
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )
        got, _ = ck.restore(target=target)
    for name, want in tree.items():
        assert got[name].sharding == shardings[name]
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want))
    assert len(got["w"].addressable_shards) == 8
    assert got["w"].addressable_shards[0].data.shape == (2, 4)


_READ_ON_ONE_DEVICE = """
import sys
from ebpo_jax.runtime.checkpoint import Checkpointer
with Checkpointer(sys.argv[1]) as ck:
    got, extra = ck.restore()
print(type(got["w"]).__name__, got["w"].sum(), got["b"].tolist(), repr(got["n"]), extra)
"""


def test_restore_without_target_reads_another_topology_as_host_arrays(tmp_path):
    """A pod's checkpoint (its arrays on devices this machine lacks) reads on one device."""
    mesh = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "tp")))
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, {"w": w, "b": jnp.arange(3), "n": 7}, {"step": 3})
    env = dict(os.environ, XLA_FLAGS="")  # one CPU device: the saved devices 1-7 are absent
    run = subprocess.run(
        [sys.executable, "-c", _READ_ON_ONE_DEVICE, str(tmp_path / "ck")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "ndarray 2016.0 [0, 1, 2] 7 {'step': 3}"


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path / "a", save_every=0)
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path / "b", max_to_keep=0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_sets_flag_and_handlers_are_restored(signum):
    before = signal.getsignal(signum)
    with PreemptionGuard() as guard:
        assert not guard.requested
        os.kill(os.getpid(), signum)
        assert guard.requested and guard.signum == signum
        if signum == signal.SIGINT:  # a second Ctrl-C still interrupts
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signum) is before


# Issue 22: corrupt latest steps are named and skipped; a flipped byte is caught.
def _three_steps(directory):
    with Checkpointer(directory, max_to_keep=None) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": np.arange(256, dtype=np.float32) + step}, {"step": step})


def _corrupt_flip(step_dir):
    flip_a_byte(step_dir)


def _corrupt_json(step_dir):
    (step_dir / "extra" / "metadata").write_text('{"step": 3')


def _corrupt_missing_arrays(step_dir):
    shutil.rmtree(step_dir / "state")


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_json, _corrupt_missing_arrays])
def test_corrupt_latest_step_falls_back_to_the_previous(tmp_path, corrupt):
    directory = tmp_path / "checkpoints"
    _three_steps(directory)
    corrupt(directory / "3")
    lines = []
    with Checkpointer(directory) as ck:
        step, tree, extra = ck.restore_intact({"w": np.zeros(256, np.float32)}, log=lines.append)
        assert step == 2 and extra == {"step": 2}
        np.testing.assert_array_equal(tree["w"], np.arange(256, dtype=np.float32) + 2)
        assert len(lines) == 1 and "step 3" in lines[0] and "falling back to step 2" in lines[0]
        # The corrupt step is moved aside, so the run can save step 3 again.
        assert ck.all_steps() == [1, 2]
        assert ck.save(3, {"w": np.ones(256, np.float32)}, {"step": 3})
    assert len(os.listdir(tmp_path / "checkpoints.corrupt")) == 1


def test_flipped_byte_is_caught_by_restore(tmp_path):
    directory = tmp_path / "checkpoints"
    _three_steps(directory)
    _corrupt_flip(directory / "3")
    with Checkpointer(directory) as ck, pytest.raises(CheckpointError, match="step 3.*SHA-256"):
        ck.restore(3, {"w": np.zeros(256, np.float32)})


def test_stray_empty_step_folder_is_skipped(tmp_path):
    directory = tmp_path / "checkpoints"
    _three_steps(directory)
    os.makedirs(directory / "99")
    lines = []
    with Checkpointer(directory) as ck:
        got = ck.restore_intact({"w": np.zeros(256, np.float32)}, log=lines.append)
    assert got[0] == 3
    assert len(lines) == 1 and "step 99" in lines[0] and "falling back to step 3" in lines[0]
    assert list_steps(str(directory)) == [1, 2, 3]


def test_no_intact_step_names_every_fault(tmp_path):
    directory = tmp_path / "checkpoints"
    _three_steps(directory)
    for step in (1, 2, 3):
        _corrupt_json(directory / str(step))
    with Checkpointer(directory) as ck, pytest.raises(CheckpointError) as err:
        ck.restore_intact({"w": np.zeros(256, np.float32)}, log=lambda _: None)
    assert all(f"step {s}" in str(err.value) for s in (1, 2, 3))
    with Checkpointer(tmp_path / "empty") as ck:
        assert ck.restore_intact(log=lambda _: None) is None
