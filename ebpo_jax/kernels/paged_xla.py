"""Decode attention over a paged KV cache in plain XLA: gather the row's pages, masked softmax.

The CPU path, the GPU fallback, and the reference the Pallas kernels are tested against.
Each row gathers its whole page-table width (pages_per_row * page_size tokens) and masks
the tokens past kv_len, so its cost follows the table width, not the row's length: the
kernels are what read only the row's own pages. An int8 pool (`quant.Int8Pages`) has its
scales folded into the scores and the softmax weights.
"""

import jax
import jax.numpy as jnp

from ebpo_jax.kernels import quant


def check_layout(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R) -> None:
    """One-line ValueError naming the argument whose shape breaks the shared layout."""
    R, H, D = q_RHD.shape
    _, _, C, Dk = kv_pages_PSCD.shape
    quantized = isinstance(kv_pages_PSCD, quant.Int8Pages)
    if quantized and kv_pages_PSCD.scales.shape != kv_pages_PSCD.values.shape[:-1]:
        raise ValueError(
            f"kv_pages_PSCD scales {kv_pages_PSCD.scales.shape}: expected "
            f"{kv_pages_PSCD.values.shape[:-1]} (one per combined head and token, head-major)"
        )
    if C % 2 or H % (C // 2):
        raise ValueError(
            f"kv_pages_PSCD combined heads {C}: need 2 * num_kv_heads dividing 2 * {H} query heads"
        )
    if Dk != D:
        raise ValueError(f"kv_pages_PSCD head_dim {Dk} != q_RHD head_dim {D}")
    if page_table_RN.ndim != 2 or page_table_RN.shape[0] != R:
        raise ValueError(
            f"page_table_RN shape {page_table_RN.shape}: expected ({R}, pages_per_row)"
        )
    if kv_lens_R.shape != (R,):
        raise ValueError(f"kv_lens_R shape {kv_lens_R.shape}: expected ({R},)")


def _rows_of_scales(s_RNK1S, R: int, K: int):
    """Gathered pages' scales [R, N, K, 1, S] as [R, K, 1, N * S] (1.0 stays 1.0)."""
    if isinstance(s_RNK1S, float):
        return s_RNK1S
    return jnp.moveaxis(s_RNK1S, 1, 3).reshape(R, K, 1, -1)


def paged_decode_attention_xla(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, scale=None):
    """softmax(q k^T * scale) v over each row's first kv_len cached tokens: [R, H, D].

    scale defaults to 1/sqrt(head_dim); scores and softmax in float32; idle rows give 0.
    """
    check_layout(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    R, H, D = q_RHD.shape
    C = kv_pages_PSCD.shape[2]
    K = C // 2
    scale = D**-0.5 if scale is None else scale
    kv_RNSKD = quant.split_kv(quant.take(kv_pages_PSCD, page_table_RN), q_RHD.dtype)
    k_RTKD, v_RTKD = (x.reshape(R, -1, K, D) for x in kv_RNSKD[:2])
    ks_RK1T, vs_RK1T = (_rows_of_scales(s, R, K) for s in kv_RNSKD[2:])
    q_RKGD = q_RHD.reshape(R, K, H // K, D)
    s_RKGT = jnp.einsum("rkgd,rtkd->rkgt", q_RKGD, k_RTKD, preferred_element_type=jnp.float32)
    valid_RT = jnp.arange(k_RTKD.shape[1])[None, :] < kv_lens_R[:, None]
    s_RKGT = jnp.where(valid_RT[:, None, None, :], s_RKGT * (ks_RK1T * scale), -jnp.inf)
    # An idle row (kv_len 0) has no valid key: a softmax of all -inf would be NaN.
    p_RKGT = jax.nn.softmax(jnp.where(kv_lens_R[:, None, None, None] > 0, s_RKGT, 0.0), axis=-1)
    out_RKGD = jnp.einsum(
        "rkgt,rtkd->rkgd", (p_RKGT * vs_RK1T).astype(v_RTKD.dtype), v_RTKD,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    out_RHD = out_RKGD.reshape(R, H, D).astype(q_RHD.dtype)
    return jnp.where(kv_lens_R[:, None, None] > 0, out_RHD, 0)
