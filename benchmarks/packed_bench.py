"""Update tokens/s, padded vs packed (trainer/packing.py), on the same rollout lengths.

One PPO mini-batch update (gradients over its micro-batches, then AdamW) in each layout,
timed alternately in one process (median of --runs). Tokens/s counts the same useful tokens
for both (each sequence's prompt and completion), so the ratio is the time ratio.
- long tail: completions lognormal with mean max_new_tokens / 4, 5% at the limit;
- tiny default: configs/tiny.py's model and arithmetic prompts, completions as long as the
  answers plus EOS (short and near-uniform).
`update_throughput` is importable (benchmarks/rollout_bench.py prints its ratio).
Run: JAX_PLATFORMS=cpu python benchmarks/packed_bench.py [--runs 5] [--case long|tiny|both]
Measured (2-core CPU loaded by ~8 other jobs, jaxlib 0.10): long tail 2.19x (16640 padded
token slots vs 6912 packed: 3 micro-batches of 8 rows x 288); tiny default 1.02x (752 vs 864
slots in 2 micro-batches of 18 rows x 24, prompts shared).
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/
from ebpo_jax import losses, models, schema
from ebpo_jax.config import default_config
from ebpo_jax.spec import update_spec
from ebpo_jax.trainer import packing
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.update import completion_logprobs


def long_tail_lengths(rng, n: int, max_new_tokens: int, sigma: float = 1.0, at_limit=0.05):
    """Lognormal lengths with mean max_new_tokens / 4, clipped to [1, max], a share at max."""
    mu = np.log(max_new_tokens / 4) - sigma**2 / 2
    out = np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, max_new_tokens).astype(np.int32)
    out[rng.random(n) < at_limit] = max_new_tokens
    return out


def _batch(rng, plen_P, clen_B, Tp, N, vocab):
    P, B = len(plen_P), len(clen_B)
    tok = lambda shape, n: rng.integers(1, vocab, shape) * (np.arange(shape[1]) < n[:, None])
    mask_BN = np.arange(N) < clen_B[:, None]
    return MicroBatch(
        prompt_tokens=jnp.asarray(tok((P, Tp), plen_P), jnp.int32),
        prompt_lengths=jnp.asarray(plen_P, jnp.int32),
        tokens=jnp.asarray(tok((B, N), clen_B).reshape(P, B // P, N), jnp.int32),
        lengths=jnp.asarray(clen_B.reshape(P, -1), jnp.int32),
        logprobs=jnp.asarray(-rng.uniform(0.5, 5.0, (P, B // P, N)), jnp.float32),
        adv=jnp.asarray(rng.standard_normal((P, B // P)), jnp.float32),
        loss_mask=jnp.asarray(mask_BN.reshape(P, B // P, N)),
    )


def _grad_fn(model_config, lay, B, N):
    """value_and_grad of step.py's loss (token-mean PPO clip, entropy as a metric)."""

    def loss_fn(params, ref_params, mb, denom):
        if lay is None:
            logp_BN, ent_BN = completion_logprobs(model_config, params, mb, with_entropy=True)
        else:
            logp_BN, ent_BN = packing.packed_completion_logprobs(
                model_config, params, mb.packed, slots=(B, N), with_entropy=True
            )
        terms = losses.TokenTerms(
            logp_BN,
            mb.logprobs.reshape(-1, N),
            mb.adv.reshape(-1),
            mb.loss_mask.reshape(-1, N),
            entropy_BT=jax.lax.stop_gradient(ent_BN),
        )
        return losses.policy_loss(terms, denominator=denom)

    return jax.value_and_grad(loss_fn, has_aux=True)


def _update_fn(model_config, lay, optimizer, B, N):
    grad_fn = _grad_fn(model_config, lay, B, N)

    def update(params, opt_state, mb):
        denom = mb.loss_mask.sum().astype(jnp.float32)
        if lay is None:
            (loss, _), grads = grad_fn(params, params, mb, denom)
        else:
            grads, loss, _ = packing.accumulate(grad_fn, params, params, mb, denom, lay)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(update)


def update_throughput(model_config, plen_P, clen_B, *, Tp, N, budget, row_len=0, runs=5, seed=0):
    """{padded, packed: tokens/s, ratio, rows...} of one mini-batch update on these lengths."""
    P, B = len(plen_P), len(clen_B)
    c = default_config()
    c.prompts_per_step, c.group_size, c.sampler.max_new_tokens = P, B // P, N
    c.loss.tokens_per_microbatch, c.loss.pack_row_len = budget, row_len
    lay = packing.layout(update_spec(schema.parse(c)), model_config, Tp)
    mb = _batch(np.random.default_rng(seed), plen_P, clen_B, Tp, N, model_config.vocab_size)
    params = models.init_params(model_config, jax.random.key(seed))
    optimizer = optax.adamw(1e-5)
    fns = {
        name: _update_fn(model_config, l, optimizer, B, N)
        for name, l in (("padded", None), ("packed", lay))
    }
    opt_state = optimizer.init(params)
    times = {name: [] for name in fns}
    for i in range(runs + 1):  # the first round compiles
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(params, opt_state, mb))
            if i:
                times[name].append(time.perf_counter() - t)
    useful = int(np.sum(np.repeat(plen_P, B // P)) + np.sum(clen_B))
    pl = packing.plan(lay, mb.prompt_lengths, packing.loss_span(mb.loss_mask.reshape(B, N)))
    out = {name: useful / statistics.median(t) for name, t in times.items()}
    out.update(
        ratio=out["packed"] / out["padded"],
        useful_tokens=useful,
        padded_tokens=P * Tp + B * N,
        packed_tokens=int(pl.num_micro) * lay.rows * lay.row_len,
        layout=lay,
    )
    return out


def _report(name, r):
    lay = r["layout"]
    print(
        f"{name}: update tokens/s padded {r['padded']:.0f} vs packed {r['packed']:.0f} "
        f"= {r['ratio']:.2f}x  (useful {r['useful_tokens']}, padded layout "
        f"{r['padded_tokens']}, packed rows {r['packed_tokens']} = {lay.rows} rows x "
        f"{lay.row_len} x micro-batches)",
        flush=True,
    )


def long_tail_case(runs):
    P, G, Tp, N = 8, 8, 32, 256
    rng = np.random.default_rng(0)
    plen_P = rng.integers(8, Tp + 1, P)
    clen_B = long_tail_lengths(rng, P * G, N)
    mc = models.get_config(
        "tiny",
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        vocab_size=512,
        scan_unroll=4,
    )
    return update_throughput(mc, plen_P, clen_B, Tp=Tp, N=N, budget=8 * (Tp + N), runs=runs)


def smoke_case(runs=1):
    """The smallest long-tailed case: the script runs; its figures mean nothing."""
    P, G, Tp, N = 2, 2, 8, 8
    rng = np.random.default_rng(0)
    plen_P = rng.integers(4, Tp + 1, P)
    clen_B = long_tail_lengths(rng, P * G, N)
    mc = models.get_config(
        "tiny", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, vocab_size=64,
    )  # fmt: skip
    return update_throughput(mc, plen_P, clen_B, Tp=Tp, N=N, budget=2 * (Tp + N), runs=runs)


def tiny_default_case(runs, row_len=0, budget=0):
    from configs import tiny
    from ebpo_jax.spec import resolve
    from ebpo_jax.tasks.families import arithmetic as task_arithmetic

    c = tiny.get_config()
    _, problems, _ = task_arithmetic.load_problems(resolve(c).task)
    P = c.prompts_per_step // c.loss.num_minibatches
    G, N = c.group_size, c.sampler.max_new_tokens
    rng = np.random.default_rng(0)
    pick = rng.choice(len(problems), P, replace=False)
    plen_P = np.array([len(problems[i].prompt) + 1 for i in pick])  # + BOS
    Tp = max(len(p.prompt) for p in problems) + 1
    clen_B = np.repeat([min(len(problems[i].answer) + 1, N) for i in pick], G)
    mc = models.get_config("tiny", **dict(c.model.overrides))
    # Rows of two max-length sequences, one micro-batch sized to the shared-prompt tokens
    # plus 10%: each group's prompt once per row, then its completions.
    row_len = row_len or 2 * (Tp + N)
    shared = np.sum(plen_P - 1) + clen_B.sum()
    budget = budget or row_len * int(np.ceil(1.1 * shared / row_len))
    return update_throughput(
        mc, plen_P, clen_B, Tp=Tp, N=N, budget=budget, row_len=row_len, runs=runs
    )


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--case", default="both", choices=("long", "tiny", "both"))
    p.add_argument("--smoke", action="store_true", help="only the smallest case, one run")
    a = p.parse_args(argv)
    if a.smoke:
        _report("smoke (2 prompts x 2, N=8)", smoke_case())
        return
    if a.case in ("long", "both"):
        _report("long tail (lognormal mean N/4, 5% at N=256)", long_tail_case(a.runs))
    if a.case in ("tiny", "both"):
        _report("tiny default (configs/tiny.py lengths)", tiny_default_case(a.runs))


if __name__ == "__main__":
    main()
