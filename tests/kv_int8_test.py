"""int8 KV pages (sampler.kv_dtype="int8"): quantization, the attention paths against the
dequantized reference and against float32 within the bound the quantization step gives,
generate on the tiny model, and the pages a memory budget holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_test import reference

from ebpo_jax import models, sampler
from ebpo_jax.kernels import quant
from ebpo_jax.kernels.paged_xla import paged_decode_attention_xla
from ebpo_jax.sampler import attention, pages


def _case(seed, *, rows=5, kv_heads=2, group=2, d=32, page_size=4, num_pages=32, width=5):
    """Random q, a float32 pool with outlier tokens, page tables and ragged lengths."""
    rng = np.random.default_rng(seed)
    kv = rng.normal(size=(num_pages, page_size, 2 * kv_heads, d)).astype(np.float32)
    # Heads of very different sizes: a scale shared over a page would lose the small ones.
    kv *= rng.choice([0.05, 1.0, 8.0], size=(num_pages, page_size, 2 * kv_heads, 1))
    q = rng.normal(size=(rows, kv_heads * group, d)).astype(np.float32)
    table = rng.permutation(num_pages)[: rows * width].reshape(rows, width).astype(np.int32)
    lens = rng.integers(1, width * page_size + 1, rows).astype(np.int32)
    lens[1], lens[2] = 0, width * page_size  # an idle row and a full one
    return q, kv, table, lens


def _swap_pairs(s_PCS):
    """Each key's scale where its value's is and back (head-major scales [P, 2K, S])."""
    P, C, S = s_PCS.shape
    return s_PCS.reshape(P, C // 2, 2, S)[:, :, ::-1].reshape(P, C, S)


def _int8(kv):
    return quant.to_pages(jnp.asarray(kv))


def _bound(q, kv, kv8, table, lens):
    """Per row and head, the largest output error int8 pages can cause against the exact pages.

    A key element is off by at most its scale / 2, so token t's score by at most
    Delta_t = D^-1/2 * sum|q| * s_k,t / 2. Its softmax weight p_t then becomes p_t * e_t with
    e^-Delta_t / sum_u p_u e^Delta_u <= e_t <= e^Delta_t / sum_u p_u e^-Delta_u, and a value
    element moves by at most s_v,t / 2, so
    |out - out_int8| <= sum_t p_t |e_t - 1| |v_t - out| + max_t s_v,t / 2.
    """
    R, H, D = q.shape
    K = kv.shape[2] // 2
    kv_RTCD = kv[table].reshape(R, -1, 2 * K, D)
    s_RTC = np.swapaxes(np.asarray(kv8.scales), 1, 2)[table].reshape(R, -1, 2 * K)
    out = np.zeros((R, H))
    for r in np.flatnonzero(lens):
        n = lens[r]
        for h in range(H):
            k, v = kv_RTCD[r, :n, 2 * (h // (H // K))], kv_RTCD[r, :n, 2 * (h // (H // K)) + 1]
            sk, sv = s_RTC[r, :n, 2 * (h // (H // K))], s_RTC[r, :n, 2 * (h // (H // K)) + 1]
            logits = (k @ q[r, h]) * D**-0.5
            p = np.exp(logits - logits.max())
            p /= p.sum()
            o = p @ v
            delta = D**-0.5 * np.abs(q[r, h]).sum() * sk / 2
            hi = np.exp(delta) / (p @ np.exp(-delta)) - 1
            lo = 1 - np.exp(-delta) / (p @ np.exp(delta))
            e = np.maximum(hi, lo)
            out[r, h] = (p * e) @ np.abs(v - o).max(-1) + sv.max() / 2
    return out


def test_quantize_error_is_at_most_half_a_step_and_zeros_stay_zero():
    x = np.random.default_rng(0).normal(size=(6, 4, 32)).astype(np.float32)
    x[0, 0] = 0.0
    q, s = quant.quantize(jnp.asarray(x))
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32 and s.shape == (6, 4)
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 127, rtol=1e-6)
    assert np.abs(np.asarray(q)).max() == 127
    dequantized = np.asarray(q, np.float32) * np.asarray(s)[..., None]
    err = np.abs(dequantized - x)
    assert (err <= np.asarray(s)[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
    np.testing.assert_array_equal(np.asarray(q)[0, 0], 0)


def test_int8_pages_are_stored_head_major_and_read_back_in_the_shared_layout():
    """A page's values and scales lie [2K, page_size, ...] (TPU tiles (page_size, D) unpadded);
    `shape` and `dequantize` give the shared [pages, page_size, 2K, D]."""
    x = np.random.default_rng(1).normal(size=(3, 8, 4, 32)).astype(np.float32)
    pool = quant.to_pages(jnp.asarray(x))
    assert pool.values.shape == (3, 4, 8, 32) and pool.scales.shape == (3, 4, 8)
    assert pool.shape == x.shape
    q, s = quant.quantize(jnp.asarray(x))
    np.testing.assert_array_equal(pool.values, np.swapaxes(np.asarray(q), 1, 2))
    np.testing.assert_array_equal(quant.dequantize(pool), np.asarray(q) * np.asarray(s)[..., None])


@pytest.mark.parametrize("impl", ["engine_xla", "gather_xla"])
def test_int8_attention_equals_the_dequantized_reference_and_stays_within_its_bound(impl):
    q, kv, table, lens = _case(0)
    kv8 = _int8(kv)
    attend = jax.jit(
        {
            "engine_xla": lambda pool: attention.paged_decode_attention(q, pool, table, lens),
            "gather_xla": lambda pool: paged_decode_attention_xla(q, pool, table, lens),
        }[impl]
    )
    got = np.asarray(attend(kv8))
    # Folding the scales into scores and weights is the attention of the dequantized pages.
    dequantized = np.asarray(attend(quant.dequantize(kv8)))
    np.testing.assert_allclose(got, dequantized, rtol=0, atol=2e-5)
    exact = np.asarray(attend(jnp.asarray(kv)))
    err_RH = np.abs(got - exact).max(-1)
    bound_RH = _bound(q, kv, kv8, table, lens)
    assert (err_RH <= bound_RH).all(), (err_RH, bound_RH)
    np.testing.assert_array_equal(got[lens == 0], 0.0)
    # The bound is tight enough to catch wrong scales: keys' and values' swapped break it.
    swapped = quant.Int8Pages(kv8.values, _swap_pairs(kv8.scales))
    err_swapped = np.abs(np.asarray(attend(swapped)) - exact).max(-1)
    assert (err_swapped > bound_RH)[lens > 0].mean() >= 0.75


def test_int8_attention_is_close_to_bfloat16_attention():
    """int8 pages against bfloat16 pages, each against float32: int8 is within a few times
    bfloat16's own error (2^-9 relative vs int8's 2^-8 of each head's largest element)."""
    q, kv, table, lens = _case(1)
    attend = jax.jit(lambda q, pool: attention.paged_decode_attention(q, pool, table, lens))
    exact = np.asarray(attend(q, jnp.asarray(kv)))
    q16 = jnp.asarray(q, jnp.bfloat16)
    bf16, i8 = attend(q16, jnp.asarray(kv, jnp.bfloat16)), attend(q16, _int8(kv))
    scale = np.abs(exact).max()
    err_bf16 = np.abs(np.asarray(bf16, np.float32) - exact).max() / scale
    err_i8 = np.abs(np.asarray(i8, np.float32) - exact).max() / scale
    assert err_i8 < 0.05, err_i8
    assert err_i8 < 10 * err_bf16, (err_i8, err_bf16)


def test_appending_to_a_partly_filled_page_keeps_its_tokens():
    """Each token carries its own scale: a larger later token neither clips nor rescales the
    tokens already in its page."""
    pool = pages.init_pools(models.get_config("tiny"), 1, 2, 4, "int8")[0]
    pool = jax.tree.map(lambda x: x[0], pool)  # one shard: [pages, page_size, 2K, D]
    C, D = pool.shape[2:]
    write = jax.jit(lambda pool, x, page, at: pages.write_token(pool, x, page[None], at[None]))
    small = np.full((1, C, D), 0.01, np.float32)
    pool = write(pool, small, 1, 0)
    before = np.asarray(quant.dequantize(pool))[1, 0]
    pool = write(pool, 1000.0 * np.ones((1, C, D), np.float32), 1, 1)
    after = np.asarray(quant.dequantize(pool))
    np.testing.assert_array_equal(after[1, 0], before)
    np.testing.assert_allclose(before, 0.01, rtol=1e-6)
    np.testing.assert_allclose(after[1, 1], 1000.0, rtol=1e-6)
    dropped = write(pool, small, 2, 0)  # page "none"
    np.testing.assert_array_equal(quant.dequantize(dropped), after)


def test_a_memory_budget_holds_twice_the_int8_pages_less_their_scales():
    config = models.get_config("tiny").replace(dtype="bfloat16", head_dim=128)
    budget = 64 * pages.page_bytes(config, 16)
    bf16, int8 = pages.pages_in(budget, config, 16), pages.pages_in(budget, config, 16, "int8")
    assert bf16 == 64
    # A page of int8 is half a bfloat16 page plus 4 bytes of scale per 128 values.
    assert int8 == int(64 * 2 / (1 + 4 / 128)) == 124
    assert pages.page_bytes(config, 16, "int8") == pytest.approx(
        pages.page_bytes(config, 16) / 2 * (1 + 4 / 128)
    )


CONFIG = models.get_config("tiny")
PROMPTS = np.random.default_rng(0).integers(1, 100, (8, 12)).astype(np.int32)
LENGTHS = np.random.default_rng(1).integers(3, 13, 8).astype(np.int32)


@pytest.fixture(scope="module")
def params():
    p = models.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p)


def _generate(params, kv_dtype, **kw):
    spec = sampler.SamplerSpec(
        max_new_tokens=16, num_samples=2, sampling=sampler.Sampling(0.0, 0, 1.0), page_size=4,
        kv_dtype=kv_dtype, **kw,
    )  # fmt: skip
    return sampler.generate(CONFIG, params, PROMPTS, LENGTHS, spec, rng=jax.random.key(1))


def test_generate_with_int8_pages_follows_the_float_model(params):
    """Greedy rows drawn from int8 pages: their log-probs are the float model's (one forward
    over prompt + completion) up to the quantization error, and almost every token is the
    float model's argmax after the same prefix."""
    gen = _generate(params, "int8")
    tokens = np.asarray(gen.tokens)
    ref_logp, ref_argmax = reference(params, tokens, PROMPTS, LENGTHS, num_samples=2)
    err = np.abs(np.asarray(gen.logprobs) - ref_logp)
    assert err.mean() < 0.05 and err.max() < 0.5, (err.mean(), err.max())
    assert (ref_argmax == tokens).mean() >= 0.9


@pytest.mark.slow
def test_int8_pages_through_slots_and_a_short_pool_give_the_static_batchs_rows(params):
    """Quantization is per token, so preemption and page reuse do not change a row."""
    static = _generate(params, "int8")
    paged = _generate(params, "int8", slots=4, kv_pages=20)
    assert int(paged.stats.preempted) > 0
    np.testing.assert_array_equal(np.asarray(paged.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(paged.logprobs), np.asarray(static.logprobs))


def test_kv_dtype_travels_from_the_config_and_bad_values_are_one_line():
    from ebpo_jax import schema

    spec = sampler.SamplerSpec.from_config(schema.Sampler(kv_dtype="int8"), max_new_tokens=4)
    assert spec.kv_dtype == "int8"
    with pytest.raises(ValueError, match="kv_dtype='fp4'"):
        _generate(None, "fp4")


@pytest.mark.slow
def test_gpu_kernel_in_the_interpreter_takes_int8_pages_with_their_scales():
    """The Triton kernel's own per-token scale pages, run by Pallas' interpreter."""
    from ebpo_jax.kernels.paged_gpu import paged_decode_attention_gpu

    q, kv, table, lens = _case(2, group=8, d=16)  # the kernel's 16 query heads per program
    kv8 = _int8(kv)
    got = paged_decode_attention_gpu(q, kv8, table, lens, interpret=True)
    want = paged_decode_attention_xla(q, quant.dequantize(kv8), table, lens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_int8_pages_with_dp_attention_on_eight_devices_equal_the_unsharded_rows(params):
    """Pools (values and scales) split over data x tp, every head on each chip."""
    from ebpo_jax import sharding

    static = _generate(params, "int8")
    mesh = sharding.make_mesh([("data", 4), ("tp", 2)])
    placed = jax.device_put(params, sharding.param_shardings(CONFIG, params, mesh))
    spec = sampler.SamplerSpec(
        max_new_tokens=16, num_samples=2, sampling=sampler.Sampling(0.0, 0, 1.0), page_size=4,
        kv_dtype="int8", slots=8, kv_pages=64, dp_attention=True, live_buckets=2,
    )  # fmt: skip
    gen = sampler.generate(CONFIG, placed, PROMPTS, LENGTHS, spec, rng=jax.random.key(1), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(static.tokens))
    np.testing.assert_allclose(gen.logprobs, static.logprobs, rtol=0, atol=1e-5)
