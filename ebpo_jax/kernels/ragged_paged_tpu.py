"""Decode attention over a paged KV cache on TPU: JAX's Pallas ragged paged attention kernel.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) takes ragged query
runs; decode is the case of one query token per row, so `cu_q_lens` is 0, 1, ..., R and
every row is a sequence. It streams each row's own pages, `KV_TOKENS_PER_BLOCK` tokens at a
time, so a row reads its length rounded up to a block, not the longest row's.

Shapes the kernel refuses (head_dim not a multiple of 128, kv heads per device it cannot
tile: `fallback_reason`) run `paged_decode_attention_xla` on the device's rows instead.
Block sizes are passed explicitly: the kernel's tuned-size table looks up the default
device, which under an ahead-of-time compile on a CPU host is the CPU. Idle rows (kv_len 0)
are run as length 1 (the kernel needs q_len <= kv_len) and their output set to 0.
Keep at least 8 combined kv heads per device (bfloat16, v5p): with 4 (8 kv heads on tp=4)
XLA keeps a decode loop's pool in another tiled layout than the kernel's and converts it
around every call, a copy of the pool per layer per step and 3x the pool in memory; with 8
or 16 it does not (tests/paged_kernels_test.py compiles the engine's decode to check).
An int8 pool (`quant.Int8Pages`) runs this codebase's own kernel (`paged_int8_tpu`): the stock
kernel takes int8 pages but only one static scale per tensor, not the per-token scales kept here.
Under a mesh the kernel runs per device (`paged_shard`: page tables are local to the row
shard's pool slab).
"""

import functools

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

from ebpo_jax.kernels.paged_int8_tpu import paged_int8_decode
from ebpo_jax.kernels.paged_shard import ROW_AXES, per_shard
from ebpo_jax.kernels.paged_xla import check_layout, paged_decode_attention_xla
from ebpo_jax.kernels.quant import Int8Pages

# Tokens per KV block: the kernel copies whole blocks (pages past the row's end included),
# so a smaller block wastes less of a short row's bandwidth; 512 is within the sizes the
# kernel's own tuned table picks for v5 decode.
KV_TOKENS_PER_BLOCK = 512
# The kernel issues one DMA per page of a block; its tuned table never goes past 16 pages.
MAX_PAGES_PER_BLOCK = 16
QUERIES_PER_BLOCK = 32  # the kernel's untuned default
LANES = 128  # the kernel's softmax scratch width: head_dim must be a multiple


def block_sizes(page_size: int, pages_per_row: int, rows: int) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) for the kernel."""
    per_block = min(MAX_PAGES_PER_BLOCK, KV_TOKENS_PER_BLOCK // page_size)
    kv_pages = max(1, min(pages_per_row, per_block))
    return kv_pages, min(rows, QUERIES_PER_BLOCK)


def fallback_reason(q_RHD, kv_pages_PSCD) -> str | None:
    """None when the kernel takes one device's shapes, else why the XLA path runs instead."""
    D, C = q_RHD.shape[-1], kv_pages_PSCD.shape[2]
    if isinstance(kv_pages_PSCD, Int8Pages):
        return None  # paged_int8_tpu takes every shape
    if D % LANES:
        return f"head_dim {D}: the kernel's scratch is {LANES} lanes wide, needs a multiple"
    try:
        get_min_heads_per_blk(q_RHD.shape[1], C, q_RHD.dtype, kv_pages_PSCD.dtype)
    except ValueError as e:
        return f"{C} combined kv heads per device: {e}"
    return None


def _local(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, scale, interpret):
    """The kernel on one device's rows and pages (the XLA path where it refuses them)."""
    R = q_RHD.shape[0]
    kv_pages, queries = block_sizes(kv_pages_PSCD.shape[1], page_table_RN.shape[1], R)
    if isinstance(kv_pages_PSCD, Int8Pages):  # the same KV blocks (the estimate's rounding)
        return paged_int8_decode(
            q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, scale=scale,
            pages_per_block=kv_pages, interpret=interpret,
        )  # fmt: skip
    if fallback_reason(q_RHD, kv_pages_PSCD):
        return paged_decode_attention_xla(
            q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, scale=scale
        )
    out_RHD = ragged_paged_attention(
        q_RHD,
        kv_pages_PSCD,
        jnp.maximum(kv_lens_R, 1).astype(jnp.int32),
        page_table_RN.astype(jnp.int32),
        jnp.arange(R + 1, dtype=jnp.int32),
        jnp.array([R], jnp.int32),
        sm_scale=scale,
        num_kv_pages_per_block=kv_pages,
        num_queries_per_block=queries,
    )
    return jnp.where(kv_lens_R[:, None, None] > 0, out_RHD, 0)


def paged_decode_attention_tpu(
    q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, scale=None, row_axes=ROW_AXES,
    interpret=False,
):  # fmt: skip
    """softmax(q k^T * scale) v over each row's own pages, by the Pallas TPU kernel: [R, H, D].

    scale defaults to 1/sqrt(head_dim). The stock kernel only compiles for TPU (its interpret
    mode fails in JAX 0.10.2; `ref_ragged_paged_attention` in its module is its CPU twin);
    `interpret` runs the int8 kernel in the TPU interpreter instead.
    Under a mesh, rows and pages split over its `row_axes` (paged_shard).
    """
    check_layout(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    scale = q_RHD.shape[-1] ** -0.5 if scale is None else float(scale)
    local = functools.partial(_local, scale=scale, interpret=interpret)
    return per_shard(local, row_axes)(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
