"""Jitted eb_advantage vs grpo_advantage: median wall time and ratio per (P, G).

Run: .venv/bin/python benchmarks/advantage_bench.py [--repeats 200] [--P 64,512,4096] [--G 4,8,16]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import ebpo_jax


def _median_us(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile outside the timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--P", type=_ints, default=[64, 512, 4096], help="prompts per step")
    parser.add_argument("--G", type=_ints, default=[4, 8, 16], help="group sizes")
    args = parser.parse_args(argv)
    eb = jax.jit(lambda r, s, m: ebpo_jax.eb_advantage(r, s, mask=m))
    grpo = jax.jit(lambda r, m: ebpo_jax.grpo_advantage(r, mask=m))
    state = ebpo_jax.init_eb_state()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, median of {args.repeats} calls")
    print(f"{'P':>5} {'G':>3} {'grpo us':>9} {'ebpo us':>9} {'ebpo/grpo':>10}")
    for P in args.P:
        for G in args.G:
            r = jnp.asarray(rng.random((P, G)) < 0.3, jnp.float32)
            m = jnp.ones((P, G), bool)
            t_grpo = _median_us(grpo, r, m, repeats=args.repeats)
            t_eb = _median_us(eb, r, state, m, repeats=args.repeats)
            print(f"{P:>5} {G:>3} {t_grpo:>9.1f} {t_eb:>9.1f} {t_eb / t_grpo:>10.2f}")


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    main()
