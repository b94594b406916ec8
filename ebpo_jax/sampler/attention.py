"""Ragged paged decode attention: one query token per row over that row's own KV pages.

Layout (the TPU kernel's own, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`):
one layer's pool `kv_pages_PSCD` is [pages, page_size, 2 * kv_heads, head_dim] with the key
of kv head k at combined index 2k and its value at 2k + 1. Row r's token i sits at
offset i % page_size of page page_table_RN[r, i // page_size]; kv_lens_R[r] tokens are
valid (0: an idle row, whose output is zeros and ignored). An int8 pool is a
`kernels.quant.Int8Pages` (int8 values and a float32 scale per token and combined head,
stored head-major within a page): every path folds the scales into the scores and the
softmax weights.

"xla" is hand-written (XLA has no ragged attention): the live pages of all rows as one list,
walked in fixed-size chunks with a per-row online softmax, so a step reads the live tokens
only, however they are spread over the rows.
"pallas_tpu" / "pallas_gpu" are the Pallas kernels of `ebpo_jax.kernels`, imported only
when asked for.
"""

import importlib.util

import jax
import jax.numpy as jnp

from ebpo_jax.kernels import quant
from ebpo_jax.models import attention as model_attention
from ebpo_jax.models import invariant

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
_KERNELS = {
    "pallas_tpu": ("ebpo_jax.kernels.ragged_paged_tpu", "paged_decode_attention_tpu"),
    "pallas_gpu": ("ebpo_jax.kernels.paged_gpu", "paged_decode_attention_gpu"),
}
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) stays 1, never NaN
BLOCK_PAGES = 8  # the "xla" loop's chunk: rows x BLOCK_PAGES pages (fewer if the table is short)


def _available(impl: str) -> bool:
    try:
        return importlib.util.find_spec(_KERNELS[impl][0]) is not None
    except ModuleNotFoundError:
        return False


def resolve(impl: str, platform: str | None = None) -> str:
    """`impl`, or for "auto" the platform's Pallas kernel where it is installed, else "xla"."""
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"paged attention impl={impl!r}; expected one of {IMPLS} or 'auto'")
        return impl
    platform = model_attention.compile_platform() if platform is None else platform
    kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform)
    return kernel if kernel is not None and _available(kernel) else "xla"


def paged_decode_attention(
    q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, impl="xla", row_axes=None
):
    """out [R, H, D] in q's dtype: softmax(q k / sqrt(D)) v over each row's kv_lens_R tokens.

    row_axes: the mesh axes a kernel splits rows and pages over (None: its default,
    data/fsdp); the "xla" path leaves placement to the compiler.
    """
    impl = resolve(impl)
    if impl == "xla":
        q_RHD, kv_pages_PSCD = jnp.asarray(q_RHD), jax.tree.map(jnp.asarray, kv_pages_PSCD)
        page_table_RN, kv_lens_R = jnp.asarray(page_table_RN), jnp.asarray(kv_lens_R)
        return _xla(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    module, name = _KERNELS[impl]
    if not _available(impl):
        raise NotImplementedError(
            f"paged attention impl={impl!r} needs {module} (not installed here); use 'xla'"
        )
    kernel = getattr(importlib.import_module(module), name)
    kwargs = {} if row_axes is None else {"row_axes": tuple(row_axes)}
    return kernel(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, **kwargs)


def _xla(q_RHD, kv_PSCD, table_RN, lens_R):
    """The XLA path: the rows' live pages as one ragged list, walked in chunks.

    Item i of the list is (row, page-table column) of a page that holds valid tokens, rows
    in order; each chunk gathers its pages and its rows' queries and folds the scores into
    each row's online softmax (scatter max / add by row). A chunk is R x BLOCK_PAGES pages
    (read at trace time); a step runs ceil(live pages / chunk) chunks, so its cost follows
    the live tokens, not the longest row.
    """
    R, H, D = q_RHD.shape
    S, C = kv_PSCD.shape[1], kv_PSCD.shape[2]
    K, N = C // 2, table_RN.shape[1]
    chunk = R * min(BLOCK_PAGES, N)
    f32 = jnp.float32
    live_RN = jnp.arange(N)[None] < ((lens_R + S - 1) // S)[:, None]
    num_items = live_RN.sum()
    row_I, col_I = jnp.nonzero(live_RN, size=R * N + chunk, fill_value=0)
    q_RKGD = q_RHD.reshape(R, K, H // K, D)
    scale = D**-0.5

    def body(c, carry):
        m_RKG, l_RKG, acc_RKGD = carry
        i_c = c * chunk + jnp.arange(chunk)
        row_c = jax.lax.dynamic_slice_in_dim(row_I, c * chunk, chunk)
        col_c = jax.lax.dynamic_slice_in_dim(col_I, c * chunk, chunk)
        kv_cSCD = quant.take(kv_PSCD, table_RN[row_c, col_c])
        k_cSKD, v_cSKD, ks_cK1S, vs_cK1S = quant.split_kv(kv_cSCD, q_RHD.dtype)
        pos_cS = col_c[:, None] * S + jnp.arange(S)[None]
        ok_c11S = ((i_c < num_items)[:, None] & (pos_cS < lens_R[row_c][:, None]))[:, None, None]
        logits_cKGS = jnp.einsum(
            "ckgd,cskd->ckgs", q_RKGD[row_c], k_cSKD, preferred_element_type=f32
        )
        logits_cKGS = jnp.where(ok_c11S, logits_cKGS * (ks_cK1S * scale), _NEG)
        m_new_RKG = m_RKG.at[row_c].max(logits_cKGS.max(-1))
        p_cKGS = jnp.where(ok_c11S, jnp.exp(logits_cKGS - m_new_RKG[row_c][..., None]), 0.0)
        rescale_RKG = jnp.exp(m_RKG - m_new_RKG)
        pv_cKGD = jnp.einsum(
            "ckgs,cskd->ckgd", (p_cKGS * vs_cK1S).astype(q_RHD.dtype), v_cSKD,
            preferred_element_type=f32,
        )  # fmt: skip
        l_RKG = (l_RKG * rescale_RKG).at[row_c].add(p_cKGS.sum(-1))
        acc_RKGD = (acc_RKGD * rescale_RKG[..., None]).at[row_c].add(pv_cKGD)
        return m_new_RKG, l_RKG, acc_RKGD

    shape = (R, K, H // K)
    init = (jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, D), f32))
    num_chunks = (num_items + chunk - 1) // chunk
    _, l_RKG, acc_RKGD = jax.lax.fori_loop(0, num_chunks, body, init)
    # A row with no valid token (an idle slot) gets zeros, not NaN.
    out_RKGD = acc_RKGD / jnp.where(l_RKG > 0, l_RKG, 1.0)[..., None]
    return out_RKGD.reshape(R, H, D).astype(q_RHD.dtype)


def paged_invariant(q_RHD, kv_PSCD, table_RN, lens_R):
    """The batch-invariant decode attention (models.invariant): each row's tokens read from
    its pages in position order, in the chunks the trainer's forward uses, so the result
    depends neither on the page size nor on the other rows."""
    R, H, D = q_RHD.shape
    P, S, C = kv_PSCD.shape[:3]
    pos_N = jnp.arange(table_RN.shape[1] * S)
    idx_RN = table_RN[:, pos_N // S] * S + pos_N % S
    flat = lambda x: x.reshape(P * S, C // 2, D)
    k_NKD, v_NKD = flat(kv_PSCD[:, :, 0::2]), flat(kv_PSCD[:, :, 1::2])
    return invariant.attention(
        q_RHD, k_NKD, v_NKD, idx_RN, lens_R, scale=D**-0.5, dtype=q_RHD.dtype, differentiable=False
    )
