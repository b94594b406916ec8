"""Checkpoint save/restore on gs:// (the GCS emulator on loopback) vs local disk, and the train
step time with asynchronous saves to gs:// vs none.

  python benchmarks/storage_bench.py [--repeats=3] [--steps=24]

States: the tiny and micro configs' params with two Adam moments (what a checkpoint holds).
Each save is synchronous and timed to its commit; restores verify the SHA-256 manifest. The
emulator and its precondition proxy come from tests/gcs_emulator.py (the emulator alone
lacks the generation header tensorstore reads). Prints medians and gs/local ratios from the
same run; the emulator is a Python server on this host, so the ratios bound per-request
overhead, not a real bucket's bandwidth.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gcs_emulator  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import micro, tiny  # noqa: E402
from ebpo_jax import models  # noqa: E402
from ebpo_jax.runtime.checkpoint import Checkpointer  # noqa: E402
from ebpo_jax.runtime.metrics import read_metrics  # noqa: E402


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


def _step_times(workdir: str, steps: int, checkpoint_every: int) -> float:
    """Median step time of a micro run (compile step excluded)."""
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
    loop.train(c, log=lambda *_: None)
    rows = [r for r in read_metrics(workdir) if "perf/step_time_s" in r]
    return statistics.median(r["perf/step_time_s"] for r in rows[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with gcs_emulator.running(), tempfile.TemporaryDirectory() as tmp:
        for name, module in (("tiny", tiny), ("micro", micro)):
            state = _state(module)
            mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
            local = _save_restore(os.path.join(tmp, name), state, args.repeats)
            remote = _save_restore(f"gs://runs/bench/{name}", state, args.repeats)
            print(
                f"{name} state ({mib:.2f} MiB): save local {local[0]:.2f} s, gs {remote[0]:.2f} s"
                f" (x{remote[0] / local[0]:.1f}); restore local {local[1]:.2f} s, gs "
                f"{remote[1]:.2f} s (x{remote[1] / local[1]:.1f})"
            )
        if not args.steps:  # --steps=0: the checkpoint timings only
            return
        none = _step_times(os.path.join(tmp, "steps_none"), args.steps, 10**6)
        gs = _step_times("gs://runs/bench/steps_async", args.steps, 4)
        print(
            f"micro step time: no saves {none * 1e3:.0f} ms, async saves to gs:// every 4 steps "
            f"{gs * 1e3:.0f} ms (x{gs / none:.2f})"
        )


if __name__ == "__main__":
    main()
