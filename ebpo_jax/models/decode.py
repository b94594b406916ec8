"""Decode attention over the valid prefix of a head-major KV cache, block by block.

A decode step's attention reads cache blocks [0, limit) only, limit = the longest valid
prefix in the batch (a traced value), so its cost follows the tokens in the cache, not the
cache's size. Hand-written (online softmax over KV blocks in a `while_loop`) because XLA
has no ragged attention, and the Pallas ragged paged attention ops want a paged cache
([pages, page_size, heads, head_dim]) where this project keeps one [B, K, S, Dh] buffer per
layer, which the sampler updates in place.
"""

import jax
import jax.numpy as jnp

BLOCK = 256  # cache slots per block: decode reads ceil(limit / BLOCK) blocks per row
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) stays 1, never NaN


def attend_prefix(attn, q_BTHd, k_BKSd, v_BKSd, allowed, limit, block=BLOCK):
    """attn.attend_cached over cache slots [0, limit) only; allowed(start, n) -> [B, T, n] bool.

    `allowed(start, n)` says which of slots [start, start + n) each query may see; slots
    >= limit must not be allowed. Equal to the full-cache softmax up to float rounding.
    """
    B, T, H, Dh = q_BTHd.shape
    S = k_BKSd.shape[2]
    if S <= block or attn.invariant:  # one block, or the batch-invariant chunks of its own
        return attn.attend_cached(q_BTHd, k_BKSd, v_BKSd, allowed(0, S))
    K = attn.num_kv_heads
    f32 = jnp.float32
    q_BTKGd = q_BTHd.reshape(B, T, K, H // K, Dh)
    num_blocks = (jnp.minimum(limit, S) + block - 1) // block

    def body(j, carry):
        m_BKGT, l_BKGT, acc_BKGTd = carry
        # The last block may overhang the cache: slide it back and mask the slots it re-reads.
        lo = j * block
        start = jnp.minimum(lo, S - block)
        k_BKCd = jax.lax.dynamic_slice_in_dim(k_BKSd, start, block, axis=2)
        v_BKCd = jax.lax.dynamic_slice_in_dim(v_BKSd, start, block, axis=2)
        ok_BTC = allowed(start, block) & (start + jnp.arange(block) >= lo)[None, None]
        ok_BKGTC = ok_BTC[:, None, None]
        logits_BKGTC = jnp.einsum("btkgd,bkcd->bkgtc", q_BTKGd, k_BKCd, preferred_element_type=f32)
        logits_BKGTC = jnp.where(ok_BKGTC, logits_BKGTC * attn.scale, _NEG)
        m_new_BKGT = jnp.maximum(m_BKGT, logits_BKGTC.max(-1))
        p_BKGTC = jnp.where(ok_BKGTC, jnp.exp(logits_BKGTC - m_new_BKGT[..., None]), 0.0)
        rescale_BKGT = jnp.exp(m_BKGT - m_new_BKGT)
        pv_BKGTd = jnp.einsum(
            "bkgtc,bkcd->bkgtd", p_BKGTC.astype(attn.dtype), v_BKCd, preferred_element_type=f32
        )
        l_BKGT = l_BKGT * rescale_BKGT + p_BKGTC.sum(-1)
        return m_new_BKGT, l_BKGT, acc_BKGTd * rescale_BKGT[..., None] + pv_BKGTd

    shape = (B, K, H // K, T)
    init = (jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, Dh), f32))
    _, l_BKGT, acc_BKGTd = jax.lax.fori_loop(0, num_blocks, body, init)
    # A query with no visible slot (an idle sampler slot) gets zeros, not NaN.
    out_BKGTd = acc_BKGTd / jnp.where(l_BKGT > 0, l_BKGT, 1.0)[..., None]
    out_BTHd = out_BKGTd.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)
    return attn.output(out_BTHd.astype(attn.dtype))
