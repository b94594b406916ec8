"""Continuous batching: a fixed number of decode slots, refilled from the queue of rows.

Each prompt is prefilled once into a prompt cache; its G rows wait in a queue. A slot
decodes one row; when the row ends (a stop id or max_new_tokens) the slot takes the next
pending row: its prompt's keys are copied into the slot and its first token (sampled from
the prefill's logits) is fed in. Everything runs in one jitted `while_loop`, until the queue
is empty and no slot is live. Row r's token t is drawn with row_keys(rng, r, t) whatever
slot or step runs it, so the output equals the static sampler's row for row.

Cache layout of a slot: its prompt at slots [0, len), generated token t at len + t, so a
row's valid keys are the prefix [0, len + t) and decode attention reads only that
(models.decode). Sharded: the slots and the rows are split over the data shards, and each
shard runs its own queue over its own prompts, so refills never cross shards.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax import models
from ebpo_jax.generation import (
    PAD_ID,
    Generation,
    _cache_batch_axes,
    _constrain,
    _constrain_cache,
    _on_cpu,
)
from ebpo_jax.sampling import row_keys, select_tokens


class SlotStats(NamedTuple):
    """Decode steps run and slot-steps that decoded a live row (utilisation = busy / all)."""

    steps: jax.Array  # int32
    busy: jax.Array  # int32, sum over steps of live slots
    slots: int


class _Slots(NamedTuple):
    """Per-shard slot state, [D, Sd] each (next_D: [D], the shard's next queued row)."""

    row_DS: jax.Array  # local row index the slot holds (stale once the row ends)
    live_DS: jax.Array  # the row still needs tokens
    t_DS: jax.Array  # index of the token the next step samples
    prev_DS: jax.Array  # token t - 1, fed in at the next step
    plen_DS: jax.Array  # the row's prompt length
    limit_DS: jax.Array  # the row's token limit
    next_D: jax.Array


def _take_rows(x_DR, idx_DS):
    """x_DR[d, idx_DS[d, s]], a gather batched over the shard axis (stays shard-local)."""
    return jax.vmap(lambda x, i: x[i])(x_DR, idx_DS)


def _copy_prompts(cache, prompt_cache, admit_DS, prompt_DS, shards):
    """Each admitted slot's cache slots [0, Tp) := its prompt's keys and values."""

    def layer(c_SKCd, p_PKTd):
        S, K, C, Dh = c_SKCd.shape
        Tp = p_PKTd.shape[2]
        c_DSKCd = c_SKCd.reshape(shards, S // shards, K, C, Dh)
        p_DPKTd = p_PKTd.reshape(shards, -1, K, Tp, Dh)
        src = _take_rows(p_DPKTd, prompt_DS)
        new = jnp.where(admit_DS[..., None, None, None], src, c_DSKCd[:, :, :, :Tp])
        return jax.lax.dynamic_update_slice(c_DSKCd, new, (0, 0, 0, 0, 0)).reshape(S, K, C, Dh)

    return jax.tree.map(layer, cache, prompt_cache)


def _admit(st, cache, prompt_cache, first_DR, plen_DR, limit_DR, eos_E, *, num_samples, shards):
    """Free slots take the shard's next queued rows (in row order); copies their prompts."""
    rows = first_DR.shape[1]
    free_DS = ~st.live_DS
    new_DS = st.next_D[:, None] + jnp.cumsum(free_DS, axis=1) - 1
    admit_DS = free_DS & (new_DS < rows)
    new_DS = jnp.where(admit_DS, new_DS, st.row_DS)
    first_DS = _take_rows(first_DR, new_DS)
    # A row whose first token already ends it is never live: its slot refills next step.
    limit_DS = _take_rows(limit_DR, new_DS)
    ends_DS = jnp.isin(first_DS, eos_E) | (limit_DS <= 1)
    st = _Slots(
        row_DS=new_DS,
        live_DS=st.live_DS | (admit_DS & ~ends_DS),
        t_DS=jnp.where(admit_DS, 1, st.t_DS),
        prev_DS=jnp.where(admit_DS, first_DS, st.prev_DS),
        plen_DS=jnp.where(admit_DS, _take_rows(plen_DR, new_DS), st.plen_DS),
        limit_DS=jnp.where(admit_DS, limit_DS, st.limit_DS),
        next_D=st.next_D + admit_DS.sum(axis=1),
    )
    # Only steps that admit a row pay for the copy.
    copy = lambda c: _copy_prompts(c, prompt_cache, admit_DS, new_DS // num_samples, shards)
    cache = jax.lax.cond(jnp.any(admit_DS), copy, lambda c: c, cache)
    return st, cache


def _step(
    params, layers, st, cache, out, rng, eos_E, *, config, sampling, axes, sharding, kv_block
):
    """One decode step of every slot; live rows record their token t."""
    tokens_DRN, logps_DRN, gen_len_DR = out
    D, Sd = st.row_DS.shape
    rows = tokens_DRN.shape[1]
    flat = lambda x: x.reshape(D * Sd)
    live_B = flat(st.live_DS)
    # Idle slots write slot 0 of their own (stale) cache and see only it: harmless, no NaN.
    slot_B = jnp.where(live_B, flat(st.plen_DS + st.t_DS) - 1, 0)
    logits_B1V, cache = models.forward_cached(
        config,
        params,
        flat(st.prev_DS)[:, None],
        slot_B[:, None],
        cache,
        start=slot_B,
        kv_len_B=slot_B + 1,
        layers=layers,
        kv_block=kv_block,
    )
    cache = _constrain_cache(cache, axes, sharding)
    global_row_B = flat(st.row_DS + rows * jnp.arange(D)[:, None])
    tok_B, logp_B = select_tokens(
        row_keys(rng, global_row_B, flat(st.t_DS)), logits_B1V[:, 0], **sampling._asdict()
    )
    tok_DS, logp_DS = tok_B.reshape(D, Sd), logp_B.reshape(D, Sd)
    # Rows that are not live write nowhere: index `rows` is out of bounds and dropped.
    row_DS = jnp.where(st.live_DS, st.row_DS, rows)
    put = jax.vmap(lambda x, r, t, v: x.at[r, t].set(v, mode="drop"))
    tokens_DRN = put(tokens_DRN, row_DS, st.t_DS, tok_DS)
    logps_DRN = put(logps_DRN, row_DS, st.t_DS, logp_DS)
    gen_len_DR = jax.vmap(lambda x, r, v: x.at[r].set(v, mode="drop"))(
        gen_len_DR, row_DS, st.t_DS + 1
    )
    ends_DS = jnp.isin(tok_DS, eos_E) | (st.t_DS + 1 >= st.limit_DS)
    st = st._replace(
        live_DS=st.live_DS & ~ends_DS,
        t_DS=st.t_DS + st.live_DS,
        prev_DS=jnp.where(st.live_DS, tok_DS, st.prev_DS),
    )
    return st, cache, (tokens_DRN, logps_DRN, gen_len_DR)


def decode(
    params,
    prompt_cache,
    first_R,
    first_logp_R,
    lengths_P,
    rng,
    eos_E,
    limit_R=None,
    *,
    config,
    num_samples,
    slots,
    shards,
    max_new_tokens,
    sampling,
    slot_sharding,
    kv_block=models.decode.BLOCK,
):
    """All rows through `slots` refilled decode slots: (Generation, SlotStats).

    limit_R: per-row token limits (<= max_new_tokens; benchmarks impose lengths with it).
    """
    P, Tp = lengths_P.shape[0], prompt_cache["k"][0].shape[2]
    R, N, D = P * num_samples, max_new_tokens, shards
    Sd, Rd = slots // D, R // D
    cache_size = Tp + N
    axes = _cache_batch_axes(config, cache_size)
    cache = _constrain_cache(models.init_cache(config, slots, cache_size), axes, slot_sharding)
    first_DR = first_R.reshape(D, Rd)
    plen_DR = jnp.repeat(lengths_P, num_samples).reshape(D, Rd)
    limit_DR = jnp.full((D, Rd), N, jnp.int32) if limit_R is None else limit_R.reshape(D, Rd)
    tokens_DRN = jnp.zeros((D, Rd, N), jnp.int32).at[:, :, 0].set(first_DR)
    logps_DRN = jnp.zeros((D, Rd, N), jnp.float32).at[:, :, 0].set(first_logp_R.reshape(D, Rd))
    out = (tokens_DRN, logps_DRN, jnp.ones((D, Rd), jnp.int32))
    out = jax.tree.map(lambda x: _constrain(x, slot_sharding), out)
    zeros = jnp.zeros((D, Sd), jnp.int32)
    st = _Slots(
        zeros, zeros.astype(bool), zeros, zeros, zeros + 1, zeros, jnp.zeros((D,), jnp.int32)
    )
    layers = models.split_layers(config, params) if _on_cpu(slot_sharding) else None
    admit = lambda st, cache: _admit(
        st, cache, prompt_cache, first_DR, plen_DR, limit_DR, eos_E,
        num_samples=num_samples, shards=D,
    )  # fmt: skip
    st, cache = admit(st, cache)

    def cond(carry):
        st = carry[0]
        return jnp.any(st.live_DS) | jnp.any(st.next_D < Rd)

    def body(carry):
        st, cache, out, steps, busy = carry
        busy = busy + st.live_DS.sum(dtype=jnp.int32)
        st, cache, out = _step(
            params, layers, st, cache, out, rng, eos_E,
            config=config, sampling=sampling, axes=axes, sharding=slot_sharding,
            kv_block=kv_block,
        )  # fmt: skip
        st, cache = admit(st, cache)
        return st, cache, out, steps + 1, busy

    carry = (st, cache, out, jnp.int32(0), jnp.int32(0))
    _, _, out, steps, busy = jax.lax.while_loop(cond, body, carry)
    tokens_DRN, logps_DRN, gen_len_DR = out
    gen = Generation(tokens_DRN.reshape(R, N), logps_DRN.reshape(R, N), gen_len_DR.reshape(R))
    return gen, SlotStats(steps, busy, slots)


def prefill(params, prompt_PT, lengths_P, rng, *, config, num_samples, sampling, prompt_sharding):
    """Prompt cache [P, K, Tp, Dh] per layer, and every row's token 0 and its log-prob."""
    Tp = prompt_PT.shape[1]
    mask_PT = jnp.arange(Tp)[None] < lengths_P[:, None]
    # Padding ids are arbitrary; an out-of-vocabulary one would put NaN in masked cache slots.
    prompt_PT = jnp.where(mask_PT, prompt_PT, PAD_ID)
    last_PV, cache = models.prefill(
        config, params, prompt_PT, mask=mask_PT, cache_size=Tp, logits_at=lengths_P - 1
    )
    cache = _constrain_cache(cache, _cache_batch_axes(config, Tp), prompt_sharding)
    last_RV = jnp.repeat(last_PV, num_samples, axis=0)
    rows_R = jnp.arange(last_RV.shape[0])
    first_R, first_logp_R = select_tokens(row_keys(rng, rows_R, 0), last_RV, **sampling._asdict())
    return cache, first_R, first_logp_R


prefill_jit = jax.jit(
    prefill, static_argnames=("config", "num_samples", "sampling", "prompt_sharding")
)
decode_jit = jax.jit(
    decode,
    static_argnames=(
        "config", "num_samples", "slots", "shards", "max_new_tokens", "sampling", "slot_sharding",
        "kv_block",
    ),
)  # fmt: skip
