"""A grid's wall time through the Ray executor vs the local process pool, in the same run.

  python benchmarks/executor_bench.py [--repeats=2] [--grid=configs/ablations/micro.py]

Each repeat trains the grid from scratch twice, once per executor, in alternating order (so
a drift in the machine's load falls on both), with the same concurrency: the pool's
`--workers=2` and Ray's local cluster at half this machine's cores per run. Each is the whole
`experiments/ablate.py` process, as a user times it: Ray's wall includes starting and
stopping its local cluster, which is also reported alone. Prints medians, the ratio and the
overhead per run, (Ray - pool) / runs; the grid's results must agree, else the timing is void.
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two runs at once under both: Ray's local cluster holds all of this machine's cores.
EXECUTORS = {
    "local": ["--executor=local", "--workers=2"],
    "ray": ["--executor=ray", f"--ray_cpus={(os.cpu_count() or 2) / 2}"],
}


def _grid(name: str, grid: str, out_dir: str) -> float:
    """One ablate.py process over `grid` into `out_dir`: its wall seconds."""
    cmd = [sys.executable, "experiments/ablate.py", f"--config={grid}", f"--config.out_dir={out_dir}"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    run = subprocess.run(cmd + EXECUTORS[name], cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"{name}: ablate.py exited {run.returncode}:\n{run.stderr[-2000:]}")
    return time.perf_counter() - t0


def _pass_at_1(out_dir: str) -> list[tuple[str, str, str]]:
    """The grid's (run, step, pass@1) rows: what must not depend on the executor."""
    with open(os.path.join(out_dir, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    return sorted((r["run_id"], r["step"], r["pass@1"]) for r in rows)


def _ray_start_s() -> float:
    """Seconds to start and stop a local Ray cluster, alone."""
    import ray

    t0 = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ray.shutdown()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--grid", default="configs/ablations/micro.py")
    args = p.parse_args()
    walls = {name: [] for name in EXECUTORS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = list(EXECUTORS) if r % 2 == 0 else list(EXECUTORS)[::-1]
            for name in order:
                walls[name].append(_grid(name, args.grid, os.path.join(tmp, f"{name}{r}")))
                print(f"repeat {r} {name}: {walls[name][-1]:.1f} s", flush=True)
        rows = {name: _pass_at_1(os.path.join(tmp, f"{name}0")) for name in EXECUTORS}
        runs = len({run for run, _, _ in rows["local"]})
    if rows["local"] != rows["ray"]:
        sys.exit("the executors' results differ: the timing is void")
    local, ray = (statistics.median(walls[n]) for n in EXECUTORS)
    print(f"{runs} runs, results equal; medians over {args.repeats} repeats")
    print(f"  local pool (2 workers): {local:.1f} s")
    print(f"  Ray (2 runs at once): {ray:.1f} s  ratio x{ray / local:.2f}")
    print(f"  overhead per run: {(ray - local) / runs:+.1f} s")
    print(f"  Ray local cluster start + stop alone: {_ray_start_s():.1f} s")


if __name__ == "__main__":
    main()
