"""The update's typed mini-batch: one pytree for the rollout's rows, a mini-batch and a
micro-batch, padded or packed.

Rows are grouped by prompt, [P', G, ...] (prompt fields [P', ...]). A packed micro-batch
(`trainer/packing.py`) carries its token rows in `packed` instead of the padded prompt and
completion fields; `update.logprobs` and `update.accumulate` read either. A field that does
not apply is None (an empty pytree node: nothing to shard, scan or donate).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Reduced by max over micro-batches: a sum, as for the other metrics, would add their maxima.
MAX_METRICS = ("mismatch/abs_diff_max",)


class MicroBatch(NamedTuple):
    """The loss's inputs for some prompt groups; None where a field does not apply."""

    prompt_tokens: jax.Array | None = None  # [P', Tp] (padded layout)
    prompt_lengths: jax.Array | None = None  # [P']
    tokens: jax.Array | None = None  # [P', G, N] completions
    lengths: jax.Array | None = None  # [P', G]
    logprobs: jax.Array | None = None  # [P', G, N] old log-probs (sampler's or recomputed)
    adv: jax.Array | None = None  # [P', G] advantages
    loss_mask: jax.Array | None = None  # [P', G, N] bool: tokens in the loss
    routing: Any = None  # MoE routing replay: the sampler's experts
    is_weights: jax.Array | None = None  # [P', G, N] TIS / MIS weights
    mb_tokens: jax.Array | None = None  # loss tokens of the whole mini-batch (float32)
    packed: Any = None  # packing.micro_batch's token rows: the packed layout
    noise: jax.Array | None = None  # [P', G, N] uniform draws for a sampling surrogate (clip_cov)


def sum_micro(metrics_U: dict) -> dict:
    """A mini-batch's metrics from its micro-batches' (stacked on a leading [U] axis): sums,
    maxima for MAX_METRICS."""
    return {k: v.max(0) if k in MAX_METRICS else v.sum(0) for k, v in metrics_U.items()}


def add_micro(acc: dict, metrics: dict) -> dict:
    """`acc` with one more micro-batch's metrics: added, maxima for MAX_METRICS."""
    both = lambda k, v: jnp.maximum(acc[k], v) if k in MAX_METRICS else acc[k] + v
    return {k: both(k, v) for k, v in metrics.items()}
