"""The full-sequence forward's tokens/s with model.batch_invariant on vs off, in one run.

Run: .venv/bin/python benchmarks/batch_invariant_bench.py [--preset tiny] [--rows 32] [--len 64]
"""

import argparse

import jax
import numpy as np
from advantage_bench import _median_us  # run as a script: benchmarks/ is on the path

from ebpo_jax import models


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    base = models.get_config(args.preset, dtype=args.dtype)
    tokens = rng.integers(0, base.vocab_size, (args.rows, args.len)).astype(np.int32)
    params = models.init_params(base, jax.random.key(0))
    seconds = {}
    for on in (False, True):
        config = base.replace(batch_invariant=on)
        forward = jax.jit(lambda p, t, c=config: models.forward(c, p, t))
        seconds[on] = _median_us(forward, params, tokens, repeats=args.repeats) / 1e6
    n = args.rows * args.len
    print(f"{args.preset} {args.dtype}, {args.rows} rows x {args.len} tokens, forward:")
    for on, s in seconds.items():
        print(f"  batch_invariant={on!s:5}  {n / s:10.0f} tokens/s")
    print(f"  on / off time: {seconds[True] / seconds[False]:.2f}x")


if __name__ == "__main__":
    main()
