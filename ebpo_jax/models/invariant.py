"""Batch-invariant numerics (`ModelConfig.batch_invariant`): a row's result never depends on
the rows computed with it.

XLA picks a dot's kernel, and so its accumulation order, from the whole operand's shape (on
CPU one row takes another path than many). Here every per-row computation runs as
`lax.map` over fixed blocks of TILE rows, so each block is the same program on the same
shape whatever the batch: matmuls (contraction whole, never split by row count), norms,
the router, log-softmax and the log-prob gather. Attention walks each query's keys in
position order in chunks of CHUNK tokens (chunk c = positions [c*CHUNK, (c+1)*CHUNK) of
the query's own sequence, aligned at its position 0) with an online softmax combined in
chunk order; chunks past the query's length are skipped (the state is kept, not updated
by zeros), so padding, packing, pages and slots only change where the keys are read from.

Under a mesh whose row axes (data, fsdp) split the rows, each shard blocks its own rows in a
`shard_map`: SPMD does not split a `lax.map` over rows, and would gather them all.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Rows per block: the fewest rows a dot computes (a decode step of one slot pays for TILE),
# and a multiple of the CPU's 8-float registers; measured bitwise in float32 and bfloat16.
TILE = 8
# Keys per attention chunk, in tokens: independent of page size (4 and 16 both divide it
# or are divided by it) and of the row's layout.
CHUNK = 16
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) stays 1, never NaN
# Mesh axes that split rows (sharding.DEFAULT_RULES' "batch"); the mode refuses the others.
ROW_AXES = ("data", "fsdp")


def row_axes(rows: int) -> tuple[str, ...]:
    """The ambient mesh's automatic row axes of size > 1 if they split `rows`, else ()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    names = [a for a in ROW_AXES if a in mesh.axis_names and a not in mesh.manual_axes]
    names = tuple(a for a in names if mesh.shape[a] > 1)
    return names if names and rows % math.prod(mesh.shape[a] for a in names) == 0 else ()


def per_shard(fn, *xs_N, consts=()):
    """fn(*xs_N, *consts) on each row shard's own rows (`shard_map` over `row_axes`), else on all.

    `consts` (weights: pytrees) enter whole on every shard, as FSDP gathers them. fn must not
    close over arrays that need a gradient: one closed over fails to transpose in shard_map.
    """
    axes = row_axes(xs_N[0].shape[0])
    if not axes:
        return fn(*xs_N, *consts)
    rows = P(axes)
    specs = (rows,) * len(xs_N) + (P(),) * len(consts)
    # check_vma=False: the blocks' loops start from replicated constants (a typed carry would
    # need a pcast in every loop); rows stay per shard, so no value is mistyped.
    run = jax.shard_map(fn, in_specs=specs, out_specs=rows, axis_names=set(axes), check_vma=False)
    return run(*xs_N, *consts)


def row_tiles(fn, *xs_N, consts=(), tile: int = TILE):
    """fn(*blocks, *consts) over fixed [tile, ...] blocks of the rows of xs_N, per shard."""
    local = lambda *a: _blocks(lambda *b: fn(*b, *a[len(xs_N) :]), *a[: len(xs_N)], tile=tile)
    return per_shard(local, *xs_N, consts=consts)


def _blocks(fn, *xs_N, tile: int = TILE):
    """fn over fixed [tile, ...] blocks of the leading (row) axis of xs_N; outputs [N, ...]."""
    N = xs_N[0].shape[0]
    # Two blocks at least: XLA inlines a loop of one trip, and the inlined block compiled
    # to other bits (a decode step of <= 8 slots); a loop body compiles the same every time.
    pad = max(-N % tile, 2 * tile - N)

    def blocks(x):
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape(-1, tile, *x.shape[1:])

    out = jax.lax.map(lambda b: fn(*b), tuple(blocks(x) for x in xs_N))
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:N], out)


def cast(w, dtype):
    """w in `dtype` (None: as it is); called inside a block, see `dot`."""
    return w if dtype is None else w.astype(dtype)


def dot(x_NK, w_KM, preferred_element_type=None, dtype=None):
    """x_NK @ w_KM, one fixed [TILE, K] @ [K, M] dot per block of rows, w cast to `dtype` there.

    Cast inside the block, not before the loop: the loop's transpose then sums the blocks'
    gradients of w in w's own dtype (float32), not in the compute dtype (bfloat16).
    """
    dot_ = lambda x, w: jnp.dot(x, cast(w, dtype), preferred_element_type=preferred_element_type)
    return row_tiles(dot_, x_NK, consts=(w_KM,))


def einsum(eq: str, x, w, preferred_element_type=None, dtype=None):
    """einsum(eq, x, w) for eq = "<rows><in>,<in><out>-><rows><out>" by `dot` on flat rows."""
    (lhs, rhs), out = eq.split("->")[0].split(","), eq.split("->")[1]
    n_in = len(set(lhs) & set(rhs))
    rows, ins = lhs[: len(lhs) - n_in], lhs[len(lhs) - n_in :]
    if rhs[:n_in] != ins or out != rows + rhs[n_in:]:
        raise ValueError(f"invariant.einsum: {eq!r} is not rows x in, in x out -> rows x out")
    lead, n_out = x.shape[: len(rows)], w.shape[n_in:]
    x_NK = x.reshape(math.prod(lead), -1)
    y_NM = dot(x_NK, w.reshape(x_NK.shape[1], -1), preferred_element_type, dtype)
    return y_NM.reshape(*lead, *n_out)


def per_row(fn, x, *rest, consts=()):
    """fn(*rows, *consts) on rows of x's last dim (all leading dims flattened), by fixed blocks."""
    lead = x.shape[:-1]
    flat = [a.reshape(-1, *a.shape[len(lead) :]) for a in (x, *rest)]
    out = row_tiles(fn, *flat, consts=consts)
    return jax.tree.map(lambda y: y.reshape(*lead, *y.shape[1:]), out)


def _logp_entropy(logits_TV, tok_T):
    """(log p(tok), entropy) per row of float32 logits: one formula for sampler and trainer."""
    logp_TV = jax.nn.log_softmax(logits_TV.astype(jnp.float32), axis=-1)
    picked_T = jnp.take_along_axis(logp_TV, tok_T[:, None], axis=-1)[:, 0]
    return picked_T, -jnp.sum(jnp.exp(logp_TV) * logp_TV, axis=-1)


def token_logprobs(logits_NV, tok_N):
    """log p(tok) [N] per row of logits [N, V] (the sampler's, from `head` logits)."""
    return row_tiles(lambda lg, t: _logp_entropy(lg, t)[0], logits_NV, tok_N)


def head_logprobs(h_ND, w_DV, tok_N, with_entropy=False, dtype=None):
    """log p(tok) [N] (and entropy) through the head, a block of rows' logits at a time (w_DV
    cast to `dtype` in the block, as in `dot`)."""

    # Rematerialised: the gradient of the loop over blocks would keep every block's [TILE, V]
    # float32 logits and softmax (all the rows' logits, tens of GiB for a long row).
    @jax.checkpoint
    def block(h_TD, t_T, w_DV):
        logits_TV = jnp.dot(h_TD, cast(w_DV, dtype), preferred_element_type=jnp.float32)
        logp, ent = _logp_entropy(logits_TV, t_T)
        return (logp, ent) if with_entropy else logp

    return row_tiles(block, h_ND, tok_N, consts=(w_DV,))


def attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, *, scale, dtype, differentiable=True):
    """out [Q, H, d]: query q's softmax over keys k_NKd[idx_QP[q, p]], p < n_Q[q] (positions).

    A query with n = 0 gives zeros. Each block walks chunks up to its longest query's.
    `differentiable`: the gradient comes from `_dense_attention` (the same function, other
    rounding: only the log-probs need be invariant), so no chunk's softmax state is kept for
    the backward.
    """
    if differentiable:
        return _attention_vjp(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype)
    return _chunked_attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_vjp(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype):
    return _chunked_attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype, False)


def _attention_fwd(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype):
    # A loop of data-dependent length: with a fixed one, XLA:TPU precomputed the masks of all
    # (block, chunk) pairs at once, tens of GiB for a long row.
    out = _chunked_attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype, False)
    return out, (q_QHd, k_NKd, v_NKd, idx_QP, n_Q)


def _attention_bwd(scale, dtype, res, dout_QHd):
    q_QHd, k_NKd, v_NKd, idx_QP, n_Q = res
    dense = lambda q, k, v: _dense_attention(q, k, v, idx_QP, n_Q, scale, dtype)
    _, vjp = jax.vjp(dense, q_QHd, k_NKd, v_NKd)
    return (*vjp(dout_QHd), None, None)


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


def _dense_attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype):
    """`attention`'s function as one softmax per block of queries over all its keys, each
    block recomputed in the backward (jax.checkpoint): what its gradient is taken of."""
    Q, H, d = q_QHd.shape
    K, f32 = k_NKd.shape[1], jnp.float32

    @jax.checkpoint
    def block(q_THd, idx_TP, n_T):
        q_TKGd = q_THd.reshape(TILE, K, H // K, d)
        k_TPKd, v_TPKd = k_NKd[idx_TP], v_NKd[idx_TP]
        ok_T11P = (jnp.arange(idx_TP.shape[1])[None] < n_T[:, None])[:, None, None]
        s = jnp.einsum("tkgd,tpkd->tkgp", q_TKGd, k_TPKd, preferred_element_type=f32) * scale
        p = jnp.where(ok_T11P, jax.nn.softmax(jnp.where(ok_T11P, s, _NEG), axis=-1), 0.0)
        out = jnp.einsum("tkgp,tpkd->tkgd", p.astype(dtype), v_TPKd, preferred_element_type=f32)
        return out.reshape(TILE, H, d).astype(dtype)

    return _blocks(block, q_QHd, idx_QP, n_Q.astype(jnp.int32))


def _chunked_attention(q_QHd, k_NKd, v_NKd, idx_QP, n_Q, scale, dtype, differentiable):
    """`attention`'s forward: fixed key chunks in position order, an online softmax.

    `differentiable`: every block walks all chunks (a fixed trip count, which JAX can
    differentiate); else up to its longest query's. Skipped chunks leave the state as it is,
    so both give the same bits.
    """
    Q, H, d = q_QHd.shape
    K = k_NKd.shape[1]
    if idx_QP.shape[1] % CHUNK:
        idx_QP = jnp.pad(idx_QP, ((0, 0), (0, -idx_QP.shape[1] % CHUNK)))
    f32 = jnp.float32

    def block(q_THd, idx_TP, n_T):
        q_TKGd = q_THd.reshape(TILE, K, H // K, d)

        def step(c, carry):
            m_TKG, l_TKG, acc_TKGd = carry
            idx_TC = jax.lax.dynamic_slice_in_dim(idx_TP, c * CHUNK, CHUNK, axis=1)
            k_TCKd, v_TCKd = k_NKd[idx_TC], v_NKd[idx_TC]
            ok_TC = c * CHUNK + jnp.arange(CHUNK)[None] < n_T[:, None]
            ok_T11C = ok_TC[:, None, None]
            s_TKGC = jnp.einsum("tkgd,tckd->tkgc", q_TKGd, k_TCKd, preferred_element_type=f32)
            s_TKGC = jnp.where(ok_T11C, s_TKGC * scale, _NEG)
            m_new = jnp.maximum(m_TKG, s_TKGC.max(-1))
            p_TKGC = jnp.where(ok_T11C, jnp.exp(s_TKGC - m_new[..., None]), 0.0)
            rescale = jnp.exp(m_TKG - m_new)
            pv_TKGd = jnp.einsum(
                "tkgc,tckd->tkgd", p_TKGC.astype(dtype), v_TCKd, preferred_element_type=f32
            )
            new = (m_new, l_TKG * rescale + p_TKGC.sum(-1), acc_TKGd * rescale[..., None] + pv_TKGd)
            # A chunk past the query's length is skipped, not folded in as zeros.
            live_T = c * CHUNK < n_T
            keep = lambda a, b: jnp.where(live_T.reshape(-1, *(1,) * (a.ndim - 1)), a, b)
            return jax.tree.map(keep, new, carry)

        shape = (TILE, K, H // K)
        init = (jnp.full(shape, _NEG, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, d), f32))
        chunks = idx_TP.shape[1] // CHUNK
        if not differentiable:
            chunks = jnp.minimum((jnp.max(n_T) + CHUNK - 1) // CHUNK, chunks)
        _, l_TKG, acc_TKGd = jax.lax.fori_loop(0, chunks, step, init)
        out_TKGd = acc_TKGd / jnp.where(l_TKG > 0, l_TKG, 1.0)[..., None]
        return out_TKGd.reshape(TILE, H, d).astype(dtype)

    return _blocks(block, q_QHd, idx_QP, n_Q.astype(jnp.int32))


def visible_keys(allowed_BTS):
    """(idx [B*T, P] flat key index of each query's p-th visible key, n [B*T] visible count).

    A query's visible keys, in slot order, are its sequence's positions 0..n-1 (padded,
    packed with shared prompts, grouped completions), so the rank is the key's position.
    """
    B, T, S = allowed_BTS.shape
    rank_BTS = jnp.cumsum(allowed_BTS, axis=-1, dtype=jnp.int32) - 1
    P = S + (-S % CHUNK)
    rank_BTS = jnp.where(allowed_BTS, rank_BTS, P)  # not visible: dropped by the scatter
    key_BS = jnp.broadcast_to(jnp.arange(B)[:, None] * S + jnp.arange(S)[None], (B, S))
    bt = jnp.arange(B * T)[:, None]
    idx = (
        jnp.zeros((B * T, P), jnp.int32)
        .at[bt, rank_BTS.reshape(B * T, S)]
        .set(jnp.broadcast_to(key_BS[:, None], (B, T, S)).reshape(B * T, S), mode="drop")
    )
    return idx, allowed_BTS.sum(-1, dtype=jnp.int32).reshape(B * T)


def attend_masked(q_BTHd, k_BSKd, v_BSKd, allowed_BTS, *, scale, dtype):
    """`attention` of queries [B, T] over their row's keys [B, S] where allowed: [B, T, H, d]."""
    local = functools.partial(_attend_local, scale=scale, dtype=dtype)
    return per_shard(local, q_BTHd, k_BSKd, v_BSKd, allowed_BTS)


def _attend_local(q_BTHd, k_BSKd, v_BSKd, allowed_BTS, *, scale, dtype):
    B, T, H, d = q_BTHd.shape
    S, K = k_BSKd.shape[1], k_BSKd.shape[2]
    idx, n = visible_keys(allowed_BTS)
    flat = lambda x: x.reshape(B * S, K, d)
    out = attention(
        q_BTHd.reshape(B * T, H, d), flat(k_BSKd), flat(v_BSKd), idx, n, scale=scale, dtype=dtype
    )
    return out.reshape(B, T, H, d)


def rope_table(cos_sin_fn, positions, max_positions: int):
    """cos_sin_fn over all positions [0, max_positions) once, gathered at `positions`."""
    cos_PD, sin_PD = cos_sin_fn(jnp.arange(max_positions)[None])
    pos = jnp.clip(positions, 0, max_positions - 1)
    return cos_PD[0][pos], sin_PD[0][pos]
