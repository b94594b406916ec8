"""Per-shard causal attention work of packed rows split over a context axis: contiguous vs zig-zag.

Packs one mini-batch of the stated length distribution (`aot_report.Lengths`, scaled to the
response limit) with the update's planner, then counts the (query, key) pairs each context
shard's queries attend in every micro-batch (`packing.attention_pairs`): the work of a kernel
that skips masked blocks. A micro-batch waits for its busiest chip, so the figure is
sum over micro-batches of the busiest chip's pairs / sum of the chips' mean, per split;
`*_within_rows` takes each row's busiest shard instead (the imbalance the split itself
causes, without the rows' unequal totals, which the split cannot change).

  python experiments/context_balance.py --config=configs/qwen3_8b_32k.py:aot
"""

import json

import numpy as np
from absl import app

from ebpo_jax import cli

_CONFIG = cli.define_config("config", "configs/qwen3_8b_32k.py:aot", "Training config.")


def _minibatch(lay, prompts: int, group: int, prompt_len: int, seed: int = 0):
    """(prompt_len_P, span_B) drawn from the stated distribution at the layout's limit."""
    from ebpo_jax.pods.aot_report import Lengths

    lengths = Lengths(seed=seed).scaled_to(lay.max_new_tokens)
    span_B = lengths.draw(prompts * group, lay.max_new_tokens)
    prompt_P = np.full(prompts, min(lengths.prompt_tokens, prompt_len))
    return prompt_P, span_B


def balance(prompt_len, response_len, context, rows, prompts, group) -> dict:
    """max/mean per-shard attention pairs of one packed mini-batch, contiguous and zig-zag."""
    import jax
    import jax.numpy as jnp

    from ebpo_jax.sharding import zigzag_order
    from ebpo_jax.trainer import packing

    L = prompt_len + response_len
    micro = -(-prompts * group // rows)
    lay = packing.Layout(prompts, group, response_len, L, rows, micro, share_prompt=True)
    prompt_P, span_B = _minibatch(lay, prompts, group, prompt_len)
    pl = jax.jit(packing.plan, static_argnums=0)(lay, jnp.asarray(prompt_P), jnp.asarray(span_B))
    ids = jax.jit(_segments, static_argnums=0)
    prompt_PT = jnp.ones((prompts, prompt_len), jnp.int32)
    comp_BN = jnp.ones((prompts * group, response_len), jnp.int32)
    order = {"contiguous": None, "zigzag": zigzag_order(L, context)}
    busiest, in_row, mean = ({k: 0.0 for k in order} for _ in range(3))
    for u in range(int(pl.num_micro)):
        seg_RL, pre_RL = ids(lay, pl, prompt_PT, jnp.asarray(prompt_P), comp_BN, u)
        pairs_RL = [packing.attention_pairs(s, p) for s, p in zip(seg_RL, pre_RL, strict=True)]
        for name, o in order.items():
            per_chip = [(p if o is None else p[o]).reshape(context, -1).sum(1) for p in pairs_RL]
            busiest[name] += float(np.max(per_chip))
            in_row[name] += float(np.max(per_chip, axis=1).mean())
            mean[name] += float(np.mean(per_chip))
    fill = float(span_B.sum() + prompts * (prompt_P[0] - 1)) / (int(pl.num_micro) * rows * L)
    out = {k: busiest[k] / mean[k] for k in order}
    out |= {f"{k}_within_rows": in_row[k] / mean[k] for k in order}
    one_row = packing.attention_pairs(np.ones(L, int))
    return out | {
        "one_full_row": {k: packing.shard_balance(one_row, context, o) for k, o in order.items()},
        "micro_batches": int(pl.num_micro),
        "row_fill": fill,
        "row_len": L,
        "context": context,
    }


def _segments(lay, pl, prompt_PT, prompt_len_P, comp_BN, u):
    """Micro-batch u's segment and prefix ids [R, L]."""
    from ebpo_jax.trainer import packing

    rows = packing.micro_batch(lay, pl, prompt_PT, prompt_len_P, comp_BN, u)
    return rows["segment_ids"], rows["prefix_ids"]


def main(argv):
    del argv
    c = _CONFIG.value
    prompt_len, response_len = c.data.max_prompt_len, c.sampler.max_new_tokens
    row = c.loss.pack_row_len or prompt_len + response_len
    sizes = dict(zip(c.mesh.axes, c.mesh.shape, strict=True))
    prompts = c.prompts_per_step // c.loss.num_minibatches
    rows = max(1, c.loss.tokens_per_microbatch // row)
    context = sizes.get("context", 1)
    result = balance(row - response_len, response_len, context, rows, prompts, c.group_size)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
