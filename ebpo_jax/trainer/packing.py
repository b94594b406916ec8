"""Packed update: a mini-batch's sequences in fixed-length rows with segment ids, micro-batches
sized by a token budget (`loss.tokens_per_microbatch`), log-probs scattered back to [B, N].

Layout. Completion b of prompt p (prompt length lp, loss span cb: up to its last loss-mask
token) is a *unit* of cb tokens: the prompt's last token, then completion tokens 0 .. cb-2,
at positions lp-1 .. lp+cb-2. Unit token j predicts completion token j, so each hidden state
feeds exactly one [B, N] slot and the scatter back is one-to-one. The prompt's first lp-1
tokens are a *prefix* piece at positions 0 .. lp-2. With `share_prompt` (XLA attention) a
row holds one prefix per group it serves and each of that group's units in the row attends
it through `prefix_ids`: the prompt runs once per group and row, the saving
`models.forward_grouped` makes in the padded update. The splash kernel masks by segment
equality only, so under it each unit carries its own prefix copy in its segment (plain
sequence packing). Every unit is placed after its prefix, so causality by slot holds.

Planning (`plan`) is jittable (a lax.scan over the B units, O(rows) work each), so it runs
inside the jitted step, where the rollout's lengths are traced values. First fit, groups in
decreasing total length and a group's completions in decreasing length: in a simulation of
long-tailed lengths it filled 95-99% of each row and needed fewer rows than
first-fit-decreasing over single sequences, which splits groups and shares fewer prompts.
Rows used are 0 .. rows_used-1; micro-batch u is rows [u R, (u+1) R), and `accumulate`
runs the used ones only (a while_loop), so nothing overflows: the row buffer has room for
one unit per row, the worst case, and only the last micro-batch can be part-empty.
Hand-written because no library this project uses packs shared prefixes inside jit.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import losses, models, sharding
from ebpo_jax.models import attention
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import UpdateSpec
from ebpo_jax.trainer.batch import MicroBatch, add_micro


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shapes of one packed mini-batch (hashable: a jit static argument)."""

    num_prompts: int  # P prompts per mini-batch
    group_size: int  # G completions per prompt
    max_new_tokens: int  # N, the completion width of the [B, N] slots
    row_len: int  # L tokens per row
    rows: int  # R rows per micro-batch
    num_micro: int  # micro-batches the row buffer holds (the worst case: one unit per row)
    share_prompt: bool  # one prefix per group and row (XLA), else one per unit (splash)
    context: int = 1  # shards of a row's tokens (the mesh's `context` axis): zig-zag order if > 1

    @property
    def num_rows(self) -> int:
        return self.rows * self.num_micro


def layout(
    spec: UpdateSpec, model_config, prompt_width: int, *, batch_shards: int = 1, context: int = 1
):
    """The Layout for `spec` (None when loss.tokens_per_microbatch == 0: padded update).

    `prompt_width` is the rollout's prompt array width; `batch_shards` the devices rows are
    split over (rows per micro-batch are rounded down to a multiple of it); `context` the
    devices a row's tokens are split over (its length a multiple of 2 x context: zig-zag).
    """
    budget = spec.loss.tokens_per_microbatch
    if budget == 0:
        return None
    P, G = spec.prompts // spec.loss.num_minibatches, spec.group_size
    N = spec.max_new_tokens
    chunks = 2 * context if context > 1 else 1
    L = spec.loss.pack_row_len or _round_up(prompt_width + N, chunks)
    if L % chunks:
        raise ConfigError(
            f"loss.pack_row_len={L} must be a multiple of 2 x the mesh's context axis "
            f"({2 * context}): each context shard holds two equal chunks of a row"
        )
    if L < prompt_width + N - 1:
        raise ConfigError(
            f"loss.pack_row_len={L} is shorter than the longest sequence "
            f"(prompt width {prompt_width} + sampler.max_new_tokens {N} - 1)"
        )
    splash = attention.resolve(model_config.attention) == "splash"
    if splash:
        from ebpo_jax.models.splash import BLOCK

        if L > BLOCK and L % BLOCK:
            raise ConfigError(f"loss.pack_row_len={L}: splash needs <= {BLOCK} or a multiple")
    rows = budget // L // batch_shards * batch_shards
    if rows < 1:
        raise ConfigError(
            f"loss.tokens_per_microbatch={budget} holds {budget // L} rows of {L} tokens; "
            f"needs at least {batch_shards} (one per batch shard)"
        )
    rows = min(rows, -(-P * G // batch_shards) * batch_shards)  # more than B rows stay empty
    return Layout(P, G, N, L, rows, -(-P * G // rows), share_prompt=not splash, context=context)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class Plan(NamedTuple):
    """Where each unit went: flat offsets row * L + slot, -1 = not packed (no loss token)."""

    span_B: jax.Array  # tokens of each unit (0 = not packed)
    prefix_len_B: jax.Array  # tokens of the prefix piece a unit placed (0 = none)
    row_B: jax.Array
    start_B: jax.Array  # the unit's first token
    prefix_start_B: jax.Array  # the prefix piece it placed in its row, or -1
    num_micro: jax.Array  # micro-batches holding rows (a traced int32)


def loss_span(mask_BN):
    """Tokens up to and including each row's last loss-mask token (0 when it has none)."""
    N = mask_BN.shape[-1]
    return jnp.max(jnp.where(mask_BN, jnp.arange(1, N + 1), 0), axis=-1).astype(jnp.int32)


def _order(lay: Layout, prompt_len_P, span_B):
    """Units by group (decreasing group total), then decreasing span within a group."""
    P, G = lay.num_prompts, lay.group_size
    span_PG = span_B.reshape(P, G)
    total_P = span_PG.sum(1) + jnp.where(span_PG.any(1), prompt_len_P - 1, 0)
    rank_P = jnp.argsort(jnp.argsort(-total_P, stable=True), stable=True)
    return jnp.lexsort((-span_B, jnp.repeat(rank_P, G)))


def plan(lay: Layout, prompt_len_P, span_B) -> Plan:
    """First-fit placement of the units (span_B [B], 0 = skip) into lay.num_rows rows."""
    G, L, R_all = lay.group_size, lay.row_len, lay.num_rows
    prompt_len_P = prompt_len_P.astype(jnp.int32)
    span_B = span_B.astype(jnp.int32)
    group_B = jnp.arange(span_B.shape[0]) // G
    lp1_B = jnp.where(span_B > 0, prompt_len_P[group_B] - 1, 0)

    def place(carry, b):
        fill_R, has_R, cur = carry
        g, c, lp1 = group_B[b], span_B[b], lp1_B[b]
        has_R = has_R & (g == cur)  # rows holding this group's prefix
        need_R = c + jnp.where(has_R, 0, lp1)
        r = jnp.argmax(fill_R + need_R <= L)  # an empty row always fits: L >= lp1 + c
        put_prefix = ~has_R[r]
        live = c > 0
        f = fill_R[r]
        fill_R = fill_R.at[r].add(jnp.where(live, need_R[r], 0))
        has_R = has_R.at[r].set(has_R[r] | (live & lay.share_prompt))
        prefix_start = jnp.where(live & put_prefix & (lp1 > 0), r * L + f, -1)
        unit_start = jnp.where(live, r * L + f + jnp.where(put_prefix, lp1, 0), -1)
        return (fill_R, has_R, g), (jnp.where(live, r, -1), unit_start, prefix_start)

    order_B = _order(lay, prompt_len_P, span_B)
    init = (jnp.zeros(R_all, jnp.int32), jnp.zeros(R_all, bool), jnp.int32(-1))
    _, placed = jax.lax.scan(place, init, order_B)
    row_B, start_B, prefix_start_B = (jnp.zeros_like(x).at[order_B].set(x) for x in placed)
    rows_used = jnp.max(row_B, initial=-1) + 1
    return Plan(
        span_B=span_B,
        prefix_len_B=jnp.where(prefix_start_B >= 0, lp1_B, 0),
        row_B=row_B,
        start_B=start_B,
        prefix_start_B=prefix_start_B,
        num_micro=(rows_used + lay.rows - 1) // lay.rows,
    )


def micro_batch(lay: Layout, pl: Plan, prompt_PT, prompt_len_P, comp_BN, u, routing=None):
    """The packed rows [R, L] of micro-batch u: model inputs, targets and [B, N] slots.

    Keys: tokens, positions, segment_ids (0 = padding), prefix_ids (shared prompts only),
    targets (the completion token each position predicts) and dest (flat slot b * N + n the
    position's log-prob goes to; B * N = none). With `routing` (the rollout's recorded
    experts, {"prompt", "comp"} of [P, G, ...]) also "routing" [sparse layers, R, L, k].
    """
    B, N, L, Tp = comp_BN.shape[0], lay.max_new_tokens, lay.row_len, prompt_PT.shape[1]
    # Pieces: B units then B prefixes, by flat start; an absent piece starts past the end.
    end = lay.num_rows * L
    start_K = jnp.concatenate([pl.start_B, pl.prefix_start_B])
    start_K = jnp.where(start_K < 0, end, start_K)
    len_K = jnp.concatenate([pl.span_B, pl.prefix_len_B])
    perm_K = jnp.argsort(start_K)
    row_R = u * lay.rows + jnp.arange(lay.rows)
    o_RL = row_R[:, None] * L + jnp.arange(L)[None]
    k_RL = jnp.searchsorted(start_K[perm_K], o_RL, side="right") - 1
    piece_RL = perm_K[jnp.maximum(k_RL, 0)]
    j_RL = o_RL - start_K[piece_RL]
    inside_RL = (k_RL >= 0) & (j_RL < len_K[piece_RL])
    unit_RL = inside_RL & (piece_RL < B)
    b_RL = piece_RL % B
    p_RL = b_RL // lay.group_size
    lp_RL = prompt_len_P[p_RL].astype(jnp.int32)
    comp_at = lambda n_RL: comp_BN[b_RL, jnp.clip(n_RL, 0, N - 1)]
    unit_tok = jnp.where(
        j_RL == 0, prompt_PT[p_RL, jnp.clip(lp_RL - 1, 0, Tp - 1)], comp_at(j_RL - 1)
    )
    prefix_tok = prompt_PT[p_RL, jnp.clip(j_RL, 0, Tp - 1)]
    if lay.share_prompt:  # one id per (group, row): the row's copy of that group's prompt
        prefix_id_RL = B + 1 + p_RL * lay.num_rows + row_R[:, None]
    else:
        prefix_id_RL = b_RL + 1
    out = {
        "tokens": jnp.where(inside_RL, jnp.where(unit_RL, unit_tok, prefix_tok), 0),
        "positions": jnp.where(inside_RL, jnp.where(unit_RL, lp_RL - 1, 0) + j_RL, 0),
        "segment_ids": jnp.where(inside_RL, jnp.where(unit_RL, b_RL + 1, prefix_id_RL), 0),
        "targets": jnp.where(unit_RL, comp_at(j_RL), 0),
        "dest": jnp.where(unit_RL, b_RL * N + j_RL, B * N),
    }
    if lay.share_prompt:
        out["prefix_ids"] = jnp.where(inside_RL, prefix_id_RL, 0)
    out = {k: v.astype(jnp.int32) for k, v in out.items()}
    if routing is not None:
        from_prompt_RL = inside_RL & (~unit_RL | (j_RL == 0))
        # prompt position (a prefix token, a unit's first) or completion index (the rest)
        i_RL = jnp.where(unit_RL, jnp.where(j_RL == 0, lp_RL - 1, j_RL - 1), j_RL)
        out["routing"] = _routing_rows(routing, p_RL, b_RL, i_RL, from_prompt_RL, inside_RL)
    return zigzag(out, lay.context) if lay.context > 1 else out


def zigzag(rows: dict, context: int) -> dict:
    """`micro_batch`'s rows with each row's slots in zig-zag order over `context` shards, and
    "slots" [R, L] (each token's slot before it) for attention's causality. The log-probs
    scatter back through "dest", so the order changes nothing else."""
    R, L = rows["tokens"].shape
    order_L = jnp.asarray(sharding.zigzag_order(L, context))
    out = {k: v[..., order_L] if k != "routing" else v[:, :, order_L] for k, v in rows.items()}
    out["slots"] = jnp.broadcast_to(order_L.astype(jnp.int32), (R, L))
    return out


def _routing_rows(routing, p_RL, b_RL, i_RL, from_prompt_RL, inside_RL):
    """The recorded experts of each packed token, [sparse layers, R, L, k] (0 off the pieces):
    prompt[p, 0, :, i] (the group's first sample's, as the padded update's) or comp[b, :, i]."""
    prompt_PLTk = routing["prompt"][:, 0]
    comp_BLNk = routing["comp"].reshape(-1, *routing["comp"].shape[2:])
    Tp, N = prompt_PLTk.shape[2], comp_BLNk.shape[2]
    from_prompt_RLLk = prompt_PLTk[p_RL, :, jnp.clip(i_RL, 0, Tp - 1)]  # [R, L, layers, k]
    from_comp_RLLk = comp_BLNk[b_RL, :, jnp.clip(i_RL, 0, N - 1)]
    e_RLLk = jnp.where(from_prompt_RL[..., None, None], from_prompt_RLLk, from_comp_RLLk)
    return jnp.where(inside_RL[..., None, None], e_RLLk, 0).transpose(2, 0, 1, 3)


def packed_completion_logprobs(
    model_config, params, packed, *, slots, with_entropy, chunk_size=0, with_router=False
):
    """Per-token log-probs [B, N] (and entropy) of the completions in `packed`'s rows.

    `slots` = (B, N). Slots of sequences not in these rows are 0, so a loss over them needs
    a loss mask restricted to this micro-batch's sequences (`accumulate` builds it).
    Mixture of experts: packed["routing"] (if there) replays recorded experts; `with_router`
    returns (result, route), route as `models.forward`'s over the rows' tokens.
    """
    B, N = slots
    out = models.forward(
        model_config,
        params,
        packed["tokens"],
        positions=packed["positions"],
        segments=models.Segments(
            packed["segment_ids"], packed.get("prefix_ids"), packed.get("slots")
        ),
        return_hidden=True,
        routing=packed.get("routing"),
        with_router=with_router,
    )
    h_RLD, route = out if with_router else (out, None)
    R, L, D = h_RLD.shape
    w_DV = models.output_embedding(model_config, params)
    t_RL = packed["targets"]
    if model_config.batch_invariant:
        out = models.head_logprobs(model_config, params, h_RLD, t_RL, with_entropy)
        logp_T, ent_T = (x.reshape(-1) if x is not None else None for x in _pair(out))
    elif chunk_size:  # large vocabularies: chunks of positions over the flattened rows
        pad = -(R * L) % chunk_size
        h_1TD = jnp.pad(h_RLD.reshape(1, R * L, D), ((0, 0), (0, pad), (0, 0)))
        t_1T = jnp.pad(t_RL.reshape(1, R * L), ((0, 0), (0, pad)))
        out = losses.logprobs_from_hidden(
            h_1TD, w_DV, t_1T, chunk_size=chunk_size, with_entropy=with_entropy
        )
        logp_T, ent_T = (x[0, : R * L] if x is not None else None for x in _pair(out))
    else:
        logits_RLV = jnp.einsum("rld,dv->rlv", h_RLD, w_DV, preferred_element_type=jnp.float32)
        logp_T = losses.token_logprobs(logits_RLV, t_RL).reshape(-1)
        ent_T = losses.token_entropy(logits_RLV).reshape(-1) if with_entropy else None
    dest_T = packed["dest"].reshape(-1)
    scatter = lambda x_T: jnp.zeros(B * N, x_T.dtype).at[dest_T].set(x_T, mode="drop")
    logp_BN = scatter(logp_T).reshape(B, N)
    result = (logp_BN, scatter(ent_T).reshape(B, N)) if with_entropy else logp_BN
    return (result, route) if with_router else result


def _pair(out):
    """(logp, entropy or None) from a with_entropy=True/False result."""
    return out if isinstance(out, tuple) else (out, None)


def accumulate(grad_fn, params, frozen, mb: MicroBatch, denom, lay: Layout):
    """(grads, loss, metrics) of mini-batch `mb` summed over its packed micro-batches.

    `grad_fn(params, frozen, micro, denom)` is the trainer's value_and_grad of loss_fn;
    each `micro` MicroBatch holds the mini-batch's logprobs / adv / is_weights, its loss_mask
    restricted to the sequences packed in that micro-batch, mb_tokens, and `packed`
    (micro_batch's rows) in place of the padded prompt and completion fields.
    As every micro-batch is normalised by the whole mini-batch's `denom` and each sequence
    lies in exactly one, the sums are the mini-batch's loss, metrics and gradient.
    """
    P, G, N = lay.num_prompts, lay.group_size, lay.max_new_tokens
    mask_PGN = mb.loss_mask
    comp_BN = mb.tokens.reshape(P * G, N)
    pl = plan(lay, mb.prompt_lengths, loss_span(mask_PGN.reshape(P * G, N)))
    micro_PG = jnp.where(pl.row_B >= 0, pl.row_B // lay.rows, -1).reshape(P, G)
    mb_tokens = mask_PGN.sum().astype(jnp.float32)

    def micro(u):
        rows = micro_batch(lay, pl, mb.prompt_tokens, mb.prompt_lengths, comp_BN, u, mb.routing)
        return MicroBatch(
            logprobs=mb.logprobs,
            adv=mb.adv,
            loss_mask=mask_PGN & (micro_PG == u)[..., None],
            is_weights=mb.is_weights,
            noise=mb.noise,
            mb_tokens=mb_tokens,
            packed=rows,
        )

    def body(u, acc):
        (loss, metrics), grads = grad_fn(params, frozen, micro(u), denom)
        return jax.tree.map(jnp.add, acc[0], grads), acc[1] + loss, add_micro(acc[2], metrics)

    shapes = jax.eval_shape(lambda: grad_fn(params, frozen, micro(0), denom))
    (loss_s, metrics_s), grads_s = shapes
    # float32 sums, as the padded update's accumulator (bf16 gradients would lose bits).
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (grads_s, loss_s, metrics_s))
    return jax.lax.fori_loop(0, pl.num_micro, body, init)


def attention_pairs(segment_ids_L, prefix_ids_L=None):
    """Keys each slot of one packed row attends (its segment's slots up to it, plus its shared
    prefix), as numpy [L]: the work a kernel that skips masked blocks does per query."""
    seg_L = np.asarray(segment_ids_L)
    pre_L = seg_L if prefix_ids_L is None else np.asarray(prefix_ids_L)
    pairs_L = np.zeros(seg_L.shape, np.int64)
    for i in np.unique(seg_L[seg_L > 0]):
        seen_L = np.cumsum(seg_L == i)  # slots of segment i up to each slot
        pairs_L += np.where(seg_L == i, seen_L, 0) + np.where(
            (pre_L == i) & (seg_L != i), seen_L, 0
        )
    return pairs_L


def shard_balance(pairs_L, context: int, order_L=None) -> float:
    """max / mean over `context` shards of the attention pairs of their queries, the row's
    slots split contiguously after `order_L` (None: in slot order; zigzag_order: balanced)."""
    pairs_L = np.asarray(pairs_L) if order_L is None else np.asarray(pairs_L)[order_L]
    per_shard = pairs_L.reshape(context, -1).sum(1)
    return float(per_shard.max() / max(per_shard.mean(), 1e-9))
