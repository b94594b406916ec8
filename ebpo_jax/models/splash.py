"""Pallas splash attention (TPU) for causal self-attention over right-padded rows.

Selected by `ModelConfig.attention == "splash"`; the plain XLA attention stays the default
(CPU, tests). The kernel never materialises the [T, S] logits, which is what lets 12k-token
training sequences fit. Under a mesh context (`jax.set_mesh`) it runs per shard inside
`shard_map`: rows split over the mesh's `data`/`fsdp` axes, heads over `tp`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tp"


def _kernel(num_heads: int, seq_len: int, block: int, interpret: bool):
    """A causal splash kernel for one row ([H, T, Dh] inputs).

    Built per trace, not cached: its mask metadata becomes constants of the trace it is
    built in (and under a TPU-topology mesh it cannot be made concrete on this host).
    """
    b = min(block, seq_len)
    if seq_len % b:
        raise ValueError(f"splash attention: sequence length {seq_len} is not a multiple of {b}")
    sizes = sa.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len))] * num_heads)
    return sa.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _local(q_BHTd, k_BKTd, v_BKTd, seg_BT, *, block, interpret):
    kernel = _kernel(q_BHTd.shape[1], q_BHTd.shape[2], block, interpret)
    seg = sa.SegmentIds(q=seg_BT, kv=seg_BT)
    return jax.vmap(kernel)(q_BHTd, k_BKTd, v_BKTd, seg)


def mesh_specs(mesh, batch: int, num_heads: int, num_kv_heads: int):
    """(rows spec entry, heads spec entry) for shard_map on `mesh`; errors if they don't divide."""
    rows = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    n_rows = 1
    for a in rows:
        n_rows *= mesh.shape[a]
    if batch % n_rows:
        raise ValueError(
            f"splash attention: batch {batch} does not split over mesh axes {rows} ({n_rows})"
        )
    heads = None
    tp = mesh.shape[HEAD_AXIS] if HEAD_AXIS in mesh.axis_names else 1
    if tp > 1:
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"splash attention: {num_heads} heads / {num_kv_heads} kv heads do not split "
                f"over {HEAD_AXIS}={tp}"
            )
        heads = HEAD_AXIS
    return (rows or None), heads


def _compiling_for_tpu() -> bool:
    """The ambient mesh's device platform (AOT: a TPU topology on a CPU host), else the backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform == "tpu"
    return jax.default_backend() == "tpu"


BLOCK = 512  # default tokens per kernel block: longer rows must be a multiple of it


def attention(q_BTHd, k_BTKd, v_BTKd, segment_ids_BT, *, scale, block=BLOCK, interpret=None):
    """softmax(q k^T * scale) v, causal, query t seeing keys of its own segment id: [B, T, H, Dh].

    Rows are right-padded: with segment id 1 for real tokens and 0 for padding, every real
    query sees exactly the real keys at or before it (the XLA path's mask); padded queries
    see other padding (their outputs are never read). `interpret=True` runs on CPU; None
    means "unless compiling for TPU" (which an AOT compile on a CPU host is).
    """
    if interpret is None:
        interpret = not _compiling_for_tpu()
    B, _, H, _ = q_BTHd.shape
    K = k_BTKd.shape[2]
    to_heads = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, d] -> [B, H, T, d]
    q = to_heads(q_BTHd * jnp.asarray(scale, q_BTHd.dtype))
    k, v = to_heads(k_BTKd.astype(q.dtype)), to_heads(v_BTKd.astype(q.dtype))
    seg = segment_ids_BT.astype(jnp.int32)
    run = functools.partial(_local, block=block, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return to_heads(run(q, k, v, seg))
    rows, heads = mesh_specs(mesh, B, H, K)
    qkv_spec = P(rows, heads, None, None)
    out = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec, P(rows, None)),
        out_specs=qkv_spec,
        check_vma=False,
    )(q, k, v, seg)
    return to_heads(out)
