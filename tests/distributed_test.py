"""Multi-host helpers: disjoint covering shards, the init decision, a real 2-process run."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ebpo_jax.runtime import distributed


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_process_slices_are_disjoint_and_cover(count):
    n = 48
    seen = np.concatenate(
        [np.arange(n)[distributed.process_slice(n, i, count)] for i in range(count)]
    )
    np.testing.assert_array_equal(seen, np.arange(n))  # each row exactly once, in order


def test_local_rows_splits_every_leaf_alike():
    tree = {"a": np.arange(12).reshape(6, 2), "b": np.arange(6) * 10}
    parts = [distributed.local_rows(tree, i, 3) for i in range(3)]
    np.testing.assert_array_equal(np.concatenate([p["a"] for p in parts]), tree["a"])
    np.testing.assert_array_equal(np.concatenate([p["b"] for p in parts]), tree["b"])
    np.testing.assert_array_equal(parts[1]["b"], [20, 30])


def test_bad_splits_are_clear_errors():
    with pytest.raises(ValueError, match="do not split evenly over 4 processes"):
        distributed.process_slice(10, 0, 4)
    with pytest.raises(ValueError, match="process_index 3 is not in"):
        distributed.process_slice(12, 3, 3)
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        distributed.local_rows({"a": np.zeros(4), "b": np.zeros(6)}, 0, 2)


def test_needs_initialize_only_with_several_processes():
    assert not distributed.needs_initialize({})
    assert not distributed.needs_initialize({"TPU_WORKER_HOSTNAMES": "10.0.0.2"})
    assert distributed.needs_initialize({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})
    warning = "WARNING: could not determine TPU worker hostnames, please set it, otherwise ..."
    assert not distributed.needs_initialize({"TPU_WORKER_HOSTNAMES": warning})
    assert distributed.needs_initialize({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"})
    assert distributed.needs_initialize({"SLURM_NTASKS": "4"})
    assert not distributed.needs_initialize({"SLURM_NTASKS": "1"})


def test_single_process_is_main_and_initialize_is_a_no_op():
    assert distributed.is_main_process()
    assert not distributed.initialize() or distributed.jax.distributed.is_initialized()


_WORKER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ebpo_jax.runtime import distributed
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid = int(sys.argv[2])
    report = open(sys.argv[3], "w")  # not stdout: gloo's C++ logging interleaves with it
    assert distributed.initialize(sys.argv[1], num_processes=2, process_id=pid)
    data = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3), "i": np.arange(16)}
    local = distributed.local_rows(data)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = distributed.global_batch(local, NamedSharding(mesh, P("data")))
    # Row-weighted sum: equals the single-process value only if every row sits at its place.
    total = jax.jit(lambda b: (b["x"].sum(1) * b["i"]).sum())(batch)
    mine = sorted({int(v) for s in batch["i"].addressable_shards for v in np.asarray(s.data)})
    print("RESULT", pid, distributed.is_main_process(), float(total), min(mine), max(mine),
          file=report, flush=True)
    seen = []
    def score(t):  # a host reward's shape: rows in, [rows, 1] out; "k" is no row leaf
        seen.append(sorted(int(i) for i in t["i"]))
        return t["x"].sum(1, keepdims=True) * t["i"][:, None] + t["k"]
    tree = {"x": data["x"], "i": data["i"], "k": np.float32(0.5)}
    joined = distributed.map_row_blocks(score, tree, 16)
    print("BLOCKS", pid, seen[0][0], seen[0][-1], np.array_equal(joined, score(tree)),
          file=report, flush=True)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_build_one_global_batch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    addr = f"localhost:{_free_port()}"
    reports = [tmp_path / f"report{i}.txt" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), addr, str(i), str(reports[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]  # shares the CPU with a test worker
    outs = [r.read_text() if r.exists() else "" for r in reports]
    rows = [line.split() for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(rows) == 2, logs
    x = np.arange(48, dtype=np.float32).reshape(16, 3)
    expected = float((x.sum(1) * np.arange(16)).sum())
    by_pid = {int(r[1]): r for r in rows}
    assert by_pid[0][2] == "True" and by_pid[1][2] == "False"
    assert float(by_pid[0][3]) == expected and float(by_pid[1][3]) == expected
    # Each process's devices hold exactly its own block of rows.
    assert by_pid[0][4:] == ["0", "7"] and by_pid[1][4:] == ["8", "15"]
    # map_row_blocks: each process scores its own 8 rows; both get all 16 results in order.
    blocks = {line.split()[1]: line.split()[2:] for out in outs for line in out.splitlines()
              if line.startswith("BLOCKS")}  # fmt: skip
    assert blocks == {"0": ["0", "7", "True"], "1": ["8", "15", "True"]}, logs


def test_map_row_blocks_is_fn_itself_in_one_process():
    tree = {"x": np.arange(6.0).reshape(3, 2), "k": np.float32(2)}
    out = distributed.map_row_blocks(lambda t: t["x"].sum(1) + t["k"], tree, 3)
    np.testing.assert_array_equal(out, [3.0, 7.0, 11.0])


def test_only_process_0_writes_metrics_and_logs_but_all_checkpoint(tmp_path, monkeypatch):
    from configs import micro
    from ebpo_jax.trainer import loop

    c = micro.get_config()
    c.unlock()
    c.workdir, c.total_steps, c.mesh.shape = str(tmp_path), 2, (-1,)
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    lines = []
    summary = loop.train(c, log=lines.append)
    assert summary["step"] == 2 and lines == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # no metrics, tb or config.json
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
