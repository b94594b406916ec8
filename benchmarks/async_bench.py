"""Steps/s at rollout.max_staleness=1 vs 0, one process, 8 fake CPU devices split 4 + 4.

  python benchmarks/async_bench.py [--steps=10] [--trace=/tmp/async_trace]

Both runs train the same config (configs/tiny.py's model, no warm start) with the trainer on
devices 0-3; the sampler shares them at staleness 0 and has devices 4-7 at staleness 1.
Prints per-step timelines (rollout and update: seconds from dispatch to ready, and how long
both were in flight at once) and the ratio of median step times, compile steps excluded.
`--trace` also writes a jax.profiler trace of the staleness-1 run (view in Perfetto).
"""

import argparse
import os
import statistics
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ebpo_jax.runtime.cpu_flags import add_cpu_flags

add_cpu_flags()

import jax

from configs import tiny
from ebpo_jax.runtime.metrics import read_metrics
from ebpo_jax.trainer import loop


def config(workdir: str, staleness: int, steps: int):
    c = tiny.get_config()
    c.unlock()
    c.update_from_flattened_dict(
        {
            "workdir": workdir,
            "total_steps": steps,
            "eval_every": steps,
            "checkpoint_every": steps,
            "sft.steps": 0,
            "task.test_per_cell": 4,
            "mesh.devices": 4,
            "mesh.shape": (4,),
            "sampler.mesh": "data=4",
            "rollout.max_staleness": staleness,
            "loss.recompute_old_logprobs": True,
            "loss.is_correction": "tis",
        }
    )
    return c


def timeline(rows) -> None:
    print("  step  step_s  rollout_s  update_s  overlap_s")
    for r in rows:
        cells = [r.get(k) for k in ("perf/step_time_s", "perf/sample_time_s")]
        cells += [r.get("perf/update_time_s"), r.get("perf/overlap_s", 0.0)]
        print(f"  {r['step']:4d}  " + "  ".join(f"{x:8.3f}" for x in cells))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trace", default="")
    args = p.parse_args()
    assert jax.device_count() == 8, jax.devices()
    median = {}
    for staleness in (0, 1):
        workdir = tempfile.mkdtemp(prefix=f"async_bench_s{staleness}_")
        c = config(workdir, staleness, args.steps)
        if staleness == 1 and args.trace:
            with jax.profiler.trace(args.trace):
                loop.train(c, log=lambda *_: None)
        else:
            loop.train(c, log=lambda *_: None)
        rows = [r for r in read_metrics(workdir) if "perf/step_time_s" in r]
        print(f"staleness {staleness}: per-step timeline (seconds)")
        timeline(rows)
        # Steps 1-2 compile (at staleness 1 step 1 also runs rollout 0 alone).
        median[staleness] = statistics.median(r["perf/step_time_s"] for r in rows[2:])
        print(f"staleness {staleness}: median step {median[staleness]:.3f} s over steps 3+")
    print(
        f"steps/s at staleness 1 / staleness 0: {median[0] / median[1]:.2f}x "
        f"({1 / median[1]:.2f} vs {1 / median[0]:.2f} steps/s)"
    )


if __name__ == "__main__":
    main()
