"""int8 KV pages: a pool of int8 values with a float32 scale per token and combined kv head.

`Int8Pages` stands where a plain pool [pages, page_size, 2K, D] does (its `shape` is that
one), but stores each page head-major: values [pages, 2K, page_size, D] int8 and scales
[pages, 2K, page_size] float32. TPU tiles an array's last two dims: a page's (page_size, D)
tiles without padding at any number of heads per chip, where (2K, D) pads to int8's 32-row
tile below 32 combined heads, and XLA then copied the pool into another tiling around every
kernel call. A token's key (or value) head is quantized on its own when it is written
(absmax / 127, round to nearest), so appending to a partly filled page never rescales or
clips the tokens already there, and the error of an element is at most its scale / 2. The
attention paths fold the scales into the scores (keys) and the softmax weights (values)
instead of dequantizing the pages first.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

DTYPES = ("", "int8")
QMAX = 127.0  # symmetric: -128 is never used, so q and -q both exist


class Int8Pages(NamedTuple):
    """A quantized pool, head-major: values [..., pages, 2K, page_size, D] int8, scales
    [..., pages, 2K, page_size] float32; `shape` is the shared [..., pages, page_size, 2K, D]."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        *lead, C, S, D = self.values.shape
        return (*lead, S, C, D)


def quantize(x_CD) -> tuple:
    """(int8 values, float32 scales [...]) of x over its last axis: x ~= values * scales."""
    x_CD = x_CD.astype(jnp.float32)
    scale_C = jnp.max(jnp.abs(x_CD), axis=-1) / QMAX
    inv_C = jnp.where(scale_C > 0, 1.0 / jnp.where(scale_C > 0, scale_C, 1.0), 0.0)
    q_CD = jnp.clip(jnp.round(x_CD * inv_C[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q_CD, scale_C


def to_pages(x_SCD) -> Int8Pages:
    """x [..., page_size, 2K, D] (pages in the shared layout) quantized into an Int8Pages."""
    q_SCD, s_SC = quantize(x_SCD)
    return Int8Pages(jnp.swapaxes(q_SCD, -3, -2), jnp.swapaxes(s_SC, -2, -1))


def dequantize(pool: Int8Pages, dtype=jnp.float32):
    """The pool's values times their scales in the shared layout, in `dtype` (references, tests)."""
    x_CSD = pool.values.astype(jnp.float32) * pool.scales[..., None]
    return jnp.swapaxes(x_CSD, -3, -2).astype(dtype)


def bytes_per_element(kv_dtype: str, compute_dtype, head_dim: int) -> float:
    """Pool bytes per cached element (one head_dim entry of one token's key or value head)."""
    if kv_dtype == "int8":
        return 1.0 + 4.0 / head_dim  # the int8 value and its share of the float32 scale
    return float(jnp.dtype(compute_dtype).itemsize)


def take(pool, index):
    """pool[index] for a plain pool or an Int8Pages (both of its arrays)."""
    return jax.tree.map(lambda x: x[index], pool)


def split_kv(pages, dtype) -> tuple:
    """(keys, values [..., page_size, K, D], key scales, value scales [..., K, 1, page_size])
    of gathered pages (a plain pool's [..., page_size, 2K, D] or an Int8Pages'): int8 values
    cast to `dtype` (exact: |q| <= 127); scales 1.0 for a plain pool."""
    if not isinstance(pages, Int8Pages):
        return pages[..., 0::2, :], pages[..., 1::2, :], 1.0, 1.0
    v_CSD, s_CS = pages
    token_major = lambda x: jnp.swapaxes(x, -3, -2).astype(dtype)
    k_SKD, v_SKD = token_major(v_CSD[..., 0::2, :, :]), token_major(v_CSD[..., 1::2, :, :])
    return k_SKD, v_SKD, s_CS[..., 0::2, None, :], s_CS[..., 1::2, None, :]
