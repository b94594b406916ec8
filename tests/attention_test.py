"""The attention dispatch: "auto" resolution, and the cuDNN path's calls checked on CPU.

cuDNN itself needs a GPU. Its code path (lengths, causal flag, gathers, casts) runs here with
`jax.nn.dot_product_attention(implementation="xla")`, which implements the same masks; the
lowering to `__cudnn$fmha` is checked in aot_gpu_test.py where the CUDA plugin is installed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import models
from ebpo_jax.models import attention


@pytest.fixture
def cudnn_as_xla(monkeypatch):
    """The "cudnn" kernel's calls, run by the XLA implementation and in the model's dtype."""
    monkeypatch.setattr(attention, "FLASH_IMPLEMENTATION", "xla")
    monkeypatch.setattr(attention, "flash_dtype", jnp.dtype)


@pytest.fixture
def spy(monkeypatch):
    """Records every jax.nn.dot_product_attention call's arguments, then runs it with XLA."""
    calls = []
    real = jax.nn.dot_product_attention

    def record(q, k, v, **kw):
        calls.append({"q": q, "k": k, "v": v, **kw})
        return real(q, k, v, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    return calls


def test_resolve_auto_by_platform():
    assert attention.resolve("auto", "gpu") == "cudnn"
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("auto", "cpu") == "xla"
    assert attention.resolve("auto") == "xla"  # the tests' CPU backend, no mesh
    for name in attention.KERNELS:
        assert attention.resolve(name, "tpu") == name
    with pytest.raises(ValueError, match="attention='flash'"):
        attention.resolve("flash")
    with pytest.raises(ValueError, match="ModelConfig.attention='flash'"):
        models.get_config("tiny", attention="flash")


def test_flash_matches_float64_reference(cudnn_as_xla):
    """Causal, GQA (query head h reads kv head h // 2), right-padded rows, padded queries 0."""
    B, T, H, K, d = 3, 9, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(B, T, n, d)).astype(np.float32) for n in (H, K, K))
    len_B = np.array([9, 5, 1], np.int32)
    out = attention.flash(q, k, v, scale=0.3, q_len_B=jnp.asarray(len_B), kv_len_B=len_B)
    for b in range(B):
        for h in range(H):
            for t in range(len_B[b]):
                s = 0.3 * k[b, : t + 1, h // 2].astype(np.float64) @ q[b, t, h]
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                np.testing.assert_allclose(out[b, t, h], p @ v[b, : t + 1, h // 2], atol=1e-5)
        np.testing.assert_array_equal(out[b, len_B[b] :], 0.0)


def test_cudnn_dtype_contract(spy):
    """A float32 model's q/k/v reach cuDNN as bfloat16; a float16 model's stay float16."""
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    lens = jnp.array([4, 2])
    out = attention.flash(q, q, q, scale=1.0, q_len_B=lens, kv_len_B=lens)
    assert out.dtype == jnp.bfloat16
    attention.flash(q.astype(jnp.float16), q, q, scale=1.0, q_len_B=lens, kv_len_B=lens)
    assert [c["q"].dtype for c in spy] == [jnp.bfloat16, jnp.float16]
    assert [c["k"].dtype for c in spy] == [jnp.bfloat16, jnp.float16]
    assert all(c["query_seq_lengths"].dtype == jnp.int32 for c in spy)


def test_forward_calls_cudnn_with_lengths_and_causal(spy):
    """forward: one causal call per layer trace with the rows' lengths, [B, T, H, d] layout."""
    config = models.get_config("tiny", attention="cudnn")
    params = models.init_params(config, jax.random.key(0))
    tokens = jnp.ones((2, 6), jnp.int32)
    mask = jnp.arange(6)[None] < jnp.array([[6], [3]])
    models.forward(config, params, tokens, mask=mask)
    assert len(spy) == 1  # the layer scan traces its body once
    c = spy[0]
    assert c["implementation"] == "cudnn" and c["is_causal"] is True
    assert c["q"].shape == (2, 6, 4, 16) and c["k"].shape == (2, 6, 2, 16)
    np.testing.assert_array_equal(c["query_seq_lengths"], [6, 3])
    np.testing.assert_array_equal(c["key_value_seq_lengths"], [6, 3])
    assert c["scale"] == pytest.approx(16**-0.5)
    assert "mask" not in c and "bias" not in c  # no [T, S] tensor reaches the kernel


# tiny_qwen3 (qk-norm, tied head) adds nothing to the attention path but compile time.
NAMES = ["tiny", pytest.param("tiny_qwen3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", NAMES)
def test_cudnn_path_forward_and_prefill_equal_xla(name, cudnn_as_xla):
    config = models.get_config(name, num_layers=1)
    params = models.init_params(config, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (3, 10), 1, config.vocab_size)
    len_B = jnp.array([10, 7, 2])
    mask = jnp.arange(10)[None] < len_B[:, None]

    @functools.partial(jax.jit, static_argnums=0)
    def run(attn):
        c = config.replace(attention=attn)
        logits = models.forward(c, params, tokens, mask=mask)
        last, cache = models.prefill(
            c, params, tokens, mask=mask, cache_size=12, logits_at=len_B - 1
        )
        return logits, last, cache

    (logits, last, cache), (ref, ref_last, ref_cache) = run("cudnn"), run("xla")
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref)[real], atol=1e-5)
    np.testing.assert_allclose(last, ref_last, atol=1e-5)
    for b, n in enumerate(np.asarray(len_B)):  # keys/values of real tokens
        for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
            np.testing.assert_allclose(x[b, :, :n], y[b, :, :n], atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_cudnn_path_grouped_equals_xla_with_gradients(name, cudnn_as_xla):
    """forward_grouped's gathered completion attention == the XLA mask, values and gradients."""
    config = models.get_config(name, num_layers=1)
    params = models.init_params(config, jax.random.key(6))
    P, G, Tp, N = 3, 2, 6, 5
    rng = np.random.default_rng(0)
    prompt_PT = jnp.asarray(rng.integers(1, config.vocab_size, (P, Tp)), jnp.int32)
    plen_P = jnp.array([6, 2, 4])
    comp_BN = jnp.asarray(rng.integers(1, config.vocab_size, (P * G, N)), jnp.int32)
    clen_B = jnp.array([5, 3, 1, 5, 4, 2])
    w_BN = jnp.asarray(rng.normal(size=(P * G, N, config.vocab_size)), jnp.float32)
    valid_BN = np.arange(N)[None] < np.asarray(clen_B)[:, None]

    def loss(params, attn):
        c = config.replace(attention=attn)
        out_P, out_B = models.forward_grouped(
            c, params, models.GroupedRows(prompt_PT, plen_P, comp_BN, clen_B)
        )
        return jnp.sum(jnp.where(valid_BN[..., None], out_B * w_BN, 0.0)), (out_P, out_B)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (value, (out_P, out_B)), grads = grad(params, "cudnn")
    (ref_value, (ref_P, ref_B)), ref_grads = grad(params, "xla")
    for p, n in enumerate(np.asarray(plen_P)):
        np.testing.assert_allclose(out_P[p, :n], ref_P[p, :n], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out_B)[valid_BN], np.asarray(ref_B)[valid_BN], atol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), grads, ref_grads
    )


def test_cudnn_path_bfloat16_model_close_to_xla():
    """Through the real casts (bf16 model): close to the XLA attention at bf16 precision."""
    config = models.get_config("tiny", param_dtype="bfloat16", dtype="bfloat16")
    params = models.init_params(config, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 1, config.vocab_size)
    forward = jax.jit(models.forward, static_argnums=0)
    ref = forward(config, params, tokens)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention, "FLASH_IMPLEMENTATION", "xla")
        out = forward(config.replace(attention="cudnn"), params, tokens)
    np.testing.assert_allclose(out, ref, atol=0.02 * float(jnp.abs(ref).max()))
