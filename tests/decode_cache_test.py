"""forward_cached options: logits_at, a Python-int start, and its input checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import forward_cached

from ebpo_jax import models


@functools.lru_cache(maxsize=1)
def _setup():
    config = models.get_config("tiny_qwen3")
    params = models.init_params(config, jax.random.key(0))
    B, T, S = 2, 4, 7
    tokens = jax.random.randint(jax.random.key(1), (B, T), 1, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    kv_mask = jnp.arange(S)[None] < jnp.array([[4], [2]])
    return config, params, tokens, positions, kv_mask, models.init_cache(config, B, S)


def test_static_start_and_logits_at_match_traced_full_logits():
    config, params, tokens, positions, kv_mask, cache = _setup()
    traced = jax.jit(forward_cached, static_argnums=0)
    ref_logits, ref_cache = traced(
        config, params, tokens, positions, cache, start=0, kv_mask_BS=kv_mask
    )
    # A static start (a Python int inside the trace): attention reads only the 4 new slots.
    static = jax.jit(forward_cached, static_argnums=0, static_argnames=("start",))
    logits, cache_out = static(
        config, params, tokens, positions, cache, start=0, kv_mask_BS=kv_mask
    )
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    for name in ("k", "v"):
        np.testing.assert_allclose(cache_out[name], ref_cache[name], atol=1e-6)
        assert np.abs(np.asarray(cache_out[name])[:, :, :, 4:]).max() == 0
    at = jnp.array([3, 1])
    last, _ = static(
        config, params, tokens, positions, cache, start=0, kv_mask_BS=kv_mask, logits_at=at
    )
    assert last.shape == (2, config.vocab_size)
    np.testing.assert_allclose(last, ref_logits[jnp.arange(2), at], atol=1e-5)

    # A decode step at a static start reads only slots < start; same as a traced start.
    step_tok, step_pos = tokens[:, :1], jnp.array([[4], [2]])
    mask = kv_mask.at[:, 4].set(True)
    want, want_cache = traced(
        config, params, step_tok, step_pos, ref_cache, start=jnp.int32(4), kv_mask_BS=mask
    )
    got, got_cache = static(config, params, step_tok, step_pos, ref_cache, start=4, kv_mask_BS=mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got_cache["k"], want_cache["k"], atol=1e-6)


def test_static_start_out_of_range_and_bad_logits_at_are_clear_errors():
    config, params, tokens, positions, kv_mask, cache = _setup()
    with pytest.raises(ValueError, match="does not fit a cache of 7"):
        forward_cached(config, params, tokens, positions, cache, start=4, kv_mask_BS=kv_mask)
    with pytest.raises(ValueError, match="logits_at"):
        forward_cached(
            config,
            params,
            tokens,
            positions,
            cache,
            start=0,
            kv_mask_BS=kv_mask,
            logits_at=jnp.zeros((3,), jnp.int32),
        )


def test_cache_of_the_wrong_structure_is_a_clear_error():
    config, params, tokens, positions, kv_mask, cache = _setup()
    stacked = {name: jnp.stack(cache[name]) for name in ("k", "v")}
    with pytest.raises(ValueError, match="one array per layer"):
        forward_cached(config, params, tokens, positions, stacked, start=0, kv_mask_BS=kv_mask)
    short = {"k": cache["k"], "v": cache["v"][:-1]}
    with pytest.raises(ValueError, match=r"cache\['v'\] must hold one array per layer"):
        forward_cached(config, params, tokens, positions, short, start=0, kv_mask_BS=kv_mask)
    wide = {"k": cache["k"], "v": (*cache["v"][:-1], jnp.zeros((2, 1, 7, 1)))}
    with pytest.raises(ValueError, match=r"cache\['v'\]\[1\] has shape"):
        forward_cached(config, params, tokens, positions, wide, start=0, kv_mask_BS=kv_mask)


def test_prefill_equals_forward_cached_from_an_empty_cache():
    """The sampler's layer-scan prefill: same logits at logits_at and the same cache."""
    config, params, tokens, positions, kv_mask, cache = _setup()
    at = jnp.array([3, 1])
    ref_last, ref_cache = forward_cached(
        config, params, tokens, positions, cache, start=0, kv_mask_BS=kv_mask, logits_at=at
    )
    T, S = tokens.shape[1], kv_mask.shape[1]
    last, cache_out = jax.jit(models.prefill, static_argnums=0, static_argnames="cache_size")(
        config, params, tokens, mask=kv_mask[:, :T], cache_size=S, logits_at=at
    )
    np.testing.assert_allclose(last, ref_last, atol=1e-5)
    assert jax.tree.structure(cache_out) == jax.tree.structure(ref_cache)
    valid = np.asarray(kv_mask)[:, None, :, None]  # slots holding a real prompt token
    for got, want in zip(jax.tree.leaves(cache_out), jax.tree.leaves(ref_cache)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), atol=1e-5)
        assert np.abs(np.asarray(got)[:, :, T:]).max() == 0
    with pytest.raises(ValueError, match="4 prompt tokens do not fit a cache of 3 slots"):
        models.prefill(config, params, tokens, mask=kv_mask[:, :T], cache_size=3, logits_at=at)


@functools.lru_cache(maxsize=1)
def _decode_setup():
    """A float32 cache of 23 slots (not a multiple of the block), ragged valid prefixes."""
    config = models.get_config("tiny_qwen3")
    params = models.init_params(config, jax.random.key(2))
    B, S = 3, 23
    keys = jax.random.split(jax.random.key(3), 2)
    shape = (B, config.num_kv_heads, S, config.head_dim)
    cache = {
        "k": tuple(jax.random.normal(keys[0], shape) for _ in range(config.num_layers)),
        "v": tuple(jax.random.normal(keys[1], shape) for _ in range(config.num_layers)),
    }
    tokens = jax.random.randint(jax.random.key(4), (B, 1), 1, config.vocab_size)
    return config, params, cache, tokens


FORWARD_CACHED = jax.jit(forward_cached, static_argnums=0, static_argnames="kv_block")


def test_blocked_decode_equals_full_cache_decode():
    """Per-row starts read in blocks of 4 == the whole-cache softmax (kv_block >= S) to 1e-5."""
    config, params, cache, tokens = _decode_setup()
    start = jnp.array([13, 2, 6], jnp.int32)  # row b writes slot start[b], sees [0, start[b]]
    positions = start[:, None] + 5
    full, full_cache = FORWARD_CACHED(
        config, params, tokens, positions, cache, start=start, kv_len_B=start + 1, kv_block=64
    )
    kv_mask = jnp.arange(23)[None] <= start[:, None]
    for kv in ({"kv_len_B": start + 1}, {"kv_mask_BS": kv_mask}):
        got, got_cache = FORWARD_CACHED(
            config, params, tokens, positions, cache, start=start, kv_block=4, **kv
        )
        np.testing.assert_allclose(got, full, rtol=0, atol=1e-5)
        np.testing.assert_allclose(got_cache["k"][1], full_cache["k"][1], rtol=0, atol=1e-5)
    # The new keys went to each row's own slot.
    k_new = np.asarray(full_cache["k"][0])
    for b, s in enumerate(np.asarray(start)):
        assert not np.array_equal(k_new[b, :, s], np.asarray(cache["k"][0])[b, :, s])
        np.testing.assert_array_equal(np.delete(k_new[b], s, 1), np.delete(cache["k"][0][b], s, 1))


def test_blocked_decode_reads_only_blocks_below_the_longest_prefix():
    """NaN in slots from block 4 on (>= 16) changes nothing when every row ends below 16."""
    config, params, cache, tokens = _decode_setup()
    start = jnp.array([13, 2, 6], jnp.int32)
    positions = start[:, None]
    want, _ = FORWARD_CACHED(
        config, params, tokens, positions, cache, start=start, kv_len_B=start + 1, kv_block=4
    )
    poison = lambda x: x.at[:, :, 16:].set(jnp.nan)
    poisoned = jax.tree.map(poison, cache)
    got, _ = FORWARD_CACHED(
        config, params, tokens, positions, poisoned, start=start, kv_len_B=start + 1, kv_block=4
    )
    np.testing.assert_array_equal(got, want)
    full, _ = FORWARD_CACHED(
        config, params, tokens, positions, poisoned, start=start, kv_len_B=start + 1, kv_block=64
    )
    assert np.isnan(np.asarray(full)).all()  # the whole-cache read does see them
