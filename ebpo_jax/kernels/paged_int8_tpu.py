"""Decode attention over int8 KV pages on TPU: this codebase's own Pallas kernel.

One query token per row; the pool is a `quant.Int8Pages` (int8 values [pages, 2K, page_size,
D], K at even and V at odd combined heads, a float32 scale per combined head and token, both
head-major within a page, the layout read here as it is stored).
The grid is (rows, blocks of `pages_per_block` pages). The row's page table and lengths are
scalar-prefetched into SMEM, and each block's pages are picked by the BlockSpecs' index maps
from that table, so Pallas DMAs exactly those pages (values and scale pages) into VMEM. A
block past the row's last live page maps to that page again: the pipeline skips a copy whose
block index repeats, so a row reads its own pages, rounded up to a block, not the table.

Per page and kv head, in float32: the key scales multiply the scores (q . k_int8 x s_k) and
the value scales the softmax weights (p x s_v) before they meet the int8 values, so the
pages are never dequantized; tokens past the row's length are masked; an online softmax
(running max m, sum l, accumulator acc per query head) carries across the row's pages, and
the last block writes acc / l. All query heads of a kv head (the GQA group) share its pages.
Idle rows (length 0) compute nothing and give 0.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ebpo_jax.kernels.quant import Int8Pages

# Pages DMA'd per grid step by default; ragged_paged_tpu passes the stock kernel's blocks.
PAGES_PER_BLOCK = 4
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) stays 1, never NaN


def _page_map(b: int, pages_per_block: int, pool_shape: tuple, width: int, ndim: int):
    """Index map of the b-th page of a block: the table's page, clamped to the row's last.

    An idle row's (length 0) first column may hold "none" (one past the pool, the engine's
    empty slot): that id is clamped into the pool, and the page it copies is not read.
    """
    num_pages, page_size = pool_shape[:2]

    def index(r, j, table_ref, lens_ref):
        last = jnp.maximum((lens_ref[r] + page_size - 1) // page_size - 1, 0)
        col = jnp.minimum(j * pages_per_block + b, last)
        return (jnp.minimum(table_ref[r * width + col], num_pages - 1),) + (0,) * (ndim - 1)

    return index


def _attend_page(q_ref, kv_ref, s_ref, softmax_refs, start, length, scale):
    """Fold one page (int8 K/V [C, S, D], scales [C, S]) into every kv head's online softmax
    (softmax_refs: running max, sum and accumulator)."""
    m_ref, l_ref, acc_ref = softmax_refs
    C, S, _ = kv_ref.shape
    G = q_ref.shape[1]
    valid_GS = start + jax.lax.broadcasted_iota(jnp.int32, (G, S), 1) < length
    for k in range(C // 2):
        q_GD = q_ref[k].astype(jnp.float32)
        k_SD = kv_ref[2 * k].astype(jnp.float32)
        s_GS = jax.lax.dot_general(
            q_GD, k_SD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        s_GS = jnp.where(valid_GS, s_GS * (s_ref[2 * k : 2 * k + 1, :] * scale), _NEG)
        m_G1 = m_ref[k]
        m_new_G1 = jnp.maximum(m_G1, s_GS.max(axis=1, keepdims=True))
        p_GS = jnp.where(valid_GS, jnp.exp(s_GS - m_new_G1), 0.0)
        rescale_G1 = jnp.exp(m_G1 - m_new_G1)
        l_ref[k] = l_ref[k] * rescale_G1 + p_GS.sum(axis=1, keepdims=True)
        v_SD = kv_ref[2 * k + 1].astype(jnp.float32)
        pv_GD = jnp.dot(
            p_GS * s_ref[2 * k + 1 : 2 * k + 2, :], v_SD, preferred_element_type=jnp.float32
        )
        acc_ref[k] = acc_ref[k] * rescale_G1 + pv_GD
        m_ref[k] = m_new_G1


def _kernel(table_ref, lens_ref, q_ref, *refs, pages_per_block, scale):
    """One (row, block) step: init at the first block, fold the live pages, write at the last."""
    B = pages_per_block
    kv_refs, s_refs = refs[:B], refs[B : 2 * B]
    out_ref, m_ref, l_ref, acc_ref = refs[2 * B :]
    r, j = pl.program_id(0), pl.program_id(1)
    S = kv_refs[0].shape[1]
    length = lens_ref[r]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for b in range(B):
        start = (j * B + b) * S

        @pl.when(start < length)
        def _page(b=b, start=start):
            _attend_page(
                q_ref, kv_refs[b], s_refs[b], (m_ref, l_ref, acc_ref), start, length, scale
            )

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        l_KG1 = l_ref[...]
        out_ref[...] = (acc_ref[...] / jnp.where(l_KG1 > 0, l_KG1, 1.0)).astype(out_ref.dtype)


def paged_int8_decode(
    q_RHD, pool: Int8Pages, page_table_RN, kv_lens_R, *, scale, pages_per_block=PAGES_PER_BLOCK,
    interpret=False,
):  # fmt: skip
    """softmax(q k^T * scale) v over each row's kv_lens_R tokens of int8 pages: [R, H, D].

    One device's rows and pages (kernels.paged_shard places it on a mesh). `interpret`:
    False compiles with Mosaic (TPU); True or a `pltpu.InterpretParams` runs the TPU
    interpreter (CPU tests).
    """
    R, H, D = q_RHD.shape
    _, S, C, _ = pool.shape
    K, N = C // 2, page_table_RN.shape[1]
    B = max(1, min(pages_per_block, N))
    blocks = -(-N // B)
    table = jnp.pad(page_table_RN.astype(jnp.int32), ((0, 0), (0, blocks * B - N)))
    pages = [_page_map(b, B, pool.shape, blocks * B, 4) for b in range(B)]
    scale_pages = [_page_map(b, B, pool.shape, blocks * B, 3) for b in range(B)]
    row = lambda r, j, *_: (r, 0, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(R, blocks),
        in_specs=[pl.BlockSpec((None, K, H // K, D), row)]
        + [pl.BlockSpec((None, C, S, D), m) for m in pages]
        + [pl.BlockSpec((None, C, S), m) for m in scale_pages],
        out_specs=pl.BlockSpec((None, K, H // K, D), row),
        scratch_shapes=[
            pltpu.VMEM((K, H // K, 1), jnp.float32),
            pltpu.VMEM((K, H // K, 1), jnp.float32),
            pltpu.VMEM((K, H // K, D), jnp.float32),
        ],
    )
    kernel = functools.partial(_kernel, pages_per_block=B, scale=float(scale))
    out_RKGD = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((R, K, H // K, D), q_RHD.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_int8_decode",
    )(
        table.reshape(-1),
        kv_lens_R.astype(jnp.int32),
        q_RHD.reshape(R, K, H // K, D),
        *([pool.values] * B),
        *([pool.scales] * B),
    )
    return out_RKGD.reshape(R, H, D)
