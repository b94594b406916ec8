"""Ragged paged decode attention: one query token per row over that row's own KV pages.

Layout (the TPU kernel's own, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`):
one layer's pool `kv_pages_PSCD` is [pages, page_size, 2 * kv_heads, head_dim] with the key
of kv head k at combined index 2k and its value at 2k + 1. Row r's token i sits at
offset i % page_size of page page_table_RN[r, i // page_size]; kv_lens_R[r] tokens are
valid (0: an idle row, whose output is zeros and ignored).

"xla" is hand-written (XLA has no ragged attention): a loop over blocks of page-table
columns, online softmax, that runs only as many blocks as the longest row needs.
"pallas_tpu" / "pallas_gpu" are the Pallas kernels of `ebpo_jax.kernels`, imported only
when asked for.
"""

import importlib.util

import jax
import jax.numpy as jnp

from ebpo_jax.models import attention as model_attention

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
_KERNELS = {
    "pallas_tpu": ("ebpo_jax.kernels.ragged_paged_tpu", "paged_decode_attention_tpu"),
    "pallas_gpu": ("ebpo_jax.kernels.paged_gpu", "paged_decode_attention_gpu"),
}
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) stays 1, never NaN
BLOCK_PAGES = 8  # page-table columns per block of the "xla" loop


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


def paged_decode_attention(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, impl="xla"):
    """out [R, H, D] in q's dtype: softmax(q k / sqrt(D)) v over each row's kv_lens_R tokens."""
    impl = resolve(impl)
    if impl == "xla":
        return _xla(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    module, name = _KERNELS[impl]
    if not _available(impl):
        raise NotImplementedError(
            f"paged attention impl={impl!r} needs {module} (not installed here); use 'xla'"
        )
    kernel = getattr(importlib.import_module(module), name)
    return kernel(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)


def _xla(q_RHD, kv_PSCD, table_RN, lens_R, block_pages=BLOCK_PAGES):
    """The XLA reference: gather a block of each row's pages, masked online softmax."""
    R, H, D = q_RHD.shape
    S, C = kv_PSCD.shape[1], kv_PSCD.shape[2]
    K, N = C // 2, table_RN.shape[1]
    B = min(block_pages, N)
    f32 = jnp.float32
    q_RKGD = q_RHD.reshape(R, K, H // K, D)
    scale = D**-0.5
    num_blocks = (jnp.max(lens_R) + B * S - 1) // (B * S)

    def body(b, carry):
        m_RKG, l_RKG, acc_RKGD = carry
        col_B = b * B + jnp.arange(B)
        pages_RB = table_RN[:, jnp.minimum(col_B, N - 1)]
        kv_RTCD = kv_PSCD[pages_RB].reshape(R, B * S, C, D)
        k_RTKD, v_RTKD = kv_RTCD[:, :, 0::2], kv_RTCD[:, :, 1::2]
        pos_T = (col_B[:, None] * S + jnp.arange(S)[None]).reshape(B * S)
        ok_R11T = (pos_T[None] < lens_R[:, None])[:, None, None]
        logits_RKGT = jnp.einsum("rkgd,rtkd->rkgt", q_RKGD, k_RTKD, preferred_element_type=f32)
        logits_RKGT = jnp.where(ok_R11T, logits_RKGT * scale, _NEG)
        m_new_RKG = jnp.maximum(m_RKG, logits_RKGT.max(-1))
        p_RKGT = jnp.where(ok_R11T, jnp.exp(logits_RKGT - m_new_RKG[..., None]), 0.0)
        rescale_RKG = jnp.exp(m_RKG - m_new_RKG)
        pv_RKGD = jnp.einsum(
            "rkgt,rtkd->rkgd", p_RKGT.astype(q_RHD.dtype), v_RTKD, preferred_element_type=f32
        )
        l_RKG = l_RKG * rescale_RKG + p_RKGT.sum(-1)
        return m_new_RKG, l_RKG, acc_RKGD * rescale_RKG[..., None] + pv_RKGD

    shape = (R, K, H // K)
    init = (jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, D), f32))
    _, l_RKG, acc_RKGD = jax.lax.fori_loop(0, num_blocks, body, init)
    out_RKGD = acc_RKGD / jnp.where(l_RKG > 0, l_RKG, 1.0)[..., None]
    return out_RKGD.reshape(R, H, D).astype(q_RHD.dtype)
