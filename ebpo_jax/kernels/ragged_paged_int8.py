# Forked from jax/experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py (JAX 0.10.2),
# Copyright 2025 The JAX Authors, Apache License 2.0.
"""JAX's TPU ragged paged attention kernel, reading int8 pages with per-token scale pages.

The stock kernel takes int8 pages with one static scale per tensor. This copy adds a
second HBM input, the scales of `quant.Int8Pages` seen head-major, [pages, 2K, page_size]
float32, whose pages are DMA'd beside each block's KV pages into a double buffer of their
own. The int8 keys and values are cast exactly to q's dtype; each kv head's
key scales multiply its scores and its value scales the softmax weights, as the XLA path
does. Head-major, a scale page is lane-dense ([2K, 128] for pages of 128 tokens) in HBM and
VMEM, where [page_size, 2K] would pad 2K to 128 lanes (8x at 2K = 16). What changed from
upstream: the scale input, buffers, copies and folding (`_scale_row`, `flash_attention`'s ks
and vs); sliding window, soft cap, static scales and the input checks are dropped
(`paged_xla.check_layout` checks the layout).

`interpret=True` runs Pallas' TPU interpreter, which takes no reshaped or bitcast refs and
misplaces masked stores in JAX 0.10.2: there the K/V heads are read by indexing the
buffer's value instead of upstream's strided uint32 loads, and a masked store is a
read-select-write (the only code that differs between the two modes).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dtypes
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)
LANES = 128


class _PageCopies:
    """The async copies of one block's pages (upstream's MultiPageAsyncCopyDescriptor)."""

    def __init__(self, pages_hbm_ref, vmem_buf, sem, page_indices_ref, metadata):
        self._vmem_buf = vmem_buf
        seq_id, start_page_idx, end_page_idx = metadata
        self._copies = []
        for i in range(vmem_buf.shape[0]):
            page_idx = start_page_idx + i
            page_idx = lax.select(page_idx < end_page_idx, page_idx, 0)
            self._copies.append(
                pltpu.make_async_copy(
                    pages_hbm_ref.at[page_indices_ref[seq_id, page_idx]], vmem_buf.at[i], sem
                )
            )

    def start(self):
        for c in self._copies:
            c.start()

    def wait(self):
        for c in self._copies:
            c.wait()
        return self._vmem_buf


def _packing(dtype) -> int:
    return 32 // dtypes.itemsize_bits(dtype)


def _strided_load_kv(ref, start, step):
    """Upstream's K/V head loads from a [tokens * combined heads, D] ref of packed int8."""
    packing = _packing(ref.dtype)
    if packing == 1:
        return [ref[start::step, :]], [ref[start + 1 :: step, :]]
    b = ref.bitcast(jnp.uint32)[start // packing :: step // packing, :]
    bitwidth = 32 // packing
    narrow = jnp.dtype(f"uint{bitwidth}")
    k_list, v_list = [], []
    for i in range(0, packing, 2):
        k_list.append(pltpu.bitcast((b >> (i * bitwidth)).astype(narrow), ref.dtype))
        v_list.append(pltpu.bitcast((b >> ((i + 1) * bitwidth)).astype(narrow), ref.dtype))
    return k_list, v_list


def _indexed_load_kv(buf_ref, start, count):
    """The same heads read by indexing the buffer's value (Pallas' interpreter)."""
    pages, page_size, heads, head_dim = buf_ref.shape
    kv = buf_ref[...].reshape(pages * page_size, heads, head_dim)
    return [kv[:, start + 2 * i] for i in range(count)], [
        kv[:, start + 2 * i + 1] for i in range(count)
    ]


def _scale_row(scales_NCS, c):
    """[1, N * S]: combined head c's (traced) token scales over the block's N pages, by a
    masked sublane sum (no dynamic slice), pages side by side along lanes."""
    row_NCS = lax.broadcasted_iota(jnp.int32, scales_NCS.shape, 1)
    rows_NS = jnp.sum(jnp.where(row_NCS == c, scales_NCS, 0.0), axis=1)
    return jnp.concatenate([rows_NS[i : i + 1] for i in range(rows_NS.shape[0])], axis=1)


def _exact_cast(x_TD, dtype):
    """int8 values in `dtype` (exact: |x| <= 127), through float32 as upstream casts."""
    return x_TD.astype(jnp.float32).astype(dtype)


def _kernel(
    kv_lens_ref,  # [max_num_seqs]
    page_indices_ref,  # [max_num_seqs, pages_per_seq]
    cu_q_lens_ref,  # [max_num_seqs + 1]
    seq_buf_idx_ref,
    num_seqs_ref,
    q_ref,  # [num_q_per_blk, num_q_heads_per_blk, head_dim]
    kv_pages_hbm_ref,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_scales_hbm_ref,  # [total_num_pages, num_combined_kv_heads, page_size]
    o_ref,
    kv_bufs,  # [2, num_kv_pages_per_blk, page_size, num_combined_kv_heads_per_blk, head_dim]
    scale_bufs,  # [2, num_kv_pages_per_blk, num_combined_kv_heads, page_size]
    sems,  # [2]
    l_ref,  # [num_kv_heads_per_blk, num_q_per_blk * num_q_heads_per_kv_head, 128]
    m_ref,
    acc_ref,  # [num_q_per_blk, num_q_heads_per_blk, head_dim]
    *,
    sm_scale: float,
    interpret: bool,
):
    num_q_per_blk, num_q_heads_per_blk, head_dim = q_ref.shape
    pages_per_seq = page_indices_ref.shape[-1]
    num_seqs = num_seqs_ref[0]
    _, num_kv_pages_per_blk, page_size, num_combined_kv_heads_per_blk, _ = kv_bufs.shape
    num_kv_heads_per_blk = num_combined_kv_heads_per_blk // 2
    num_kv_per_blk = num_kv_pages_per_blk * page_size
    num_q_heads_per_kv_head = num_q_heads_per_blk // num_kv_heads_per_blk
    heads_blk_idx, q_blk_idx = pl.program_id(0), pl.program_id(1)
    num_heads_blks = pl.num_programs(0)
    init_seq_idx = seq_buf_idx_ref[0]
    init_buf_idx = seq_buf_idx_ref[1]
    q_len_start = q_blk_idx * num_q_per_blk
    q_len_end = q_len_start + num_q_per_blk

    def copies(heads_blk_idx, seq_idx, kv_blk_idx, buf_idx):
        """The block's KV page copies and its scale page copies (every head's scales)."""
        start = kv_blk_idx * num_kv_pages_per_blk
        end = jnp.minimum(pages_per_seq, pl.cdiv(kv_lens_ref[seq_idx], page_size))
        metadata = (seq_idx, start, end)
        heads_start = heads_blk_idx * num_combined_kv_heads_per_blk
        kv = _PageCopies(
            kv_pages_hbm_ref.at[:, :, pl.ds(heads_start, num_combined_kv_heads_per_blk), :],
            kv_bufs.at[buf_idx], sems.at[buf_idx], page_indices_ref, metadata,
        )  # fmt: skip
        scales = _PageCopies(
            kv_scales_hbm_ref, scale_bufs.at[buf_idx], sems.at[buf_idx], page_indices_ref,
            metadata,
        )  # fmt: skip
        return kv, scales

    def start(*ids):
        for c in copies(*ids):
            c.start()

    def fold_on_2nd_minor(vec):
        packing = _packing(vec.dtype)
        if vec.shape[-2] % packing != 0:
            vec = vec.astype(jnp.float32)
        return vec.reshape(-1, vec.shape[-1])

    @pl.when(heads_blk_idx + q_blk_idx == 0)
    def prefetch_first_kv_blk():
        start(heads_blk_idx, init_seq_idx, 0, init_buf_idx)

    def is_cur_q_blk_needed(q_states):
        done, cur_seq_idx, _ = q_states
        should_run = jnp.logical_and(q_len_start < cu_q_lens_ref[num_seqs], cur_seq_idx < num_seqs)
        return jnp.logical_and(done == 0, should_run)

    def compute_with_cur_q_blk(q_states):
        done, cur_seq_idx, cur_buf_idx = q_states
        q_start = cu_q_lens_ref[cur_seq_idx]
        q_end = cu_q_lens_ref[cur_seq_idx + 1]
        q_len = q_end - q_start
        kv_len = kv_lens_ref[cur_seq_idx]

        def get_next_prefetch_ids(heads_blk_idx, cur_seq_idx, kv_blk_idx, cur_buf_idx):
            next_kv_blk_idx = kv_blk_idx + 1
            is_last_kv_blk = next_kv_blk_idx * num_kv_per_blk >= kv_len
            next_kv_blk_idx = lax.select(is_last_kv_blk, 0, next_kv_blk_idx)
            is_cur_seq_end_in_cur_q_blk = q_end <= q_len_end
            next_seq_idx = lax.select(
                is_last_kv_blk,
                lax.select(is_cur_seq_end_in_cur_q_blk, cur_seq_idx + 1, cur_seq_idx),
                cur_seq_idx,
            )
            is_last_seq = next_seq_idx == num_seqs
            next_seq_idx = lax.select(is_last_seq, 0, next_seq_idx)
            next_heads_blk_idx = lax.select(is_last_seq, heads_blk_idx + 1, heads_blk_idx)
            next_buf_idx = lax.select(cur_buf_idx == 0, 1, 0)
            return next_heads_blk_idx, next_seq_idx, next_kv_blk_idx, next_buf_idx

        def flash_attention(q, k, v, ks, vs, head_l_ref, head_m_ref, head_acc_ref, *, kv_blk_idx):
            """Upstream's online-softmax block (no sliding window, no soft cap), with the key
            scales ks [1, T] folded into the scores and the value scales vs into the weights."""
            kv_len_start = kv_blk_idx * num_kv_per_blk

            def masked_store(ref, val, start, end, group=1):
                iota = lax.broadcasted_iota(jnp.int32, ref.shape, 0) // group
                mask = jnp.logical_and(iota >= start, iota < end)
                if interpret:  # its masked store checks bounds on the wrong axes (0.10.2)
                    ref[...] = jnp.where(mask, val, ref[...])
                else:
                    pltpu.store(ref, val, mask=mask)

            def load_with_init(ref, init_val):
                return jnp.where(kv_blk_idx == 0, jnp.full_like(ref, init_val), ref[...])

            # kv lens will be contracting dim, we should mask out the NaNs.
            kv_mask = lax.broadcasted_iota(jnp.int32, k.shape, 0) < kv_len - kv_len_start
            k = jnp.where(kv_mask, k.astype(jnp.float32), 0).astype(k.dtype)
            v = jnp.where(kv_mask, v.astype(jnp.float32), 0).astype(v.dtype)
            # Past kv_len the scale pages are stale (or page 0's): zero them like k and v.
            valid = lax.broadcasted_iota(jnp.int32, ks.shape, 1) < kv_len - kv_len_start
            ks, vs = jnp.where(valid, ks, 0.0), jnp.where(valid, vs, 0.0)
            qk = jnp.einsum("nd,md->nm", q, k, preferred_element_type=jnp.float32)
            qk = qk * (ks * sm_scale)
            store_start = jnp.maximum(q_start - q_len_start, 0)
            store_end = jnp.minimum(q_end - q_len_start, num_q_per_blk)
            shape = (num_q_per_blk * num_q_heads_per_kv_head, num_kv_per_blk)
            row_ids = (kv_len - q_len) + q_len_start - q_start
            row_ids += lax.broadcasted_iota(jnp.int32, shape, 0) // num_q_heads_per_kv_head
            col_ids = kv_len_start + lax.broadcasted_iota(jnp.int32, shape, 1)
            qk += jnp.where(row_ids < col_ids, MASK_VALUE, 0.0)
            m_curr = jnp.max(qk, axis=1, keepdims=True)
            s_curr = jnp.exp(qk - m_curr)
            qkv = jnp.dot(s_curr * vs, v, preferred_element_type=jnp.float32)
            lm_store_shape = head_m_ref.shape
            m_curr = jnp.broadcast_to(m_curr, lm_store_shape)
            l_curr = jnp.broadcast_to(s_curr.sum(axis=1, keepdims=True), lm_store_shape)
            m_prev = load_with_init(head_m_ref, -jnp.inf)
            l_prev = load_with_init(head_l_ref, 0.0)
            m_next = jnp.maximum(m_prev, m_curr)
            masked_store(head_m_ref, m_next, store_start, store_end, num_q_heads_per_kv_head)
            alpha = jnp.exp(m_prev - m_next)
            beta = jnp.exp(m_curr - m_next)
            l_alpha = alpha * l_prev
            l_next = l_alpha + beta * l_curr
            l_next_safe = jnp.where(l_next == 0.0, 1.0, l_next)
            masked_store(head_l_ref, l_next_safe, store_start, store_end, num_q_heads_per_kv_head)

            def broadcast_to_shape(arr, shape):
                if arr.shape == shape:
                    return arr
                return jnp.concatenate([arr for _ in range(shape[1] // arr.shape[1])], axis=1)

            o_curr = load_with_init(head_acc_ref, 0.0).reshape(-1, head_dim)
            l_alpha = broadcast_to_shape(l_alpha, qkv.shape)
            beta = broadcast_to_shape(beta, qkv.shape)
            l_next_safe = broadcast_to_shape(l_next_safe, qkv.shape)
            out = lax.div(l_alpha * o_curr + beta * qkv, l_next_safe)
            masked_store(head_acc_ref, out.reshape(head_acc_ref.shape), store_start, store_end)

        def is_valid_kv_blk_in_cur_seq(kv_states):
            kv_blk_idx, _ = kv_states
            return kv_blk_idx * num_kv_per_blk < kv_len

        def compute_with_kv_blk_in_cur_seq(kv_states):
            kv_blk_idx, cur_buf_idx = kv_states
            next_ids = get_next_prefetch_ids(heads_blk_idx, cur_seq_idx, kv_blk_idx, cur_buf_idx)
            next_buf_idx = next_ids[-1]

            @pl.when(next_ids[0] < num_heads_blks)
            def prefetch_next_kv_blk():
                start(*next_ids)

            kv_copies, scale_copies = copies(heads_blk_idx, cur_seq_idx, kv_blk_idx, cur_buf_idx)
            buf_ref = kv_copies.wait()
            scales_NCS = scale_copies.wait()[...]
            heads_start = heads_blk_idx * num_combined_kv_heads_per_blk
            # Upstream loads packed heads together: 2 kv heads per uint32 load for int8.
            step = 1 if interpret else max(1, _packing(buf_ref.dtype) // 2)
            for chunk in range(0, num_kv_heads_per_blk, step):
                if interpret:
                    k_list, v_list = _indexed_load_kv(buf_ref, chunk * 2, step)
                else:
                    flat = buf_ref.reshape(num_kv_per_blk * num_combined_kv_heads_per_blk, head_dim)
                    k_list, v_list = _strided_load_kv(
                        flat, chunk * 2, num_combined_kv_heads_per_blk
                    )
                for i in range(step):
                    kv_head_idx = chunk + i
                    c = heads_start + 2 * kv_head_idx
                    k, v = (_exact_cast(x[i], q_ref.dtype) for x in (k_list, v_list))
                    ks, vs = _scale_row(scales_NCS, c), _scale_row(scales_NCS, c + 1)
                    q_head_idx = kv_head_idx * num_q_heads_per_kv_head
                    q = fold_on_2nd_minor(
                        q_ref[:, q_head_idx : q_head_idx + num_q_heads_per_kv_head, :]
                    )
                    flash_attention(
                        q, k, v, ks, vs, l_ref.at[kv_head_idx], m_ref.at[kv_head_idx],
                        acc_ref.at[:, q_head_idx : q_head_idx + num_q_heads_per_kv_head, :],
                        kv_blk_idx=kv_blk_idx,
                    )  # fmt: skip
            return kv_blk_idx + 1, next_buf_idx

        _, next_buf_idx = lax.while_loop(
            is_valid_kv_blk_in_cur_seq, compute_with_kv_blk_in_cur_seq, (0, cur_buf_idx)
        )
        next_seq_idx = lax.select(q_end <= q_len_end, cur_seq_idx + 1, cur_seq_idx)
        done = lax.select(q_end < q_len_end, done, 1)
        return done, next_seq_idx, next_buf_idx

    _, seq_idx, buf_idx = lax.while_loop(
        is_cur_q_blk_needed, compute_with_cur_q_blk, (0, init_seq_idx, init_buf_idx)
    )
    # Reset seq_idx for next kv_heads_blk if run out of seqs!
    seq_buf_idx_ref[0] = lax.select(seq_idx < num_seqs, seq_idx, 0)
    seq_buf_idx_ref[1] = buf_idx
    o_ref[...] = acc_ref[...].astype(q_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "num_kv_pages_per_block", "num_queries_per_block", "interpret"),
)
def ragged_paged_attention_int8(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # int8 [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_scales,  # float32 [total_num_pages, num_combined_kv_heads, page_size]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float,
    num_kv_pages_per_block: int,
    num_queries_per_block: int,
    interpret: bool = False,
):
    """Ragged paged attention over int8 pages with a scale per token and combined head."""
    num_q_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    heads_per_blk, combined_per_blk = get_min_heads_per_blk(
        num_q_heads, num_combined_kv_heads, q.dtype, kv_pages.dtype
    )
    num_q_per_blk, pages_per_blk = num_queries_per_block, num_kv_pages_per_block
    num_q_heads_per_kv_head = num_q_heads // num_kv_heads
    grid = (num_q_heads // heads_per_blk, pl.cdiv(num_q_tokens, num_q_per_blk))
    q_block_spec = pl.BlockSpec(
        (num_q_per_blk, heads_per_blk, head_dim), lambda h, i, *_: (i, h, 0)
    )
    lm_scratch = pltpu.VMEM(
        (combined_per_blk // 2, num_q_per_blk * num_q_heads_per_kv_head, LANES), jnp.float32
    )
    scratch_shapes = [
        pltpu.VMEM((2, pages_per_blk, page_size, combined_per_blk, head_dim), kv_pages.dtype),
        pltpu.VMEM((2, pages_per_blk, num_combined_kv_heads, page_size), jnp.float32),
        pltpu.SemaphoreType.DMA((2,)),
        lm_scratch,  # l_ref
        lm_scratch,  # m_ref
        pltpu.VMEM((num_q_per_blk, heads_per_blk, head_dim), jnp.float32),
    ]
    scalar_prefetches = (
        kv_lens, page_indices, cu_q_lens, jnp.array((0, 0), jnp.int32), num_seqs
    )  # fmt: skip
    kernel = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, interpret=interpret),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetches),
            in_specs=[
                q_block_spec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=q_block_spec,
            grid=grid,
            scratch_shapes=scratch_shapes,
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(shape=q.shape, dtype=q.dtype),
        name="ragged_paged_attention_int8_kernel",
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    return kernel(*scalar_prefetches, q, kv_pages, kv_scales)
