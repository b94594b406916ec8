"""Run state on gs:// (an in-memory GCS emulator on loopback, behind tests/gcs_emulator.py's
proxy): paths, the lock, metrics segments, checkpoints with manifests, model.hf_path, and a
training run that resumes exactly after a raised total_steps and after a kill -9."""

import json
import os
import signal
import subprocess
import sys
import time

import gcs_emulator
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import micro_config

from ebpo_jax.runtime import metrics, storage
from ebpo_jax.runtime.checkpoint import MANIFEST, Checkpointer, list_steps, verify_manifest
from ebpo_jax.runtime.object_lock import LockHeld, ObjectLock
from ebpo_jax.runtime.workdir import WorkdirError, lock_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gcs():
    """The emulator and proxy, with this process's clients pointed at them."""
    with gcs_emulator.running() as server:
        yield server


def test_gs_paths_stay_remote_and_files_round_trip(gcs, monkeypatch):
    assert storage.absolute("gs://runs/a/") == "gs://runs/a"
    assert storage.absolute("runs/a") == os.path.join(os.getcwd(), "runs/a")
    storage.write_text("gs://runs/p/x/a.txt", "one")
    storage.write_bytes("gs://runs/p/b.bin", b"\x00\x01")
    assert storage.read_text("gs://runs/p/x/a.txt") == "one"
    assert storage.listdir("gs://runs/p") == ["b.bin", "x"]
    assert storage.isdir("gs://runs/p/x") and storage.isfile("gs://runs/p/b.bin")
    storage.move("gs://runs/p/x", "gs://runs/p/y")
    assert sorted(storage.walk_files("gs://runs/p")) == ["b.bin", "y/a.txt"]
    assert storage.listdir("gs://runs/nothing") == []
    # The store's CRC32C, in the form a listing gives it (base64 of the big-endian sum).
    sums = {"b.bin": "Awr00Q==", "y/a.txt": "KpSy6Q=="}
    assert storage.stored_crc32c("gs://runs/p") == sums
    fs, find = storage.filesystem("gs://runs/p"), storage.filesystem("gs://runs/p").find
    bare = lambda *a, **k: {n: {**i, "crc32c": None} for n, i in find(*a, **k).items()}
    monkeypatch.setattr(fs, "find", bare)  # a store whose listing has no sums: read and summed
    assert storage.stored_crc32c("gs://runs/p") == sums


def test_lock_refuses_a_live_owner_and_takes_over_a_stale_one(gcs):
    path = "gs://runs/l/.lock"
    held = ObjectLock(path, heartbeat_s=0.2).acquire()
    with pytest.raises(LockHeld, match=r"gs://runs/l/.lock is held by pid \d+ on "):
        ObjectLock(path).acquire()
    gen = held._generation
    time.sleep(0.6)
    assert held._generation != gen and not held.lost  # the heartbeat renews it
    held._stop.set()  # the owner hangs: no more heartbeats, the lock stays
    held._thread.join()
    with pytest.raises(LockHeld):
        ObjectLock(path, lease_s=5).acquire()
    time.sleep(1.2)
    taker = ObjectLock(path, lease_s=1.0, heartbeat_s=0.2).acquire()  # the lease ran out
    time.sleep(0.5)
    held._stop.clear()
    assert not taker.lost
    with pytest.raises(Exception, match="412|conditionNotMet|Precondition"):
        held._write(if_generation_match=held._generation)  # the old owner cannot write it
    taker.release()
    assert not storage.exists(path)


def test_lock_of_a_dead_process_on_this_machine_is_taken_at_once(gcs):
    path = "gs://runs/dead/.lock"
    ghost = ObjectLock(path)
    ghost.owner = {**ghost.owner, "pid": 2**22 + 1}  # above pid_max's default: not running
    ghost._write(if_generation_match=0)
    lock = ObjectLock(path).acquire()  # the lease (120 s) has not run out
    lock.release()


def test_workdir_lock_on_gs_is_one_error_line(gcs):
    with lock_for("gs://runs/w"):
        with pytest.raises(WorkdirError, match=r"^workdir lock gs://runs/w/.lock is held by"):
            lock_for("gs://runs/w").acquire()
    lock_for("gs://runs/w").acquire().release()  # released on exit


def test_metrics_segments_keep_checkpointed_rows_and_name_a_gap(gcs):
    wd = "gs://runs/m"
    w = metrics.MetricsWriter(wd, remote=True, tensorboard=False)
    for step in range(6):
        w.write(step, {"reward/mean": step / 10})
        if step in (2, 4):
            w.flush()  # what the loop does before each checkpoint
    # kill -9: no close(); step 5's row was never written (the resume recomputes it).
    assert [r["step"] for r in metrics.read_metrics(wd)] == [0, 1, 2, 3, 4]
    assert metrics.has_metrics(wd)
    resumed = metrics.MetricsWriter(
        wd, remote=True, start_step=3, tensorboard=False
    )  # checkpoint 2
    assert [r["step"] for r in metrics.read_metrics(wd)] == [0, 1, 2]  # later rows dropped
    assert resumed.kept == metrics.read_metrics(wd)
    resumed.write(3, {"reward/mean": 0.3})
    resumed.close()
    assert [r["step"] for r in metrics.read_metrics(wd)] == [0, 1, 2, 3]
    # A lost segment (steps 1-2) is named on the next resume and stays on record.
    first = sorted(storage.listdir(wd + "/metrics"))[0]
    storage.write_text(f"{wd}/metrics/{first}", json.dumps({"step": 0}) + "\n")
    lines = []
    again = metrics.MetricsWriter(
        wd, remote=True, start_step=4, tensorboard=False, log=lines.append
    )
    assert again.record_gap(3) == [[1, 2]] and "no rows for steps 1-2" in lines[0]
    again.close()
    assert metrics.missing_steps(metrics.read_metrics(wd), 3) == []


def test_checkpoints_on_gs_commit_with_a_manifest_and_skip_a_corrupt_step(gcs):
    directory = "gs://runs/c/checkpoints"
    tree = {"w": np.arange(64, dtype=np.float32), "b": np.ones(3, np.int32)}
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(1, tree, {"pos": 1})
        ckpt.save(2, jax.tree.map(lambda x: x + 1, tree), {"pos": 2})
    assert list_steps(directory) == [1, 2]
    seen = len(gcs.proxy.log)
    assert verify_manifest(f"{directory}/2") is None
    reads = [ln for ln in gcs.proxy.log[seen:] if "alt=media" in ln]
    assert reads == [
        f"GET /download/storage/v1/b/runs/o/c%2Fcheckpoints%2F2%2F{MANIFEST}?alt=media "
    ]
    step1 = f"{directory}/1"  # an earlier version's manifest on gs:// (SHA-256s) still checks
    names = json.loads(storage.read_text(f"{step1}/{MANIFEST}"))["crc32c"]
    sha = {n: storage.sha256(f"{step1}/{n}") for n in names}
    storage.write_text(f"{step1}/{MANIFEST}", json.dumps({"sha256": sha}))
    storage.write_text(f"{directory}/3/state/partial", "x")  # a save killed before its commit
    assert list_steps(directory) == [1, 2]
    storage.rmtree(f"{directory}/3")
    files = [f for f in storage.walk_files(f"{directory}/2/state") if "/d/" in f]
    victim = f"{directory}/2/state/" + max(
        files, key=lambda f: len(storage.read_bytes(f"{directory}/2/state/{f}"))
    )
    data = bytearray(storage.read_bytes(victim))
    data[len(data) // 2] ^= 1
    storage.write_bytes(victim, bytes(data))
    lines = []
    with Checkpointer(directory) as ckpt:
        step, restored, extra = ckpt.restore_intact(tree, log=lines.append)
    assert (step, extra) == (1, {"pos": 1})
    np.testing.assert_array_equal(restored["w"], tree["w"])
    assert "step 2" in lines[0] and "CRC32C" in lines[0] and ".corrupt/2-" in lines[0]
    assert list_steps(directory) == [1]


def test_hf_path_on_gs_gives_the_same_logits_and_tokenizer(gcs, tmp_path):
    import transformers
    from helpers import save_tiny_tokenizer

    from ebpo_jax import models

    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    local = str(tmp_path / "qwen3")
    transformers.Qwen3ForCausalLM(config).save_pretrained(local, max_shard_size="20KB")
    save_tiny_tokenizer(local)
    assert os.path.exists(os.path.join(local, "model.safetensors.index.json"))  # sharded
    remote = "gs://runs/hf/qwen3"
    for rel in storage.walk_files(local):
        storage.write_bytes(f"{remote}/{rel}", storage.read_bytes(os.path.join(local, rel)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))
    outs = []
    for path in (local, remote):
        mc, params = models.from_hf(path, dtype="float32")
        outs.append(np.asarray(jax.jit(models.forward, static_argnums=0)(mc, params, tokens)))
    np.testing.assert_array_equal(outs[0], outs[1])
    tok_local, tok_remote = (models.hf.load_tokenizer(p) for p in (local, remote))
    assert (
        tok_local("what is one plus two").input_ids == tok_remote("what is one plus two").input_ids
    )
    # convert_hf.py with both ends on gs://: HF folder -> .npz -> HF folder.
    from conftest import load_experiment

    convert_hf = load_experiment("convert_hf")
    convert_hf.on_storage(convert_hf.convert, remote, "gs://runs/hf/q.npz")
    convert_hf.on_storage(convert_hf.convert, "gs://runs/hf/q.npz", "gs://runs/hf/back")
    mc, params = models.from_hf("gs://runs/hf/back", dtype="float32")
    again = np.asarray(jax.jit(models.forward, static_argnums=0)(mc, params, tokens))
    np.testing.assert_array_equal(again, outs[0])


def test_data_files_on_gs_load_as_local_ones(gcs, tmp_path):
    from data_test import ROWS

    from ebpo_jax import data

    text = "".join(json.dumps(r) + "\n" for r in ROWS["gsm8k"][0] * 3)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text(text)
    storage.write_text("gs://runs/d/train.jsonl", text)
    local, remote = (data.load_records(p, "gsm8k") for p in (str(tmp_path / "d"), "gs://runs/d"))
    assert [(r.prompt, r.answer) for r in remote] == [(r.prompt, r.answer) for r in local]
    assert remote[0].id.startswith("gs://runs/d/train.jsonl")


_micro = micro_config


def _rows(workdir):
    keep = lambda k: not k.startswith(("perf/", "phase/")) or "tokens_total" in k
    return [{k: v for k, v in r.items() if keep(k)} for r in metrics.read_metrics(workdir)]


def _wait_for(path, proc, timeout=300):
    t0 = time.time()
    while not storage.exists(path):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.2)


def _train_subprocess(cwd, workdir):
    """experiments/train.py on the micro config for 400 steps, as a user starts it."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py")]
    cmd += ["--config=" + os.path.join(ROOT, "configs", "micro.py"), "--config.mesh.devices=1"]
    cmd += [f"--config.workdir={workdir}", "--config.total_steps=400"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow  # 1164 s on the 2-core machine at load ~20 (280 s at a lighter load)
def test_train_on_gs_resumes_exactly_after_more_steps_and_a_kill_9(gcs, tmp_path):
    from ebpo_jax.runtime.checkpoint import load_params
    from ebpo_jax.trainer import loop

    quiet = lambda *_: None
    loop.train(_micro(tmp_path / "local", total_steps=6), log=quiet)  # the reference
    loop.train(_micro("gs://runs/t/more", total_steps=4), log=quiet)
    more = loop.train(_micro("gs://runs/t/more", total_steps=6), log=quiet)
    assert more["resumed_from"] == 4 and more["step"] == 6
    # kill -9 once step 2 is committed, from a working directory that must stay empty.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    killed_proc = _train_subprocess(cwd, "gs://runs/t/killed")
    try:
        _wait_for("gs://runs/t/killed/checkpoints/2/commit_success.txt", killed_proc)
    finally:
        killed_proc.send_signal(signal.SIGKILL)
        killed_proc.communicate()
    # SIGTERM (a preemption notice): the step in progress is saved and committed, exit 0.
    termed = _train_subprocess(cwd, "gs://runs/t/termed")
    _wait_for("gs://runs/t/termed/checkpoints/2/commit_success.txt", termed)
    termed.send_signal(signal.SIGTERM)
    out = termed.communicate(timeout=300)[0]
    assert termed.returncode == 0, out[-3000:]
    saved = int(out.split("saved step ")[1].split()[0])
    assert storage.exists(f"gs://runs/t/termed/checkpoints/{saved}/commit_success.txt")
    assert os.listdir(cwd) == []
    killed = loop.train(_micro("gs://runs/t/killed", total_steps=6), log=quiet)
    assert killed["resumed_from"] >= 2 and killed["step"] == 6
    ref = _rows(tmp_path / "local")
    assert [r["step"] for r in ref] == list(range(7))
    assert _rows("gs://runs/t/more") == ref
    assert _rows("gs://runs/t/killed") == ref
    a = load_params(str(tmp_path / "local"))
    for run in ("more", "killed"):
        jax.tree.map(np.testing.assert_array_equal, a, load_params(f"gs://runs/t/{run}"))
    names = storage.listdir("gs://runs/t/killed")
    assert {"checkpoints", "config.json", "metrics", "tb"} <= set(names), names
    # Reading the run from elsewhere: the plot and a checkpoint's evaluation, both on gs://.
    from conftest import load_experiment

    from ebpo_jax.trainer import run_eval

    assert load_experiment("plot_run").main(["gs://runs/t/more"]) == 0
    assert storage.read_bytes("gs://runs/t/more/curves.png")[:4] == b"\x89PNG"
    results, out = run_eval.evaluate_run("gs://runs/t/more", k=2)
    assert out == "gs://runs/t/more/eval_step6.json" and storage.exists(out)
    assert json.loads(storage.read_text(out))["results"].keys() == results.keys()


@pytest.fixture
def fast_retries(monkeypatch):
    """gcsfs's retries without their backoff sleeps (its 6 tries take ~30 s otherwise)."""
    import types

    import gcsfs.retry

    async def no_wait(_seconds):
        return None

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_wait))


def test_transient_storage_faults_are_retried_and_the_save_is_exact(gcs, fast_retries):
    directory = "gs://runs/f1/checkpoints"
    tree = {"w": np.arange(1000, dtype=np.float32)}
    gcs.proxy.faults[:] = [
        gcs_emulator.Fault(r"^POST /upload", "503", times=3),  # arrays, metadata, manifest
        gcs_emulator.Fault(r"^POST /upload.*commit_success", "drop", times=1),
        gcs_emulator.Fault(r"^GET ", "503", times=2),
    ]
    try:
        with Checkpointer(directory) as ckpt:
            ckpt.save(1, tree, {"pos": 1})
            ckpt.wait()
            step, restored, _ = ckpt.restore_intact(tree)
    finally:
        hits = [f.hits for f in gcs.proxy.faults]
        gcs.proxy.faults.clear()
    assert hits == [3, 1, 2]
    assert step == 1
    np.testing.assert_array_equal(restored["w"], tree["w"])


def test_a_persistent_fault_fails_the_save_by_name_and_keeps_the_previous_step(gcs, fast_retries):
    from ebpo_jax.runtime.checkpoint import CheckpointError

    directory = "gs://runs/f2/checkpoints"
    tree = {"w": np.arange(10, dtype=np.float32)}
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(1, tree)
        gcs.proxy.faults[:] = [gcs_emulator.Fault(r"^POST /upload.*2/commit_success", times=-1)]
        try:
            with pytest.raises(CheckpointError, match=f"step 2 to {directory} failed"):
                ckpt.save(2, jax.tree.map(lambda x: x + 1, tree))
        finally:
            gcs.proxy.faults.clear()
    assert list_steps(directory) == [1]  # the half-written step 2 is not a checkpoint
    with Checkpointer(directory, async_save=False) as ckpt:
        assert ckpt.latest_step() == 1
        ckpt.save(2, jax.tree.map(lambda x: x + 1, tree))  # the next try writes it whole
        step, restored, _ = ckpt.restore_intact(tree)
    assert step == 2
    np.testing.assert_array_equal(restored["w"], tree["w"] + 1)


@pytest.mark.slow
def test_storage_bench_smoke():
    """benchmarks/storage_bench.py runs (one save and restore per state, no training)."""
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "storage_bench.py"),
            "--repeats=1",
            "--steps=0",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "micro state" in run.stdout and "tiny state" in run.stdout
