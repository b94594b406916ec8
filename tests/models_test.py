"""Decoder core: shapes, masking semantics, and KV-cache path == full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import forward_cached

from ebpo_jax import models

CONFIGS = ["tiny", "tiny_qwen3"]
FORWARD = jax.jit(models.forward, static_argnums=0, static_argnames=("return_hidden",))
FORWARD_CACHED = jax.jit(forward_cached, static_argnums=0)
_PARAMS = {}


def _params(config):
    if config not in _PARAMS:
        _PARAMS[config] = models.init_params(config, jax.random.key(0))
    return _PARAMS[config]


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_shapes_and_hidden(name):
    config = models.get_config(name)
    params = _params(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
    logits = FORWARD(config, params, tokens)
    assert logits.shape == (2, 7, config.vocab_size) and logits.dtype == jnp.float32
    hidden = FORWARD(config, params, tokens, return_hidden=True)
    assert hidden.shape == (2, 7, config.hidden_size)
    head = models.output_embedding(config, params)
    np.testing.assert_allclose(hidden @ head, logits, atol=1e-5)


def test_causal_future_tokens_do_not_matter():
    config = models.get_config("tiny")
    params = _params(config)
    a = jnp.array([[1, 2, 3, 4, 5, 6]])
    b = a.at[0, 4:].set(jnp.array([9, 9]))
    la, lb = FORWARD(config, params, a), FORWARD(config, params, b)
    np.testing.assert_allclose(la[:, :4], lb[:, :4], atol=1e-6)
    assert not np.allclose(la[:, 4:], lb[:, 4:], atol=1e-3)


@pytest.mark.parametrize("name", CONFIGS)
def test_left_padding_with_positions_matches_unpadded(name):
    config = models.get_config(name)
    params = _params(config)
    seq = jax.random.randint(jax.random.key(2), (1, 5), 1, config.vocab_size)
    ref = FORWARD(config, params, seq)
    padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), seq], axis=1)
    mask = padded != 0
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = FORWARD(config, params, padded, positions=positions, mask=mask)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out[:, 3:], ref, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_cache_prefill_then_decode_matches_forward(name):
    """Right-padded prompts of different lengths, then N shared-slot decode steps."""
    config = models.get_config(name)
    params = _params(config)
    lengths = np.array([5, 3, 1])
    B, Tp, N, S = 3, 5, 4, 12
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (B, Tp)) * (np.arange(Tp) < lengths[:, None])
    new = rng.integers(1, config.vocab_size, (B, N))

    cache = models.init_cache(config, B, S)
    kv_mask = np.zeros((B, S), bool)
    kv_mask[:, :Tp] = np.arange(Tp) < lengths[:, None]
    positions = np.broadcast_to(np.arange(Tp), (B, Tp))
    prefill_logits, cache = FORWARD_CACHED(
        config,
        params,
        jnp.asarray(prompts),
        jnp.asarray(positions),
        cache,
        start=0,
        kv_mask_BS=jnp.asarray(kv_mask),
    )
    decode_logits = []
    for n in range(N):
        kv_mask[:, Tp + n] = True
        pos = jnp.asarray(lengths[:, None] + n)
        logits, cache = FORWARD_CACHED(
            config,
            params,
            jnp.asarray(new[:, n : n + 1]),
            pos,
            cache,
            start=jnp.int32(Tp + n),
            kv_mask_BS=jnp.asarray(kv_mask),
        )
        decode_logits.append(logits[:, 0])
    decode_logits = np.stack(decode_logits, axis=1)

    # Reference: each row's real tokens packed left, one right-padded batch.
    packed = np.zeros((B, Tp + N), np.int64)
    for b in range(B):
        packed[b, : lengths[b] + N] = np.concatenate([prompts[b, : lengths[b]], new[b]])
    refs = np.asarray(FORWARD(config, params, jnp.asarray(packed), mask=jnp.asarray(packed != 0)))
    for b in range(B):
        ref, L = refs[b], lengths[b]
        np.testing.assert_allclose(prefill_logits[b, :L], ref[:L], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(decode_logits[b], ref[L : L + N], atol=1e-5, rtol=1e-5)

    # forward on the same gapped slot layout, with mask and positions, agrees too.
    full = np.concatenate([prompts, new], axis=1)
    full_pos = np.concatenate([positions, lengths[:, None] + np.arange(N)], axis=1)
    out = FORWARD(
        config,
        params,
        jnp.asarray(full),
        positions=jnp.asarray(full_pos),
        mask=jnp.asarray(kv_mask[:, : Tp + N]),
    )
    np.testing.assert_allclose(out[:, Tp:], decode_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_grouped_forward_equals_packed_rows_with_gradients(name):
    """Prompt once per group == each completion packed after its own copy of the prompt."""
    config = models.get_config(name, num_layers=2)
    params = models.init_params(config, jax.random.key(6))
    P, G, Tp, N = 3, 2, 6, 5
    rng = np.random.default_rng(0)
    prompt_PT = jnp.asarray(rng.integers(1, config.vocab_size, (P, Tp)), jnp.int32)
    plen_P = jnp.array([6, 2, 4])
    comp_BN = jnp.asarray(rng.integers(1, config.vocab_size, (P * G, N)), jnp.int32)
    clen_B = jnp.array([5, 3, 1, 5, 4, 2])
    plen_B = np.repeat(np.asarray(plen_P), G)
    # The packed rows: prompt[:len] + completion, right-padded to Tp + N.
    packed = np.zeros((P * G, Tp + N), np.int32)
    for b in range(P * G):
        row = np.concatenate([prompt_PT[b // G, : plen_B[b]], comp_BN[b]])
        packed[b, : len(row)] = row
    mask = np.arange(Tp + N)[None] < (plen_B + np.asarray(clen_B))[:, None]
    w_BN = jnp.asarray(rng.normal(size=(P * G, N, config.vocab_size)), jnp.float32)

    def grouped(params):
        out_P, out_B = models.forward_grouped(
            config, params, models.GroupedRows(prompt_PT, plen_P, comp_BN, clen_B)
        )
        valid = jnp.arange(N)[None] < clen_B[:, None]
        return jnp.sum(jnp.where(valid[..., None], out_B * w_BN, 0.0)), (out_P, out_B)

    def packed_loss(params):
        out = models.forward(config, params, jnp.asarray(packed), mask=jnp.asarray(mask))
        idx_BN = jnp.minimum(jnp.asarray(plen_B)[:, None] + jnp.arange(N)[None], Tp + N - 1)
        out_B = jnp.take_along_axis(out, idx_BN[..., None], axis=1)
        valid = jnp.arange(N)[None] < clen_B[:, None]
        return jnp.sum(jnp.where(valid[..., None], out_B * w_BN, 0.0)), out

    (loss, (out_P, out_B)), grads = jax.jit(jax.value_and_grad(grouped, has_aux=True))(params)
    (ref_loss, ref), ref_grads = jax.jit(jax.value_and_grad(packed_loss, has_aux=True))(params)
    for b in range(P * G):
        L, n = plen_B[b], int(clen_B[b])
        np.testing.assert_allclose(out_P[b // G, :L], ref[b, :L], atol=1e-5)
        np.testing.assert_allclose(out_B[b, :n], ref[b, L : L + n], atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), grads, ref_grads
    )
    with pytest.raises(ValueError, match="not a multiple of the 3 prompts"):
        models.forward_grouped(config, params, models.GroupedRows(prompt_PT, plen_P, comp_BN[:5]))
    with pytest.raises(ValueError, match="comp_len_B"):
        rows = models.GroupedRows(prompt_PT, plen_P, comp_BN, clen_B[:3])
        models.forward_grouped(config, params, rows)


def test_get_config_errors():
    with pytest.raises(ValueError, match="unknown model preset"):
        models.get_config("gpt5")
    with pytest.raises(ValueError, match="hiden_size"):
        models.get_config("tiny", hiden_size=3)
    with pytest.raises(ValueError, match="remat"):
        models.get_config("tiny", remat="sometimes")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="scan_unroll"):
            models.get_config("tiny", scan_unroll=bad)
    config = models.get_config("llama3_1_8b")
    assert hash(config) == hash(models.get_config("llama3_1_8b"))
    assert config.rope_scaling_dict["rope_type"] == "llama3"


def test_bad_shapes_are_clear_errors():
    config = models.get_config("tiny")
    params = _params(config)
    with pytest.raises(ValueError, match="tokens_BT"):
        models.forward(config, params, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="mask"):
        models.forward(config, params, jnp.zeros((2, 3), jnp.int32), mask=jnp.ones((2, 4), bool))


# Non-embedding parameter counts from the model cards (Llama 3 8B: 8.03B in all).
@pytest.mark.parametrize(
    "name, total, non_embedding",
    [
        ("llama3_8b", 8_030_261_248, None),
        ("llama3_1_8b", 8_030_261_248, None),
        ("qwen3_0_6b", None, 0.44e9),
        ("qwen3_1_7b", None, 1.4e9),
        ("qwen3_8b", None, 6.95e9),
        ("qwen3_14b", None, 13.2e9),
    ],
)
def test_preset_sizes(name, total, non_embedding):
    config = models.get_config(name)
    count = sum(x.size for x in jax.tree.leaves(models.abstract_params(config)))
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    if total is not None:
        assert count == total
    if non_embedding is not None:
        assert abs((count - embeddings) / non_embedding - 1) < 0.01


def _compile_seconds(config, seq_len):
    import time

    params = models.abstract_params(config)
    tokens = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
    start = time.perf_counter()
    jax.jit(functools.partial(models.forward, config)).lower(params, tokens).compile()
    return time.perf_counter() - start


def test_compile_time_does_not_grow_with_depth():
    shallow, deep = models.get_config("tiny"), models.get_config("tiny", num_layers=16)
    # Interleaved and best-of-two, because other processes share the CPUs.
    times = {2: [], 16: []}
    for seq_len in (32, 33):
        times[2].append(_compile_seconds(shallow, seq_len))
        times[16].append(_compile_seconds(deep, seq_len))
    ratio = min(times[16]) / min(times[2])
    print(f"compile (forward): 2 layers {min(times[2]):.2f}s, 16 layers {min(times[16]):.2f}s")
    assert ratio < 2.0, times


def test_remat_policies_are_applied_and_keep_gradients():
    config = models.get_config("tiny")
    params = _params(config)
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, config.vocab_size)
    for remat in ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        fwd = functools.partial(models.forward, config.replace(remat=remat))
        jaxpr = str(jax.make_jaxpr(fwd)(params, tokens))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat != "none"), remat

    def grads(config):
        loss = lambda p: jnp.mean(models.forward(config, p, tokens) ** 2)
        return jax.jit(jax.grad(loss))(params)

    # The real presets' policy; the others differ only in the policy function passed.
    remat_config = config.replace(remat="dots_with_no_batch_dims_saveable")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5),
        grads(remat_config),
        grads(config),
    )


def test_scan_unroll_keeps_forward_and_gradients():
    config = models.get_config("tiny", num_layers=3)
    params = _params(config)
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, config.vocab_size)

    def value_and_grads(config):
        loss = lambda p: jnp.mean(models.forward(config, p, tokens) ** 2)
        return jax.jit(jax.value_and_grad(loss))(params)

    rolled = value_and_grads(config)
    for unroll in (2, 3, 8):  # 2 leaves a remainder layer; 8 > num_layers unrolls fully
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5),
            value_and_grads(config.replace(scan_unroll=unroll)),
            rolled,
        )
    fwd = functools.partial(models.forward, config.replace(scan_unroll=8))
    assert "unroll=3" in str(jax.make_jaxpr(fwd)(params, tokens))  # clamped to num_layers


def test_bfloat16_params_and_compute():
    config = models.get_config("tiny")
    bf16 = config.replace(param_dtype="bfloat16", dtype="bfloat16")
    params = _params(config)
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, config.vocab_size)
    params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits = FORWARD(bf16, params_bf16, tokens)
    assert logits.dtype == jnp.float32
    ref = FORWARD(config, params, tokens)
    np.testing.assert_allclose(logits, ref, atol=0.05 * float(jnp.abs(ref).max()))


def test_splash_attention_matches_xla_on_real_tokens():
    """The Pallas kernel (interpreted on CPU): same logits and gradients where mask is True."""
    config = models.get_config("tiny")
    params = _params(config)
    # The kernel's blocks are multiples of 128 tokens.
    tokens = jax.random.randint(jax.random.key(5), (2, 128), 0, config.vocab_size)
    mask = jnp.arange(128)[None] < jnp.array([[128], [77]])

    def loss_and_logits(config, params):
        logits = models.forward(config, params, tokens, mask=mask)
        return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits

    results = {}
    for name in ("xla", "splash"):
        fn = jax.jit(jax.value_and_grad(loss_and_logits, argnums=1, has_aux=True), static_argnums=0)
        results[name] = fn(config.replace(attention=name), params)
    (_, ref_logits), ref_grads = results["xla"]
    (_, logits), grads = results["splash"]
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), grads, ref_grads
    )
