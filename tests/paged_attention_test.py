"""Paged KV pages and ragged paged decode attention against JAX's own TPU-kernel reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from ebpo_jax.sampler import attention, pages


def _case(seed, *, rows=5, kv_heads=2, group=2, d=16, page_size=4, num_pages=32, width=5):
    """Random pages, per-row page tables (distinct pages) and ragged lengths, incl. an idle row."""
    rng = np.random.default_rng(seed)
    kv = rng.normal(size=(num_pages, page_size, 2 * kv_heads, d)).astype(np.float32)
    q = rng.normal(size=(rows, kv_heads * group, d)).astype(np.float32)
    table = rng.permutation(num_pages)[: rows * width].reshape(rows, width).astype(np.int32)
    lens = rng.integers(1, width * page_size + 1, rows).astype(np.int32)
    lens[1], lens[2] = 0, width * page_size  # an idle row and a full one
    return q, kv, table, lens


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_xla_equals_the_tpu_kernels_reference(seed):
    q, kv, table, lens = _case(seed)
    out = attention.paged_decode_attention(q, kv, table, lens, impl="xla")
    live = np.flatnonzero(lens > 0)
    # The reference takes the live rows, one query token each (cu_q_lens 0, 1, 2, ...).
    ref = rpa.ref_ragged_paged_attention(
        jnp.asarray(q[live]),
        jnp.asarray(kv),
        jnp.asarray(lens[live]),
        jnp.asarray(table[live]),
        jnp.arange(len(live) + 1, dtype=jnp.int32),
        jnp.array([len(live)], jnp.int32),
        sm_scale=q.shape[-1] ** -0.5,
    )
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[lens == 0], 0.0)


def test_xla_chunks_equal_one_chunk(monkeypatch):
    """Many small chunks (the list walked in pieces) give the one-chunk result."""
    q, kv, table, lens = _case(2)
    one = attention.paged_decode_attention(q, kv, table, lens, impl="xla")
    monkeypatch.setattr(attention, "BLOCK_PAGES", 1)
    many = attention.paged_decode_attention(q, kv, table, lens, impl="xla")
    np.testing.assert_allclose(np.asarray(many), np.asarray(one), rtol=0, atol=1e-6)


def test_interleaved_layout_and_prompt_pages():
    """Key head k at combined index 2k, value at 2k + 1; prompt pages pad the last page."""
    k = jnp.arange(2 * 2 * 5 * 3, dtype=jnp.float32).reshape(2, 2, 5, 3)  # [P, K, T, D]
    v = -k
    paged = pages.prompt_pages(k, v, 2)  # [P, 3, 2, 4, 3]
    assert paged.shape == (2, 3, 2, 4, 3)
    flat = paged.reshape(2, 6, 4, 3)
    np.testing.assert_array_equal(flat[:, :5, 0::2], k.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(flat[:, :5, 1::2], v.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(flat[:, 5], 0.0)
    both = pages.interleave(k[:, :, 0], v[:, :, 0])
    np.testing.assert_array_equal(both, flat[:, 0])


def test_take_and_give_back_pages():
    free = jnp.array([True, False, True, True, False, True])
    taken, free2 = pages.take(free, jnp.array([2, 0, 1]), 2)
    np.testing.assert_array_equal(taken, [[0, 2], [6, 6], [3, 6]])  # 6 = "none"
    np.testing.assert_array_equal(free2, [False, False, False, False, False, True])
    back = pages.give_back(free2, taken, jnp.array([[True, False], [True, True], [True, True]]))
    np.testing.assert_array_equal(back, [True, False, False, True, False, True])


def test_auto_picks_xla_without_a_kernel_and_named_kernels_say_what_is_missing():
    assert attention.resolve("auto", "cpu") == "xla"
    with pytest.raises(ValueError, match="impl='flash'"):
        attention.resolve("flash")
    q, kv, table, lens = _case(0)
    try:
        import ebpo_jax.kernels.paged_gpu  # noqa: F401  (the kernels' own tests cover it)
    except ImportError:
        with pytest.raises(NotImplementedError, match="pallas_gpu"):
            attention.paged_decode_attention(q, kv, table, lens, impl="pallas_gpu")
