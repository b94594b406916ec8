"""Batched autoregressive sampling: one jitted prefill, a while_loop decode over a KV cache.

Padding convention of the returned `Generation` (rows = prompts x samples, prompt-major):
  tokens[r, :lengths[r]] are the generated tokens (the last one is the EOS token if the
  row stopped on one); tokens[r, lengths[r]:] == 0 (pad id 0).
  logprobs[r, t] is log p(tokens[r, t] | prompt, tokens[r, :t]) under the policy at
  temperature 1 over the full vocabulary, whatever temperature/top-k/top-p sampled it;
  0 at padding.
  Mask of real tokens: jnp.arange(N) < lengths[:, None].
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models, sharding
from ebpo_jax.generation import (
    PAD_ID,
    Generation,
    _cache_batch_axes,
    _constrain,
    _constrain_cache,
    _on_cpu,
)
from ebpo_jax.sampling import row_keys, select_tokens, validate_sampling


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _validate(config, prompt_tokens, prompt_lengths, max_new_tokens, num_samples, cache_size):
    """Checks shapes and (when concrete) values; returns the cache length."""
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("num_samples", num_samples, 1)
    if jnp.ndim(prompt_tokens) != 2:
        raise ValueError(f"prompt_tokens must be [B, Tp], got shape {jnp.shape(prompt_tokens)}")
    batch, prompt_len = jnp.shape(prompt_tokens)
    if jnp.shape(prompt_lengths) != (batch,):
        raise ValueError(
            f"prompt_lengths must have shape ({batch},) to match prompt_tokens "
            f"{jnp.shape(prompt_tokens)}, got {jnp.shape(prompt_lengths)}"
        )
    for name, x in (("prompt_tokens", prompt_tokens), ("prompt_lengths", prompt_lengths)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"{name} must be integer, got {jnp.result_type(x)}")
    needed = prompt_len + max_new_tokens
    if cache_size is None:
        cache_size = needed
    _check_int("cache_size", cache_size, 1)
    if needed > cache_size:
        raise ValueError(
            f"prompt_tokens width {prompt_len} + max_new_tokens {max_new_tokens} = {needed} "
            f"exceeds cache_size {cache_size}"
        )
    if isinstance(prompt_lengths, jax.core.Tracer) or isinstance(prompt_tokens, jax.core.Tracer):
        return cache_size
    lengths = np.asarray(prompt_lengths)
    if lengths.size and (lengths.min() < 1 or lengths.max() > prompt_len):
        raise ValueError(
            f"prompt_lengths must lie in [1, {prompt_len}] (the prompt_tokens width), "
            f"got min {lengths.min()} max {lengths.max()}"
        )
    if lengths.size and lengths.max() + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"longest prompt {lengths.max()} + max_new_tokens {max_new_tokens} exceeds "
            f"config.max_position_embeddings {config.max_position_embeddings}"
        )
    tokens = np.asarray(prompt_tokens)
    real = np.arange(prompt_len)[None] < lengths[:, None]
    if np.any(real & ((tokens < 0) | (tokens >= config.vocab_size))):
        raise ValueError(f"prompt_tokens hold ids outside the vocabulary [0, {config.vocab_size})")
    return cache_size


def _prefill(
    params,
    prompt_PT,
    lengths_P,
    rng,
    *,
    config,
    num_samples,
    cache_size,
    sampling,
    prompt_sharding,
    row_sharding,
    record_routing=False,
):
    """Prefills each prompt once, shares its cache over its samples, samples token 0.

    record_routing: a sixth output, the prompts' experts per row [rows, sparse layers, Tp, k].
    """
    prompt_len = prompt_PT.shape[1]
    axes = _cache_batch_axes(config, cache_size)
    kv_mask_PS = jnp.arange(cache_size)[None] < lengths_P[:, None]
    # Padding ids are arbitrary; an out-of-vocabulary one would put NaN in masked cache slots.
    prompt_PT = jnp.where(kv_mask_PS[:, :prompt_len], prompt_PT, PAD_ID)
    # Logits at each prompt's last token only: [P, Tp, V] float32 would not fit at scale.
    last_PV, cache, *route = models.prefill(
        config,
        params,
        prompt_PT,
        mask=kv_mask_PS[:, :prompt_len],
        cache_size=cache_size,
        logits_at=lengths_P - 1,
        with_router=record_routing,
    )
    cache = _constrain_cache(cache, axes, prompt_sharding)

    # Samples of a prompt reuse its prefilled cache rows: no repeated prefill compute.
    def share(x, a):
        return jnp.repeat(x, num_samples, axis=a)

    cache = _constrain_cache(jax.tree.map(share, cache, axes), axes, row_sharding)
    kv_mask_BS = _constrain(share(kv_mask_PS, 0), row_sharding)
    lengths_B = _constrain(share(lengths_P, 0), row_sharding)
    last_BV = _constrain(share(last_PV, 0), row_sharding)
    rows_B = jnp.arange(last_BV.shape[0])
    token_B, logp_B = select_tokens(row_keys(rng, rows_B, 0), last_BV, **sampling._asdict())
    out = cache, kv_mask_BS, lengths_B, token_B, logp_B
    if record_routing:
        out += (share(route[0]["experts"].transpose(1, 0, 2, 3), 0),)
    return out


def _decode(
    params,
    cache,
    kv_mask_BS,
    lengths_B,
    token_B,
    logp_B,
    rng,
    eos_E,
    limit_B=None,
    *,
    config,
    prompt_len,
    max_new_tokens,
    sampling,
    batch_sharding,
    kv_block=models.decode.BLOCK,
    record_routing=False,
):
    """Decodes tokens 1..N-1; token t goes to cache slot prompt_len + t at position len + t.

    limit_B: per-row token limits (<= N; benchmarks impose long-tailed lengths with it).
    record_routing: the Generation comes as (Generation, routes [rows, sparse layers, N, k]),
    the experts each fed-back token went to (a row's last token, never fed back, stays 0).
    """
    batch = token_B.shape[0]
    rows_B = jnp.arange(batch)
    tokens_BN = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token_B)
    logps_BN = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(logp_B)
    limit_B = jnp.full((batch,), max_new_tokens, jnp.int32) if limit_B is None else limit_B
    done_B = jnp.isin(token_B, eos_E) | (limit_B <= 1)
    gen_len_B = jnp.ones((batch,), jnp.int32)
    axes = _cache_batch_axes(config, kv_mask_BS.shape[1])
    layers = models.split_layers(config, params) if _on_cpu(batch_sharding) else None
    routes_BLNk = None
    if record_routing:
        k = config.num_experts_per_tok
        dtype = models.moe.expert_dtype(config.num_experts)
        routes_BLNk = jnp.zeros((batch, config.num_sparse_layers, max_new_tokens, k), dtype)

    def cond(carry):
        t, done_B = carry[0], carry[4]
        return (t < max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        t, cache, kv_mask_BS, prev_B, done_B, tokens_BN, logps_BN, gen_len_B, routes = carry
        slot = prompt_len + t - 1
        kv_mask_BS = jax.lax.dynamic_update_slice(
            kv_mask_BS, jnp.ones((batch, 1), bool), (jnp.int32(0), slot)
        )
        logits_B1V, cache, *route = models.forward_cached(
            config,
            params,
            prev_B[:, None],
            (lengths_B + t - 1)[:, None],
            cache,
            start=slot,
            kv_mask_BS=kv_mask_BS,
            layers=layers,
            kv_block=kv_block,
            with_router=record_routing,
        )
        if record_routing:  # completion token t-1 was this step's input
            new_BL1k = route[0]["experts"].transpose(1, 0, 2, 3)
            routes = jax.lax.dynamic_update_slice(routes, new_BL1k, (0, 0, t - 1, 0))
        cache = _constrain_cache(cache, axes, batch_sharding)
        tok_B, logp_B = select_tokens(
            row_keys(rng, rows_B, t), logits_B1V[:, 0], **sampling._asdict()
        )
        tok_B = jnp.where(done_B, PAD_ID, tok_B)
        logp_B = jnp.where(done_B, 0.0, logp_B)
        tokens_BN = jax.lax.dynamic_update_slice(tokens_BN, tok_B[:, None], (jnp.int32(0), t))
        logps_BN = jax.lax.dynamic_update_slice(logps_BN, logp_B[:, None], (jnp.int32(0), t))
        gen_len_B = gen_len_B + (~done_B).astype(jnp.int32)
        done_B = done_B | jnp.isin(tok_B, eos_E) | (t + 1 >= limit_B)
        return t + 1, cache, kv_mask_BS, tok_B, done_B, tokens_BN, logps_BN, gen_len_B, routes

    carry = (jnp.int32(1), cache, kv_mask_BS, token_B, done_B, tokens_BN, logps_BN, gen_len_B)
    carry = (*carry, routes_BLNk)
    steps, cache, *_, tokens_BN, logps_BN, gen_len_B, routes_BLNk = jax.lax.while_loop(
        cond, body, carry
    )
    # The cache is returned only so that its donated buffer is updated in place.
    generation = Generation(tokens_BN, logps_BN, gen_len_B)
    if record_routing:
        return (generation, routes_BLNk), cache, steps
    return generation, cache, steps


_prefill_jit = jax.jit(
    _prefill,
    static_argnames=(
        "config",
        "num_samples",
        "cache_size",
        "sampling",
        "prompt_sharding",
        "row_sharding",
        "record_routing",
    ),
)
# Donating the cache lets the decode loop update the prefill's buffer in place: without
# it the cache would live twice, which is what runs out of memory at scale.
_decode_jit = jax.jit(
    _decode,
    static_argnames=(
        "config",
        "prompt_len",
        "max_new_tokens",
        "sampling",
        "batch_sharding",
        "kv_block",
        "record_routing",
    ),
    donate_argnums=(1,),
)


class _Sampling(NamedTuple):
    """Hashable sampling options, passed to jit as one static argument."""

    temperature: float
    top_k: int
    top_p: float


def _data_axes(mesh, data_axes, rules=None):
    """`data_axes`, or by default the rules table's `batch` axes that the mesh has."""
    if data_axes is None:
        entry = sharding.logical_to_spec(("batch",), rules, mesh)[0]
        return (entry,) if isinstance(entry, str) else tuple(entry or ())
    return tuple(data_axes)


def _data_size(mesh, data_axes, rules=None):
    return int(np.prod([mesh.shape[a] for a in _data_axes(mesh, data_axes, rules)]))


def _batch_sharding(mesh, data_axes, num_rows, required, rules=None):
    """Rows over the data axes (`_data_axes`); None when unsharded (or not divisible and
    optional)."""
    if mesh is None:
        return None
    data_axes = _data_axes(mesh, data_axes, rules)
    size = _data_size(mesh, data_axes)
    if num_rows % size == 0:
        return NamedSharding(mesh, P(tuple(data_axes)))
    if required:
        raise ValueError(
            f"{num_rows} rows (prompts x num_samples) cannot be split over data axes "
            f"{data_axes} of size {size}"
        )
    return None


def generate(
    config,
    params,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens,
    rng,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    eos_id=None,
    num_samples=1,
    cache_size=None,
    mesh=None,
    data_axes=None,
    slots=0,
    kv_block=models.decode.BLOCK,
    record_routing=False,
):
    """Samples `num_samples` completions per right-padded prompt; returns a `Generation`.

    prompt_tokens [B, Tp] int, prompt_tokens[b, :prompt_lengths[b]] is prompt b. Rows of the
    output are prompt-major: prompt b's samples are rows b*num_samples .. (b+1)*num_samples-1.
    Row r's randomness is fold_in(rng, r), so results do not depend on the batch around it.
    temperature=0 is greedy. eos_id: None, an id or a list of ids. cache_size defaults to
    Tp + max_new_tokens. With `mesh`, rows are sharded over `data_axes` (default: the
    mesh's 'data' and 'fsdp' axes); params keep whatever sharding they have.
    slots=0 decodes all rows as one static batch until the last one ends; 0 < slots < rows
    decodes that many rows at a time and refills a slot as soon as its row ends (continuous
    batching, ebpo_jax.slots; same output row for row); slots >= rows is the static batch.
    kv_block: cache slots per block of the decode attention, which reads only the blocks
    below the longest valid prefix. record_routing (mixture of experts, static batch):
    returns (Generation, routing) with routing = {"prompt": [rows, sparse layers, Tp, k],
    "comp": [rows, sparse layers, N, k]}, every input token's experts as compact ints (for
    routing replay; a row's last token, never fed back, has zeros).
    """
    return _generate_with_stats(
        config,
        params,
        prompt_tokens,
        prompt_lengths,
        max_new_tokens=max_new_tokens,
        rng=rng,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_id=eos_id,
        num_samples=num_samples,
        cache_size=cache_size,
        mesh=mesh,
        data_axes=data_axes,
        slots=slots,
        kv_block=kv_block,
        record_routing=record_routing,
    )[0]


def _check_slots(slots, num_prompts, num_rows, shards, cache_size):
    """(slots, data shards) for continuous batching, or None for the static batch."""
    _check_int("slots", slots, 0)
    # With a slot per row nothing is ever refilled: the static batch is the same schedule.
    if slots == 0 or slots >= num_rows:
        return None
    if cache_size is not None:
        raise ValueError(
            f"slots={slots} (continuous batching) sizes its own cache; got cache_size={cache_size}"
        )
    if slots % shards or num_prompts % shards:
        raise ValueError(
            f"slots={slots} and the {num_prompts} prompts must be multiples of the {shards} "
            "data shards (each shard refills its slots from its own prompts)"
        )
    return slots, shards


def _generate_with_stats(
    config,
    params,
    prompt_tokens,
    prompt_lengths,
    *,
    max_new_tokens,
    rng,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    eos_id=None,
    num_samples=1,
    cache_size=None,
    mesh=None,
    data_axes=None,
    slots=0,
    kv_block=models.decode.BLOCK,
    row_limits=None,
    record_routing=False,
):
    """generate, plus the decode steps run (static) or the slots' SlotStats (continuous).

    row_limits: [rows] int, a token limit per row (<= max_new_tokens), as if each row's
    stop id came at that length: how benchmarks impose a length distribution.
    """
    requested = cache_size
    cache_size = _validate(
        config, prompt_tokens, prompt_lengths, max_new_tokens, num_samples, cache_size
    )
    _check_int("kv_block", kv_block, 1)
    eos = validate_sampling(temperature, top_p, top_k, eos_id, config.vocab_size)
    sampling = _Sampling(float(temperature), int(top_k), float(top_p))
    num_prompts, prompt_len = jnp.shape(prompt_tokens)
    prompt_PT = jnp.asarray(prompt_tokens, jnp.int32)
    lengths_P = jnp.asarray(prompt_lengths, jnp.int32)
    eos_E = jnp.asarray(eos, jnp.int32).reshape(-1)
    num_rows = num_prompts * num_samples
    if row_limits is not None and jnp.shape(row_limits) != (num_rows,):
        raise ValueError(f"row_limits must have shape ({num_rows},), got {jnp.shape(row_limits)}")
    limit_R = None if row_limits is None else jnp.asarray(row_limits, jnp.int32)
    rules = config.sharding_rules
    row_sharding = _batch_sharding(mesh, data_axes, num_rows, True, rules)
    # Fewer prompts than data shards is fine: the prefill then runs unconstrained.
    prompt_sharding = _batch_sharding(mesh, data_axes, num_prompts, False, rules)
    if mesh is not None:
        data_axes = _data_axes(mesh, data_axes, rules)
    shards = 1 if row_sharding is None else _data_size(mesh, data_axes)
    slot_plan = _check_slots(slots, num_prompts, num_rows, shards, requested)
    if record_routing and not config.is_moe:
        raise ValueError("record_routing needs a mixture-of-experts config (num_experts > 0)")
    if record_routing and slot_plan is not None:
        raise ValueError("record_routing is not wired into continuous batching: use slots=0")
    if slot_plan is not None:
        return _generate_slots(
            config, params, prompt_PT, lengths_P, rng, eos_E, limit_R, slot_plan,
            num_samples=num_samples, max_new_tokens=max_new_tokens, sampling=sampling,
            mesh=mesh, data_axes=data_axes, prompt_sharding=prompt_sharding, kv_block=kv_block,
        )  # fmt: skip
    cache, kv_mask_BS, lengths_B, token_B, logp_B, *prompt_routes = _prefill_jit(
        params,
        prompt_PT,
        lengths_P,
        rng,
        config=config,
        num_samples=num_samples,
        cache_size=cache_size,
        sampling=sampling,
        prompt_sharding=prompt_sharding,
        row_sharding=row_sharding,
        record_routing=record_routing,
    )
    generation, _, steps = _decode_jit(
        params,
        cache,
        kv_mask_BS,
        lengths_B,
        token_B,
        logp_B,
        rng,
        eos_E,
        limit_R,
        config=config,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        batch_sharding=row_sharding,
        kv_block=kv_block,
        record_routing=record_routing,
    )
    if record_routing:
        generation, comp_routes = generation
        generation = (generation, {"prompt": prompt_routes[0], "comp": comp_routes})
    return generation, steps


def _generate_slots(
    config, params, prompt_PT, lengths_P, rng, eos_E, limit_R, slot_plan, *,
    num_samples, max_new_tokens, sampling, mesh, data_axes, prompt_sharding, kv_block,
):  # fmt: skip
    """The continuous-batching path of generate (ebpo_jax.slots)."""
    from ebpo_jax import slots as slots_lib  # late: only continuous batching needs it

    num_slots, shards = slot_plan
    cache, first_R, first_logp_R = slots_lib.prefill_jit(
        params, prompt_PT, lengths_P, rng,
        config=config, num_samples=num_samples, sampling=sampling,
        prompt_sharding=prompt_sharding,
    )  # fmt: skip
    return slots_lib.decode_jit(
        params, cache, first_R, first_logp_R, lengths_P, rng, eos_E, limit_R,
        config=config, num_samples=num_samples, slots=num_slots, shards=shards,
        max_new_tokens=max_new_tokens, sampling=sampling,
        slot_sharding=_batch_sharding(mesh, data_axes, num_slots, True), kv_block=kv_block,
    )  # fmt: skip
