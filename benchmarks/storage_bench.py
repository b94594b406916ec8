"""Checkpoint save/restore on gs:// (the GCS emulator on loopback) vs local disk, and the train
step's wall time with an asynchronous save every step to gs:// vs to local disk vs none.

  python benchmarks/storage_bench.py [--repeats=3] [--steps=24]

States: the tiny and micro configs' params with two Adam moments (what a checkpoint holds).
Each save is synchronous and timed to its commit, restores verify the manifest, and an
asynchronous save is timed until it hands back to its caller (none other in flight). The
emulator and its precondition proxy come from tests/gcs_emulator.py (the emulator alone
lacks the generation header tensorstore reads) and run in a child process, so the trainer's
times hold only the client's side. A step's wall time is the time between two consecutive
metrics rows: compute, the save's blocking part and the metrics flush. Prints medians and
ratios from the same run; the emulator is a Python server on this host, so the ratios bound
per-request overhead, not a real bucket's bandwidth.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import micro, tiny  # noqa: E402
from ebpo_jax import models  # noqa: E402
from ebpo_jax.runtime import metrics  # noqa: E402
from ebpo_jax.runtime.checkpoint import Checkpointer  # noqa: E402

# The child serves until its stdin closes, then stops the emulator it started.
_SERVE = (
    "import json, sys, gcs_emulator; g = gcs_emulator.start(); print(json.dumps(g.env), flush=True)"
    "; sys.stdin.read(); g.stop()"
)


@contextlib.contextmanager
def _emulator():
    """The emulator and its proxy in a child process, this process's clients pointed at it."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"))
    cmd = [sys.executable, "-c", _SERVE]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    os.environ.update(json.loads(child.stdout.readline()))
    try:
        yield
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def _state(config_module):
    """Random params and two moments shaped like the config's model (float32)."""
    c = config_module.get_config()
    mc = models.get_config(c.model.preset, **dict(c.model.overrides))
    shapes = models.abstract_params(mc)
    rng = np.random.default_rng(0)
    one = lambda: jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    return {"params": one(), "mu": one(), "nu": one()}


def _save_restore(directory: str, state, repeats: int) -> tuple[float, float]:
    """Median seconds of a committed save and of a verified restore."""
    saves, restores = [], []
    with Checkpointer(directory, async_save=False, max_to_keep=2) as ckpt:
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(step, state, {"step": step})
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt.restore(step, state)
            restores.append(time.perf_counter() - t0)
    return statistics.median(saves), statistics.median(restores)


def _async_call(directory: str, state, repeats: int) -> float:
    """Median seconds an asynchronous save blocks its caller with no save in flight (the
    rest of the save overlaps what the caller does next)."""
    calls = []
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(step, state, {"step": step})
            calls.append(time.perf_counter() - t0)
            ckpt.wait()
    return statistics.median(calls)


def _step_times(workdir: str, steps: int, checkpoint_every: int) -> float:
    """Median wall time between consecutive metrics rows of a micro run (the first two,
    compiling, excluded)."""
    from ebpo_jax.trainer import loop

    c = micro.get_config()
    c.unlock()
    c.update_from_flattened_dict(
        {
            "workdir": workdir,
            "total_steps": steps,
            "checkpoint_every": checkpoint_every,
            "eval_every": steps,
            "mesh.devices": 1,
        }
    )
    stamps, write = [], metrics.MetricsWriter.write

    def stamped(self, step, row):
        stamps.append(time.perf_counter())
        return write(self, step, row)

    with mock.patch.object(metrics.MetricsWriter, "write", stamped):
        loop.train(c, log=lambda *_: None)
    return statistics.median(b - a for a, b in zip(stamps[2:], stamps[3:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with _emulator(), tempfile.TemporaryDirectory() as tmp:
        for name, module in (("tiny", tiny), ("micro", micro)):
            state = _state(module)
            mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
            local = _save_restore(os.path.join(tmp, name), state, args.repeats)
            remote = _save_restore(f"gs://runs/bench/{name}", state, args.repeats)
            print(
                f"{name} state ({mib:.2f} MiB): save local {local[0]:.2f} s, gs {remote[0]:.2f} s"
                f" (x{remote[0] / local[0]:.1f}); restore local {local[1]:.2f} s, gs "
                f"{remote[1]:.2f} s (x{remote[1] / local[1]:.1f})",
                flush=True,
            )
            state = jax.device_put(state)
            local = _async_call(os.path.join(tmp, f"{name}_async"), state, args.repeats)
            remote = _async_call(f"gs://runs/bench/{name}_async", state, args.repeats)
            print(
                f"{name} state: an async save blocks its caller local {local:.2f} s, gs "
                f"{remote:.2f} s (x{remote / local:.1f})",
                flush=True,
            )
        if not args.steps:  # --steps=0: the checkpoint timings only
            return
        none = _step_times(os.path.join(tmp, "steps_none"), args.steps, 10**6)
        local = _step_times(os.path.join(tmp, "steps_local"), args.steps, 1)
        gs = _step_times("gs://runs/bench/steps_async", args.steps, 1)
        print(
            f"micro step wall time: no saves {none * 1e3:.0f} ms; an async save every step to "
            f"local disk {local * 1e3:.0f} ms (x{local / none:.2f}), to gs:// "
            f"{gs * 1e3:.0f} ms (x{gs / none:.2f})"
        )


if __name__ == "__main__":
    main()
