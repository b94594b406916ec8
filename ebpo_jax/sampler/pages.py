"""The paged KV cache of one data shard: page pools, the free mask, and page moves.

Per layer a pool [pages, page_size, 2 * kv_heads, head_dim] (sampler.attention's layout),
or with kv_dtype "int8" an `Int8Pages` of int8 values and a float32 scale per token and
combined head, stored head-major within each page (kernels/quant.py): writes quantize each
token there.
A page is free or held; `take` hands out the lowest free ids, `give_back` frees them. All
functions are fixed-shape and jittable; page id `pages` (one past the last) means "none",
and every scatter drops it, so a row that takes no page writes nowhere.
"""

import jax.numpy as jnp

from ebpo_jax.kernels.quant import Int8Pages, bytes_per_element, quantize, to_pages


def pages_for(tokens, page_size):
    """Pages that hold `tokens` tokens (int or array)."""
    return -(-tokens // page_size)


def page_bytes(config, page_size: int, kv_dtype: str = "", kv_heads: int = 0) -> float:
    """Bytes of one page over every layer's pool (scales included): kv_heads of the config's
    (0: all of them; fewer: a chip's share)."""
    heads = 2 * (kv_heads or config.num_kv_heads)
    per = bytes_per_element(kv_dtype, config.dtype, config.head_dim)
    return page_size * heads * config.head_dim * config.num_layers * per


def pages_in(budget_bytes: float, config, page_size: int, kv_dtype: str = "") -> int:
    """Whole pages a memory budget holds."""
    return int(budget_bytes // page_bytes(config, page_size, kv_dtype))


def init_pools(config, shards: int, pages: int, page_size: int, kv_dtype: str = "") -> tuple:
    """One zero pool per layer, [shards, pages, page_size, 2 * kv_heads, head_dim] each."""
    shape = (shards, pages, page_size, 2 * config.num_kv_heads, config.head_dim)
    if kv_dtype == "int8":
        values = (shards, pages, 2 * config.num_kv_heads, page_size, config.head_dim)
        pool = lambda: Int8Pages(jnp.zeros(values, jnp.int8), jnp.zeros(values[:-1], jnp.float32))
    else:
        pool = lambda: jnp.zeros(shape, config.dtype)
    return tuple(pool() for _ in range(config.num_layers))


def _set(pool, index, x):
    """pool.at[index].set(x) ("none" pages dropped); an Int8Pages quantizes x first.

    index: page ids (x [..., page_size, 2K, D], whole pages) or (page_B, offset_B), one
    token per row (x [B, 2K, D]).
    """
    if not isinstance(pool, Int8Pages):
        return pool.at[index].set(x.astype(pool.dtype), mode="drop")
    if isinstance(index, tuple):  # each row's heads written element-wise, in place
        page_B, offset_B = index
        index = (page_B[:, None], jnp.arange(x.shape[-2])[None], offset_B[:, None])
        values, scales = quantize(x)
    else:
        values, scales = to_pages(x)
    put = lambda a, v: a.at[index].set(v, mode="drop")
    return Int8Pages(put(pool.values, values), put(pool.scales, scales))


def interleave(k_BKD, v_BKD):
    """[B, 2K, D]: key head k at index 2k, its value at 2k + 1."""
    B, K, D = k_BKD.shape
    return jnp.stack([k_BKD, v_BKD], axis=2).reshape(B, 2 * K, D)


def prompt_pages(cache_k_PKTD, cache_v_PKTD, page_size):
    """A prefilled prompt cache (head-major) as pages: [P, ceil(T / page_size), page_size, 2K, D]."""
    P, K, T, D = cache_k_PKTD.shape
    M = pages_for(T, page_size)
    kv_PTCD = jnp.stack([cache_k_PKTD, cache_v_PKTD], axis=2)  # [P, K, 2, T, D]
    kv_PTCD = kv_PTCD.reshape(P, 2 * K, T, D).transpose(0, 2, 1, 3)
    kv_PTCD = jnp.pad(kv_PTCD, ((0, 0), (0, M * page_size - T), (0, 0), (0, 0)))
    return kv_PTCD.reshape(P, M, page_size, 2 * K, D)


def take(free_P, count_C, width: int):
    """(page ids [C, width], free mask): count_C[c] new pages for each c, "none" after them.

    The caller makes sure count_C.sum() pages are free.
    """
    P = free_P.shape[0]
    free_list = jnp.nonzero(free_P, size=P, fill_value=P)[0]
    first_C = jnp.cumsum(count_C) - count_C
    j_W = jnp.arange(width)
    want_CW = j_W[None] < count_C[:, None]
    idx_CW = jnp.minimum(first_C[:, None] + j_W[None], P - 1)
    pages_CW = jnp.where(want_CW, free_list[idx_CW], P)
    return pages_CW, free_P.at[pages_CW].set(False, mode="drop")


def give_back(free_P, pages_CW, mask_CW):
    """The free mask with pages_CW[mask_CW] free again."""
    P = free_P.shape[0]
    return free_P.at[jnp.where(mask_CW, pages_CW, P)].set(True, mode="drop")


def write_token(pool_PSCD, kv_BCD, page_B, offset_B):
    """The pool with row b's new key/value at (page_B[b], offset_B[b]); page "none" drops it."""
    return _set(pool_PSCD, (page_B, offset_B), kv_BCD)


def write_pages(pool_PSCD, src_CWSCD, pages_CW):
    """The pool with src_CWSCD[c, w] copied into page pages_CW[c, w] ("none" skipped)."""
    return _set(pool_PSCD, pages_CW, src_CWSCD)
