"""Decode attention over a paged KV cache on GPU: JAX's Pallas (Triton) paged attention kernel.

`jax.experimental.pallas.ops.gpu.paged_attention` wants separate, head-major pools
([kv_heads, pages, page_size, head_dim] for K and for V), takes no softmax scale, and needs
the page table split evenly into `k_splits` partitions. This wrapper maps the shared layout
onto it: K and V are the even and odd combined heads, transposed to head-major; q carries
the scale; the table is padded with page 0 (masked by the lengths). The transpose reads and
writes the whole pool at every call, which a row-local kernel exists to avoid: it costs
about 2x the pool's bytes per layer per step, more than the rows' own pages in a large pool.
Until the engine keeps its GPU pool head-major, `paged_decode_attention_xla` (gather of the
row's pages) is the better GPU path; `fallback_reason` says when the kernel is refused.
An int8 pool (`quant.Int8Pages`) goes in as int8 pages with the kernel's own per-token scale
pages ([kv_heads, pages, page_size], applied to the scores and the softmax weights inside).
It lowers for H200 without a device (vmapped over the engine's shard axis, tp=8:
tests/paged_kernels_test.py, in a venv with the CUDA plugin) and runs in Pallas'
interpreter on CPU; it has not run on a GPU.
"""

import functools
import math

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

from ebpo_jax.kernels.paged_shard import ROW_AXES, per_shard
from ebpo_jax.kernels.paged_xla import check_layout, paged_decode_attention_xla
from ebpo_jax.kernels.quant import Int8Pages

BLOCK_H = 16  # query heads per program: the kernel requires a multiple of 16
PAGES_PER_COMPUTE_BLOCK = 8  # the kernel's default
K_SPLITS = 16  # the kernel's default partitions of a row's pages (flash-decoding style)


def fallback_reason(q_RHD, kv_pages_PSCD) -> str | None:
    """None when the kernel takes these shapes, else why the XLA path runs instead."""
    D = q_RHD.shape[-1]
    if D % 16 or D > 256:
        return f"head_dim {D}: the Triton kernel's dot needs a multiple of 16, at most 256"
    if q_RHD.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtype {q_RHD.dtype}: not a float type the kernel takes"
    return None


def _head_major(kv_PSCD, dtype) -> tuple:
    """(K [K, P, S, D], V, (K scales [K, P, S], V scales) or ()) as the kernel takes them:
    a plain pool cast to `dtype`, an int8 pool's values kept int8."""
    head_major = lambda x: jnp.moveaxis(x, 2, 0)  # [P, S, K, ...] -> [K, P, S, ...]
    if not isinstance(kv_PSCD, Int8Pages):
        return (
            head_major(kv_PSCD[:, :, 0::2]).astype(dtype),
            head_major(kv_PSCD[:, :, 1::2]).astype(dtype),
            (),
        )
    v_PCSD, s_PCS = kv_PSCD  # already head-major within a page: [P, K, ...] -> [K, P, ...]
    lead = lambda x: jnp.moveaxis(x, 1, 0)
    return (
        lead(v_PCSD[:, 0::2]),
        lead(v_PCSD[:, 1::2]),
        (lead(s_PCS[:, 0::2]), lead(s_PCS[:, 1::2])),
    )


def _local(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, scale, interpret):
    """The kernel on one device's rows and pages."""
    N = page_table_RN.shape[1]
    splits = min(K_SPLITS, N)
    per_split = -(-N // splits)
    block = math.gcd(per_split, PAGES_PER_COMPUTE_BLOCK)
    table_RN = jnp.pad(page_table_RN.astype(jnp.int32), ((0, 0), (0, splits * per_split - N)))
    k_KPSD, v_KPSD, scales = _head_major(kv_pages_PSCD, q_RHD.dtype)
    out_RHD = paged_attention(
        q_RHD * jnp.asarray(scale, q_RHD.dtype),
        k_KPSD,
        v_KPSD,
        table_RN,
        kv_lens_R.astype(jnp.int32),
        *scales,
        block_h=BLOCK_H,
        pages_per_compute_block=block,
        k_splits=splits,
        interpret=interpret,
    )
    return jnp.where(kv_lens_R[:, None, None] > 0, out_RHD, 0)


def paged_decode_attention_gpu(
    q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, scale=None, interpret=False,
    row_axes=ROW_AXES,
):  # fmt: skip
    """softmax(q k^T * scale) v over each row's pages, by the Pallas GPU kernel: [R, H, D].

    scale defaults to 1/sqrt(head_dim). Shapes the kernel refuses (`fallback_reason`) run
    the XLA gather path. `interpret=True` runs the kernel in Pallas' interpreter (CPU).
    Under a mesh, rows and pages split over its `row_axes` (paged_shard).
    """
    check_layout(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    scale = q_RHD.shape[-1] ** -0.5 if scale is None else float(scale)
    if fallback_reason(q_RHD, kv_pages_PSCD):
        local = functools.partial(paged_decode_attention_xla, scale=scale)
    else:
        local = functools.partial(_local, scale=scale, interpret=interpret)
    return per_shard(local, row_axes)(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
