"""Rollout speed on long-tailed lengths: static vs continuous batching, decode vs cache size.

Run: .venv/bin/python benchmarks/rollout_bench.py [--runs 2] [--parts tail,cache,tiny,update]
Prints, in one process (ratios, since this CPU's speed drifts):
1. Useful tokens/s of `generate` with one static batch vs `sampler.slots` continuous
   batching, on response lengths drawn from a lognormal with mean max_new_tokens / 4 and
   5% at the limit, imposed as per-row stop positions (`row_limits`: the row ends there as
   if it drew a stop id). Random weights, temperature 1; both give the same rows.
2. Slot utilisation: slot-steps that decoded a live row / all slot-steps.
3. One decode step (forward_cached) at a fixed valid length for cache_size x1, x2, x4:
   the valid-prefix attention vs reading the whole cache (kv_block = cache_size).
4. The tiny default's shapes (configs/tiny.py: 32 prompts x 8 samples, 5 new tokens):
   continuous batching with a slot per row vs the static batch, short uniform lengths.
5. Update tokens/s padded vs packed (benchmarks/packed_bench.py, long-tail case).
Compile time is excluded (one warm-up call each).
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import models, sampler
from ebpo_jax.aot_report import Lengths

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

BENCH_MODEL = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


def long_tail_lengths(rows, limit, seed=0):
    """Lengths in [1, limit]: 5% at the limit, the rest lognormal below it, mean limit / 4."""
    return Lengths(response_mean=limit / 4, at_limit=0.05, seed=seed).draw(rows, limit)


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def prompts_for(config, prompts, width, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, config.vocab_size, (prompts, width), dtype=np.int32)
    lengths = rng.integers(width // 2, width + 1, prompts).astype(np.int32)
    return tokens, lengths


def static_vs_continuous(config, params, *, prompts, group, width, new_tokens, slots, runs):
    """Useful tokens/s of both samplers on long-tailed lengths, and the slots' utilisation."""
    tokens, lengths = prompts_for(config, prompts, width)
    limits = long_tail_lengths(prompts * group, new_tokens)
    kw = {"max_new_tokens": new_tokens, "rng": jax.random.key(0), "num_samples": group}
    kw["row_limits"] = limits
    run = lambda s: sampler._generate_with_stats(config, params, tokens, lengths, slots=s, **kw)
    static, _ = run(0)
    cont, stats = run(slots)
    same = bool(np.array_equal(static.tokens, cont.tokens))
    assert np.array_equal(np.asarray(cont.lengths), limits), "row limits not imposed"
    static_s, cont_s = [], []
    for _ in range(runs):  # alternating, so drift hits both alike
        static_s.append(timed(lambda: run(0))[0])
        cont_s.append(timed(lambda: run(slots))[0])
    useful = int(limits.sum())
    util = int(stats.busy) / (int(stats.steps) * slots)
    return {
        "rows": prompts * group,
        "mean_len": float(limits.mean()),
        "at_limit": float((limits == new_tokens).mean()),
        "static_tok_s": useful / statistics.median(static_s),
        "cont_tok_s": useful / statistics.median(cont_s),
        "ratio": statistics.median([s / c for s, c in zip(static_s, cont_s)]),
        "util": util,
        "steps": int(stats.steps),
        "same_rows": same,
    }


def decode_loop(config, params, *, batch, valid, cache_size, kv_block, steps=8):
    """(jitted loop of `steps` decode steps at per-row slot `valid`, its initial cache)."""
    tokens_B1 = jnp.ones((batch, 1), jnp.int32)
    start_B = jnp.full((batch,), valid, jnp.int32)
    layers = models.split_layers(config, params)

    def loop(cache):
        def body(_, carry):
            cache, acc = carry
            logits, cache = models.forward_cached(
                config, params, tokens_B1, start_B[:, None], cache,
                start=start_B, kv_len_B=start_B + 1, layers=layers, kv_block=kv_block,
            )  # fmt: skip
            return cache, acc + logits[:, 0, 0].sum()

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))

    jitted = jax.jit(loop, donate_argnums=0)
    cache, _ = jax.block_until_ready(jitted(models.init_cache(config, batch, cache_size)))
    return jitted, cache


def cache_size_scaling(config, params, *, batch=32, valid=256, sizes=(1024, 2048, 4096), rounds=5):
    """Per-step seconds at a fixed valid length: valid-prefix reads vs whole-cache reads."""
    steps = 8
    loops = {}
    for size in sizes:
        for kind, block in (("prefix", 256), ("whole", size)):
            loops[(kind, size)] = decode_loop(
                config, params, batch=batch, valid=valid, cache_size=size, kv_block=block
            )
    times = {key: [] for key in loops}
    for _ in range(rounds):  # every variant once per round, so drift hits all alike
        for key, (jitted, cache) in loops.items():
            start = time.perf_counter()
            cache, _ = jax.block_until_ready(jitted(cache))
            times[key].append((time.perf_counter() - start) / steps)
            loops[key] = (jitted, cache)
    return {key: statistics.median(t) for key, t in times.items()}


def tiny_default(runs):
    """configs/tiny.py's sampler shapes: continuous (a slot per row) vs static, seconds."""
    from configs import tiny

    c = tiny.get_config()
    config = models.get_config(c.model.preset, **dict(c.model.overrides))
    params = models.init_params(config, jax.random.key(0))
    rows = c.prompts_per_step * c.group_size
    tokens, lengths = prompts_for(config, c.prompts_per_step, 16)
    kw = {"max_new_tokens": c.sampler.max_new_tokens, "rng": jax.random.key(1)}
    kw |= {"num_samples": c.group_size, "temperature": c.sampler.temperature}
    run = lambda s: sampler.generate(config, params, tokens, lengths, slots=s, **kw)
    assert np.array_equal(run(0).tokens, run(rows).tokens)
    static_s, cont_s = [], []
    for _ in range(runs):
        static_s.append(timed(lambda: run(0))[0])
        cont_s.append(timed(lambda: run(rows))[0])
    return statistics.median(static_s), statistics.median(cont_s), rows


def update_line(runs: int = 2):
    """Update tokens/s padded vs packed on the same long-tailed lengths (packed_bench)."""
    import packed_bench  # benchmarks/ is on sys.path when this file runs

    r = packed_bench.long_tail_case(runs)
    return (
        f"update tokens/s padded vs packed: {r['padded']:.0f} vs {r['packed']:.0f} "
        f"({r['ratio']:.2f}x; target >= 2x)"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tiny-runs", type=int, default=15)
    ap.add_argument("--parts", default="tail,cache,tiny,update", help="which of the five lines")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    config = models.get_config("tiny", **BENCH_MODEL)
    params = models.init_params(config, jax.random.key(0))
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); model {BENCH_MODEL}")

    if "tail" in parts:
        print_long_tail(config, params, args)
    if "cache" in parts:
        print_cache_scaling(config, params)
    if "tiny" in parts:
        static_s, cont_s, rows = tiny_default(args.tiny_runs)
        print(
            f"tiny default shapes ({rows} rows, uniform short lengths): static "
            f"{1e3 * static_s:.1f} ms, continuous ({rows} slots) {1e3 * cont_s:.1f} ms: "
            f"{cont_s / static_s:.3f}x the time (target <= 1.05x)"
        )
    if "update" in parts:
        print(update_line())


def print_long_tail(config, params, args):
    """Lines 1-2: useful tokens/s static vs continuous, and slot utilisation."""
    r = static_vs_continuous(
        config, params, prompts=args.prompts, group=args.group, width=32,
        new_tokens=args.new_tokens, slots=args.slots, runs=args.runs,
    )  # fmt: skip
    print(
        f"long tail: {r['rows']} rows, mean length {r['mean_len']:.1f} of {args.new_tokens}, "
        f"{100 * r['at_limit']:.1f}% at the limit; same rows static vs continuous: {r['same_rows']}"
    )
    print(
        f"useful tokens/s static {r['static_tok_s']:.0f} vs continuous ({args.slots} slots) "
        f"{r['cont_tok_s']:.0f}: {r['ratio']:.2f}x (target >= 2.5x)"
    )
    print(f"slot utilisation {100 * r['util']:.1f}% over {r['steps']} steps (target >= 90%)")


def print_cache_scaling(config, params):
    """Line 3: one decode step vs cache_size at a fixed valid length."""
    t = cache_size_scaling(config, params)
    sizes = sorted({size for _, size in t})
    for kind in ("prefix", "whole"):
        cells = ", ".join(f"{s}: {1e3 * t[(kind, s)]:.2f} ms" for s in sizes)
        doubling = [t[(kind, b)] / t[(kind, a)] for a, b in itertools.pairwise(sizes)]
        print(
            f"decode step, valid length 256, batch 32, {kind}-cache attention: {cells}; "
            f"doubling cache_size: {', '.join(f'{d:.2f}x' for d in doubling)}"
            + (" (target <= 1.15x)" if kind == "prefix" else " (before this change)")
        )


if __name__ == "__main__":
    main()
