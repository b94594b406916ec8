"""Rollout speed: the paged engine vs the previous slot engine, and decode cost vs the longest row.

Run: .venv/bin/python benchmarks/rollout_bench.py [--pairs 5] [--parts tail,longest,tiny,update,turns,rows]
Each part prints ratios measured in this one process, as the median and range over
`--pairs` alternating pairs (drift and load hit both sides alike), and the CPU model.
The previous engine (static batch + `slots` continuous batching, one max-length KV cache per
slot) is checked out of git (`--old-ref`, default the commit before the paged engine) into a
temp module: it is no part of the package.
1. tail: useful tokens/s on long-tailed response lengths (lognormal, mean N / 4 for
   `--new-tokens` N, 1024 by default: long enough that attention to the longest live row
   costs the old engine what it costs at pod scale; 5% at the limit, imposed as per-row stop
   positions `row_limits`) at an equal KV memory
   budget: the old engine's `--slots` x (prompt width + max_new_tokens) tokens, the paged
   engine's as kv_pages of page_size 16 with `--paged-slots`. Also the mean concurrent rows.
2. longest: one decode step (all layers) at a fixed number of live tokens when the longest
   live row doubles (the rest get shorter), paged attention vs the old valid-prefix one.
3. tiny: configs/tiny.py's sampler shapes (32 prompts x 8 samples, 5 new tokens): paged
   generate vs the old static generate, seconds per call.
4. update: update tokens/s padded vs packed (benchmarks/packed_bench.py, long-tail case).
5. turns: multi-turn episodes (`--turns` turns of `--turn-tokens` drawn tokens, each but the
   last followed by `--obs-tokens` observation tokens), rows keeping their KV pages
   (sampler.Session with turns) vs every turn prefilling the episode so far (generate): tokens
   the model runs per episode token (prompt + episode) for each, and seconds per batch.
6. rows: a decode step's cost per live row at 1-256 rows, and the static-vs-continuous
   ratio that curve predicts (not in the default parts).
7. kv: bfloat16 vs int8 KV pages (sampler.kv_dtype) on part tail's long-tailed rows
   (`--kv-new-tokens` limit): the pages one memory budget holds (`--slots` x the pages of
   prompt + mean response in bfloat16), and useful decode tokens/s with the same slots and
   pages, and with each pool filling the budget (int8: its pages and proportionally more
   slots). The model in bfloat16.
8. weights: decode tokens/s with the sampler's weights in float32, bfloat16 and int8
   (sampler.param_dtype; a wider model, `WEIGHTS_MODEL`, so the weights outweigh the KV
   reads), int8 vs each (not in the default parts).
Compile time is excluded (one warm-up call each).
"""

import argparse
import functools
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import models, sampler
from ebpo_jax.pods.aot_report import Lengths
from ebpo_jax.sampler import attention, pages

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
OLD_REF = "1504a37"  # main before the paged engine: sampler.py, slots.py, generation.py
OLD_MODULES = ("generation", "sampling", "slots", "sampler")


# The old engine called forward_cached with the cache slots as keywords; it now takes them
# as one CacheSlots spec. The old modules import this adapter in place of `models`.
OLD_MODELS_ADAPTER = """
from ebpo_jax.models import *  # noqa: F403
from ebpo_jax import models as _models
from ebpo_jax.models import decode


def forward_cached(config, params, tokens_BT, positions_BT, cache, *, start, kv_mask_BS=None,
                   kv_len_B=None, layers=None, kv_block=_models.decode.BLOCK):
    slots = _models.CacheSlots(start, positions_BT, kv_mask_BS, kv_len_B)
    return _models.forward_cached(config, params, tokens_BT, cache, slots, layers=layers,
                                  kv_block=kv_block)
"""


def old_engine(ref: str):
    """The previous sampler (git `ref`) as temp modules old_sampler, old_slots, ...; returns
    old_sampler."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="old_sampler_")
    with open(os.path.join(tmp, "old_models.py"), "w") as f:
        f.write(OLD_MODELS_ADAPTER)
    for name in OLD_MODULES:
        src = subprocess.check_output(
            ["git", "show", f"{ref}:ebpo_jax/{name}.py"], cwd=root, text=True
        )
        src = src.replace(
            "from ebpo_jax import slots as slots_lib", "import old_slots as slots_lib"
        )
        src = re.sub(
            r"from ebpo_jax\.(generation|sampling|slots) import", r"from old_\1 import", src
        )
        src = src.replace(
            "from ebpo_jax import models, sharding",
            "from ebpo_jax import sharding\nimport old_models as models",
        )
        src = src.replace("from ebpo_jax import models\n", "import old_models as models\n")
        with open(os.path.join(tmp, f"old_{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, tmp)
    return importlib.import_module("old_sampler")


def cpu_model() -> str:
    try:
        out = subprocess.check_output(["lscpu"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    found = re.search(r"Model name:\s*(.+)", out)
    cores = re.search(r"^CPU\(s\):\s*(\d+)", out, re.MULTILINE)
    return (
        f"{found.group(1).strip() if found else 'unknown'}, {cores.group(1) if cores else '?'} CPUs"
    )


def long_tail_lengths(rows, limit, seed=0):
    """Lengths in [1, limit]: 5% at the limit, the rest lognormal below it, mean limit / 4."""
    return Lengths(response_mean=limit / 4, at_limit=0.05, seed=seed).draw(rows, limit)


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def pairs(a, b, n, warm_up=True):
    """Seconds of n (a, b) pairs after one warm-up each (warm_up=False: the caller has run
    both), run a-b, b-a, a-b, ... so that an order effect cancels: (a_s, b_s, b/a ratios)."""
    if warm_up:  # blocked: dispatch is asynchronous, so it would run inside the first timing
        jax.block_until_ready((a(), b()))
    a_s, b_s = [], []
    for i in range(n):
        for fn, out in ((a, a_s), (b, b_s))[:: 1 if i % 2 == 0 else -1]:
            out.append(timed(fn)[0])
    return a_s, b_s, [y / x for x, y in zip(a_s, b_s)]


def spread(ratios):
    return f"median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"


def _seconds(times):
    return " ".join(f"{t:.1f}" for t in times)


def prompts_for(config, prompts, width, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, config.vocab_size, (prompts, width), dtype=np.int32)
    lengths = rng.integers(width // 2, width + 1, prompts).astype(np.int32)
    return tokens, lengths


def tail(config, params, old, args):
    """Useful tokens/s and mean concurrent rows, paged vs old slots, at one KV budget."""
    width, N, G = 32, args.new_tokens, args.group
    tokens, lengths = prompts_for(config, args.tail_prompts, width)
    limits = long_tail_lengths(args.tail_prompts * G, N)
    key = jax.random.key(0)
    old_kw = {"max_new_tokens": N, "rng": key, "num_samples": G, "row_limits": limits}
    budget = args.slots * (width + N)  # tokens of KV the old engine reserves
    spec = sampler.SamplerSpec(
        N, num_samples=G, slots=args.paged_slots, page_size=16, kv_pages=budget // 16,
        live_buckets=args.live_buckets,
    )  # fmt: skip
    run_old = lambda: old._generate_with_stats(
        config, params, tokens, lengths, slots=args.slots, **old_kw
    )
    run_new = lambda: sampler.generate(
        config, params, tokens, lengths, spec, rng=key, row_limits=limits
    )
    (g_old, s_old), g_new = run_old(), run_new()
    s_new = g_new.stats
    assert np.array_equal(np.asarray(g_new.lengths), limits), "row limits not imposed"
    same = bool(np.array_equal(g_old.tokens, g_new.tokens))  # both ran: the warm-up
    a_s, b_s, ratios = pairs(run_old, run_new, args.pairs, warm_up=False)
    useful = int(limits.sum())
    print(
        f"long tail: {len(limits)} rows, mean length {limits.mean():.1f} of {N}, "
        f"{100 * (limits == N).mean():.1f}% at the limit; KV budget {budget} tokens; "
        f"same rows old vs paged: {same}"
    )
    print(
        f"useful tokens/s old slots ({args.slots} slots) {useful / statistics.median(a_s):.0f} "
        f"vs paged ({spec.slots} slots in {spec.live_buckets} live buckets, {spec.kv_pages} "
        "pages of 16) "
        f"{useful / statistics.median(b_s):.0f}: speed-up {spread([1 / r for r in ratios])} "
        f"over {args.pairs} pairs (target >= 1.5x)"
    )
    print(f"seconds per call, old: {_seconds(a_s)}; paged: {_seconds(b_s)}")
    conc_old = int(s_old.busy) / int(s_old.steps)
    conc_new = int(s_new.busy) / int(s_new.steps)
    print(
        f"mean concurrent rows: old {conc_old:.1f}, paged {conc_new:.1f} (computed "
        f"{int(s_new.computed) / int(s_new.steps):.1f}); decode steps "
        f"{int(s_old.steps)} vs {int(s_new.steps)}; paged preemptions {int(s_new.preempted)}, "
        f"peak pages {int(s_new.peak_pages)} of {s_new.pages}"
    )


def kv_int8(config, params, args):
    """Pages per budget and useful tokens/s, bfloat16 vs int8 KV pages, in one process."""
    config = config.replace(dtype="bfloat16")
    width, N, G, ps = 32, args.kv_new_tokens, args.group, 16
    tokens, lengths = prompts_for(config, args.tail_prompts, width)
    limits = long_tail_lengths(args.tail_prompts * G, N)
    slots = args.slots
    # The docs' sizing: slots x (prompt + mean response), so the pool, not the slots, binds.
    bf16_pages = slots * int(pages.pages_for(width + N // 4, ps))
    budget = bf16_pages * pages.page_bytes(config, ps)
    int8_pages = pages.pages_in(budget, config, ps, "int8")
    int8_pages -= int8_pages % 2  # whole pages per slot pair below
    int8_slots = slots * int8_pages // bf16_pages
    print(
        f"kv pages: a budget of {budget / 2**20:.1f} MiB holds {bf16_pages} bfloat16 pages, "
        f"{int8_pages} int8 pages (with scales): {int8_pages / bf16_pages:.2f}x"
    )
    key = jax.random.key(0)

    def run(kv_dtype, slots, kv_pages):
        spec = sampler.SamplerSpec(
            N, num_samples=G, slots=slots, page_size=ps, kv_pages=kv_pages, kv_dtype=kv_dtype
        )
        return lambda: sampler.generate(
            config, params, tokens, lengths, spec, rng=key, row_limits=limits
        )

    useful = int(limits.sum())
    base = run("", slots, bf16_pages)
    for name, other in (
        (f"same {slots} slots and {bf16_pages} pages", run("int8", slots, bf16_pages)),
        (f"equal budget: {int8_slots} slots, {int8_pages} pages", run("int8", int8_slots, int8_pages)),
    ):  # fmt: skip
        a_s, b_s, ratios = pairs(base, other, args.pairs)
        stats = other().stats
        print(
            f"useful decode tokens/s bfloat16 KV ({slots} slots, {bf16_pages} pages) "
            f"{useful / statistics.median(a_s):.0f} vs int8 KV, {name}: "
            f"{useful / statistics.median(b_s):.0f}: int8/bf16 {spread([1 / r for r in ratios])} "
            f"over {args.pairs} pairs; int8 preemptions {int(stats.preempted)}, "
            f"peak pages {int(stats.peak_pages)}"
        )


def _paged_step(config, params, lens_R, page_size, steps=4):
    """(jitted `steps` decode steps over a paged cache at per-row lengths lens_R, pools)."""
    R = len(lens_R)
    M = int(pages.pages_for(max(lens_R) + steps + 1, page_size))
    pools = pages.init_pools(config, 1, R * M, page_size)
    table_RM = jnp.arange(R * M, dtype=jnp.int32).reshape(R, M)
    lens0_R = jnp.asarray(lens_R, jnp.int32)
    layers = models.split_layers(config, params)
    tok_R = jnp.ones((R,), jnp.int32)

    def loop(pools):
        def body(i, carry):
            pools, acc = carry
            kv_R = lens0_R + i
            new = []

            def attend(layer, attn, q, k, v):
                kv = pages.interleave(k[:, 0], v[:, 0])
                pool = pages.write_token(
                    pools[layer][0],
                    kv,
                    table_RM[jnp.arange(R), kv_R // page_size],
                    kv_R % page_size,
                )
                new.append(pool[None])
                out = attention.paged_decode_attention(q[:, 0], pool, table_RM, kv_R + 1)
                return attn.output(out[:, None])

            logits = models.decode_step(config, params, tok_R, kv_R, attend, layers=layers)
            return tuple(new), acc + logits[:, 0].sum()

        return jax.lax.fori_loop(0, steps, body, (pools, jnp.float32(0)))

    jitted = jax.jit(loop, donate_argnums=0)
    return jitted, pools


def _old_step(config, params, lens_R, steps=4):
    """The old engine's decode step (valid-prefix blocked attention over a [B, K, S, d] cache)."""
    R = len(lens_R)
    cache = models.init_cache(config, R, max(lens_R) + steps + 1)
    start0_R = jnp.asarray(lens_R, jnp.int32)
    layers = models.split_layers(config, params)
    tok_R1 = jnp.ones((R, 1), jnp.int32)

    def loop(cache):
        def body(i, carry):
            cache, acc = carry
            start = start0_R + i
            slots = models.CacheSlots(start, start[:, None], kv_len_B=start + 1)
            logits, cache = models.forward_cached(
                config, params, tok_R1, cache, slots, layers=layers
            )
            return cache, acc + logits[:, 0, 0].sum()

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))

    return jax.jit(loop, donate_argnums=0), cache


def longest(config, params, args, rows=32, live=32 * 256, tops=(1024, 2048)):
    """Decode step seconds at `live` tokens over `rows` rows, longest row L vs 2L."""
    results = {}
    for name in ("paged", "old"):
        loops = {}
        for top in tops:
            rest = (live - top) // (rows - 1)
            lens = [top] + [rest] * (rows - 1)
            if name == "paged":
                loops[top] = list(_paged_step(config, params, lens, 16))
            else:
                loops[top] = list(_old_step(config, params, lens))

        def run(top, loops=loops):
            def go():
                jitted, state = loops[top]
                state, acc = jitted(state)
                loops[top][1] = state
                return acc

            return go

        results[name] = pairs(run(tops[0]), run(tops[1]), args.pairs)
    lo, hi = tops
    for name, (a_s, b_s, ratios) in results.items():
        print(
            f"decode step, {live} live tokens over {rows} rows, longest row {lo} -> {hi}, "
            f"{name} attention: {1e3 * statistics.median(a_s) / 4:.2f} -> "
            f"{1e3 * statistics.median(b_s) / 4:.2f} ms; {spread(ratios)} over {args.pairs} pairs"
            + (" (target <= 1.15x)" if name == "paged" else " (previous engine)")
        )


def row_costs(config, params, args, counts=(1, 4, 16, 32, 64, 128, 256), cached=64):
    """Decode step seconds vs live rows at `cached` tokens each: how a step's cost per row
    falls (or not) as rows are added, the CPU property that sets what concurrency can buy.

    Also the static/continuous time ratio this curve predicts for part tail's rows at its
    limit (every row to the limit in one batch vs `--slots` rows at a time over the same
    row-steps; attention and refills left out): it depends on the per-row cost at the full
    batch against that at the slots, which differs between CPUs.
    """
    per_row = {}
    for R in counts:
        fn, pools = _paged_step(config, params, [cached] * R, 16, steps=8)
        pools = jax.block_until_ready(fn(pools))[0]
        times = []
        for _ in range(max(3, args.pairs)):
            s, (pools, _) = timed(functools.partial(fn, pools))
            times.append(s / 8)
        per_row[R] = statistics.median(times) / R
    print(
        f"decode step per live row ({cached} cached tokens): "
        + ", ".join(f"{R} rows {1e3 * c:.3f} ms" for R, c in per_row.items())
    )
    rows, N = args.tail_prompts * args.group, args.new_tokens
    limits = long_tail_lengths(rows, N)
    full = min(counts, key=lambda R: abs(R - rows))
    slots = min(counts, key=lambda R: abs(R - args.slots))
    static = (N - 1) * rows * per_row[full]
    continuous = (limits - 1).sum() * per_row[slots]
    print(
        f"predicted static / continuous time at {rows} rows, N {N}, {args.slots} slots: "
        f"{static / continuous:.2f}x (per-row cost at {full} rows / at {slots}: "
        f"{per_row[full] / per_row[slots]:.2f})"
    )


def tiny(old, args):
    """configs/tiny.py's sampler shapes: paged generate vs the old static generate."""
    from configs import tiny as tiny_config

    c = tiny_config.get_config()
    config = models.get_config(c.model.preset, **dict(c.model.overrides))
    params = models.init_params(config, jax.random.key(0))
    tokens, lengths = prompts_for(config, c.prompts_per_step, 16)
    N, G, key = c.sampler.max_new_tokens, c.group_size, jax.random.key(1)
    spec = sampler.SamplerSpec(N, num_samples=G, eos_ids=(2,))
    run_old = lambda: old.generate(
        config, params, tokens, lengths, max_new_tokens=N, rng=key, num_samples=G, eos_id=2
    )
    run_new = lambda: sampler.generate(config, params, tokens, lengths, spec, rng=key)
    assert np.array_equal(run_old().tokens, run_new().tokens)
    a_s, b_s, ratios = pairs(run_old, run_new, args.tiny_pairs)
    print(
        f"tiny default shapes ({c.prompts_per_step * G} rows, {N} new tokens): old static "
        f"{1e3 * statistics.median(a_s):.1f} ms, paged {1e3 * statistics.median(b_s):.1f} ms: "
        f"paged/old time {spread(ratios)} over {args.tiny_pairs} pairs (target <= 1.05x)"
    )


def _episode_plan(args):
    """Per turn k: the tokens drawn so far before it and the observation after it."""
    T, O, K = args.turn_tokens, args.obs_tokens, args.turns
    return [(k * (T + O), O if k < K - 1 else 0) for k in range(K)]


def _observations(config, rows: int, N: int):
    """The environment's tokens [rows, N], at the episode positions where they are fed."""
    return np.random.default_rng(1).integers(1, config.vocab_size, (rows, N), dtype=np.int32)


def _kept_turns(config, params, tokens, lengths, spec, args):
    """The episodes on one multi-turn sampler.Session, and the tokens the model ran (prefill + decode feeds)."""
    B, N, T = len(lengths), spec.max_new_tokens, args.turn_tokens
    obs_BN = _observations(config, B, N)
    session = sampler.Session(config, spec, turns=True)
    gen = session.start(params, tokens, lengths, rng=jax.random.key(0), row_limits=np.full(B, T))
    ran = int(lengths.sum()) + int(gen.stats.busy)
    for start, O in _episode_plan(args)[:-1]:
        mask = np.zeros((B, N), bool)
        mask[:, start + T : start + T + O] = True
        limit = np.full(B, start + T + O + T)
        gen = session.resume(params, obs_BN, mask, np.ones(B, bool), limit)
        ran += int(gen.stats.busy)
    return gen, ran


def _reprefilled_turns(config, params, tokens, lengths, spec, args):
    """The same episodes, each turn a generate call on the prompt and the episode so far, and
    the tokens the model ran."""
    B, N, T = len(lengths), spec.max_new_tokens, args.turn_tokens
    obs_BN = _observations(config, B, N)
    ctx = np.concatenate([tokens, np.zeros((B, N), np.int32)], 1)
    turn_spec, ran = spec._replace(max_new_tokens=T), 0
    for k, (start, O) in enumerate(_episode_plan(args)):
        key = jax.random.fold_in(jax.random.key(0), k)
        gen = sampler.generate(config, params, ctx, lengths + start, turn_spec, rng=key)
        ran += int(lengths.sum()) + B * start + int(gen.stats.busy)
        new = np.asarray(gen.tokens)
        for b in range(B):  # the turn, then its observation, after the episode so far
            at = lengths[b] + start
            ctx[b, at : at + T] = new[b]
            ctx[b, at + T : at + T + O] = obs_BN[b, start + T : start + T + O]
    return gen, ran


def turns(config, params, args):
    """Forward tokens per episode token and seconds per batch, kept KV vs re-prefilled."""
    width, B = 32, args.prompts
    tokens, lengths = prompts_for(config, B, width)
    plan = _episode_plan(args)
    N = plan[-1][0] + args.turn_tokens
    spec = sampler.SamplerSpec(max_new_tokens=N, sampling=sampler.Sampling(1.0))
    episode = int(lengths.sum()) + B * N  # a single-turn row of the same total length
    run_kept = lambda: _kept_turns(config, params, tokens, lengths, spec, args)
    run_again = lambda: _reprefilled_turns(config, params, tokens, lengths, spec, args)
    kept, reprefill = run_kept()[1], run_again()[1]
    kept_s, again_s, ratios = pairs(lambda: run_kept()[0], lambda: run_again()[0], args.pairs)
    print(
        f"turns ({args.turns} x {args.turn_tokens} drawn + {args.obs_tokens} observed tokens, "
        f"{B} rows): forward tokens per episode token kept {kept / episode:.2f} vs re-prefilled "
        f"{reprefill / episode:.2f} (target <= 1.2); seconds per batch kept "
        f"{statistics.median(kept_s):.2f} vs re-prefilled {statistics.median(again_s):.2f}: "
        f"kept is {spread(ratios)} faster"
    )


# Wider than BENCH_MODEL: 63M parameters, 250 MB in float32, all read at every decode step.
WEIGHTS_MODEL = BENCH_MODEL | {"hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                               "num_kv_heads": 8}  # fmt: skip


def weight_dtypes(config, params, args, rows: int = 16, new_tokens: int = 64):
    """Decode tokens/s of the same calls with float32, bfloat16 and int8 sampler weights."""
    from ebpo_jax.models import quantize

    tokens, lengths = prompts_for(config, rows, 16)
    spec = sampler.SamplerSpec(max_new_tokens=new_tokens)  # greedy; no stop: equal tokens
    call = lambda p: (
        lambda: sampler.generate(config, p, tokens, lengths, spec, rng=jax.random.key(0)).tokens
    )
    int8 = jax.jit(quantize.int8_weights, static_argnums=1)(params, config.dtype)
    made = rows * new_tokens
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        cast = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), params)
        a_s, b_s, ratios = pairs(call(cast), call(int8), args.pairs)
        print(
            f"decode tokens/s, sampler weights {name} {made / statistics.median(a_s):.0f} vs "
            f"int8 {made / statistics.median(b_s):.0f} ({rows} rows x {new_tokens} tokens): "
            f"int8 is {spread([1 / r for r in ratios])} of {name}'s speed over {args.pairs} pairs"
        )


def update_line(runs: int = 2):
    """Update tokens/s padded vs packed on the same long-tailed lengths (packed_bench)."""
    import packed_bench  # benchmarks/ is on sys.path when this file runs

    r = packed_bench.long_tail_case(runs)
    return (
        f"update tokens/s padded vs packed: {r['padded']:.0f} vs {r['packed']:.0f} "
        f"({r['ratio']:.2f}x; target >= 2x)"
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tiny-pairs", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tail-prompts", type=int, default=32, help="part tail: prompts")
    ap.add_argument(
        "--new-tokens", type=int, default=1024, help="part tail: the limit N (mean N / 4)"
    )
    ap.add_argument("--slots", type=int, default=16, help="the old engine's slots")
    ap.add_argument("--paged-slots", type=int, default=32, help="the paged engine's slots")
    ap.add_argument(
        "--live-buckets", type=int, default=1, help="the paged engine's sampler.live_buckets"
    )
    ap.add_argument("--old-ref", default=OLD_REF, help="git ref of the previous engine")
    ap.add_argument("--turns", type=int, default=4, help="part turns: model turns")
    ap.add_argument("--turn-tokens", type=int, default=32, help="part turns: tokens per turn")
    ap.add_argument("--obs-tokens", type=int, default=16, help="part turns: per observation")
    ap.add_argument("--kv-new-tokens", type=int, default=256, help="part kv: the limit N")
    ap.add_argument("--parts", default="tail,longest,tiny,update,turns,kv")
    ap.add_argument("--smoke", action="store_true", help="part longest at the smallest sizes")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.smoke:
        return smoke(args)
    config = models.get_config("tiny", **BENCH_MODEL)
    params = models.init_params(config, jax.random.key(0))
    print(f"{cpu_model()}; backend {jax.default_backend()}; model {BENCH_MODEL}")
    old = old_engine(args.old_ref) if parts & {"tail", "tiny"} else None
    if "tail" in parts:
        tail(config, params, old, args)
    if "longest" in parts:
        longest(config, params, args)
    if "tiny" in parts:
        tiny(old, args)
    if "rows" in parts:
        row_costs(config, params, args)
    if "update" in parts:
        print(update_line())
    if "turns" in parts:
        turns(config, params, args)
    if "kv" in parts:
        kv_int8(config, params, args)
    if "weights" in parts:
        wide = models.get_config("tiny", **WEIGHTS_MODEL)
        weight_dtypes(wide, models.init_params(wide, jax.random.key(0)), args)


def smoke(args):
    """Part longest at the smallest sizes, one pair: the script runs (tail and tiny need a git
    checkout of the old engine, update is packed_bench's: its own --smoke); the figures mean
    nothing."""
    model = BENCH_MODEL | {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}
    config = models.get_config("tiny", **model | {"head_dim": 16, "max_position_embeddings": 64})
    params = models.init_params(config, jax.random.key(0))
    args.pairs = 1
    longest(config, params, args, rows=2, live=20, tops=(8, 16))
    args.prompts, args.turns, args.turn_tokens, args.obs_tokens = 2, 2, 3, 2
    turns(config, params, args)
    weight_dtypes(config, params, args, rows=2, new_tokens=3)


if __name__ == "__main__":
    main()
