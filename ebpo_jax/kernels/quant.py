"""int8 KV pages: a pool of int8 values with a float32 scale per token and combined kv head.

`Int8Pages(values_PSCD, scales_PSC)` stands where a plain pool [pages, page_size, 2K, D]
does: values int8 in the same layout, scales [pages, page_size, 2K] beside them. A token's
key (or value) head is quantized on its own when it is written (absmax / 127, round to
nearest), so appending to a partly filled page never rescales or clips the tokens already
there, and the error of an element is at most its scale / 2. The attention paths fold the
scales into the scores (keys) and the softmax weights (values) instead of dequantizing the
pages first.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

DTYPES = ("", "int8")
QMAX = 127.0  # symmetric: -128 is never used, so q and -q both exist


class Int8Pages(NamedTuple):
    """A quantized pool: values [..., pages, page_size, 2K, D] int8, scales [..., 2K] float32."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        return self.values.shape


def quantize(x_CD) -> tuple:
    """(int8 values, float32 scales [...]) of x over its last axis: x ~= values * scales."""
    x_CD = x_CD.astype(jnp.float32)
    scale_C = jnp.max(jnp.abs(x_CD), axis=-1) / QMAX
    inv_C = jnp.where(scale_C > 0, 1.0 / jnp.where(scale_C > 0, scale_C, 1.0), 0.0)
    q_CD = jnp.clip(jnp.round(x_CD * inv_C[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q_CD, scale_C


def dequantize(pool: Int8Pages, dtype=jnp.float32):
    """The pool's values times their scales, in `dtype` (the references and tests)."""
    return (pool.values.astype(jnp.float32) * pool.scales[..., None]).astype(dtype)


def bytes_per_element(kv_dtype: str, compute_dtype, head_dim: int) -> float:
    """Pool bytes per cached element (one head_dim entry of one token's key or value head)."""
    if kv_dtype == "int8":
        return 1.0 + 4.0 / head_dim  # the int8 value and its share of the float32 scale
    return float(jnp.dtype(compute_dtype).itemsize)


def take(pool, index):
    """pool[index] for a plain pool or an Int8Pages (both of its arrays)."""
    return jax.tree.map(lambda x: x[index], pool)


def split_kv(pages_BTCD, dtype) -> tuple:
    """(keys, values [B, T, K, D], key scales, value scales [B, K, 1, T]) of gathered pages:
    int8 values cast to `dtype` (exact: |q| <= 127); scales 1.0 for a plain pool."""
    if not isinstance(pages_BTCD, Int8Pages):
        return pages_BTCD[:, :, 0::2], pages_BTCD[:, :, 1::2], 1.0, 1.0
    v_BTCD, s_BTC = pages_BTCD
    per_head = lambda s_BTK: s_BTK.transpose(0, 2, 1)[:, :, None, :]
    k_BTKD, v_BTKD = v_BTCD[:, :, 0::2].astype(dtype), v_BTCD[:, :, 1::2].astype(dtype)
    return k_BTKD, v_BTKD, per_head(s_BTC[:, :, 0::2]), per_head(s_BTC[:, :, 1::2])
