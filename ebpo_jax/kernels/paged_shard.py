"""Run a per-device paged decode attention under the ambient mesh, with `shard_map`.

A Pallas call is opaque to XLA's partitioner, which would gather the whole KV pool onto
every device; here each device runs the kernel on its own block instead. Called on one
shard's arrays ([R, ...]):
  rows (q, page table, lengths)  split over the mesh's `data`/`fsdp` axes,
  the pool's pages               split over the same axes (each row shard owns a pool slab,
                                 and its page table holds indices local to that slab),
  heads                          split over `tp` (query heads and combined K/V heads alike:
                                 K and V interleave per head, so a contiguous split keeps
                                 each shard's pairs together), unless the rows are split
                                 over `tp` too (`row_axes` holding it: attention
                                 data-parallel over the tp chips, every head on each).
Vmapped over a leading shard axis D (the sampler engine's [D, ...] rows, pools and page
tables, one pool per data shard), `per_shard`'s batching rule splits D over the data axes
instead and runs each device's shard: a plain vmap of a Pallas call would be replicated.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ebpo_jax.kernels.quant import Int8Pages

ROW_AXES = ("data", "fsdp")
HEAD_AXIS = "tp"


def _split_axes(mesh, names) -> tuple:
    """The axes of `names` that split arrays here: on the mesh, of size > 1, not already manual
    (inside a caller's shard_map each device holds its block already)."""
    manual = set(mesh.manual_axes)
    return tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)


def mesh_specs(mesh, rows: int, pages: int, heads: int, kv_heads: int, row_axes=ROW_AXES):
    """(row/page axes, head axis) for shard_map on `mesh`; ValueError if a size does not split."""
    row_axes = _split_axes(mesh, row_axes)
    n = 1
    for a in row_axes:
        n *= mesh.shape[a]
    if rows % n or pages % n:
        raise ValueError(
            f"paged attention: {rows} rows / {pages} pages do not split over {row_axes} ({n})"
        )
    tp = mesh.shape[HEAD_AXIS] if _split_axes(mesh, (HEAD_AXIS,)) else 1
    tp = 1 if HEAD_AXIS in row_axes else tp
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"paged attention: {heads} heads / {kv_heads} kv heads do not split over tp={tp}"
        )
    return (row_axes or None), (HEAD_AXIS if tp > 1 else None)


def _pool_spec(kv, *lead, heads):
    """The pool's PartitionSpec (an Int8Pages: one for its values, one for its scales)."""
    if isinstance(kv, Int8Pages):  # head-major pages (quant.py)
        return Int8Pages(P(*lead, heads, None, None), P(*lead, heads, None))
    return P(*lead, None, heads, None)


def shard_paged(local_fn, q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, *, row_axes=ROW_AXES):
    """local_fn(q, kv_pages, page_table, kv_lens) per device of the ambient mesh (if any)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not _split_axes(mesh, (*row_axes, HEAD_AXIS)):
        return local_fn(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    rows, heads = mesh_specs(
        mesh, q_RHD.shape[0], kv_pages_PSCD.shape[0], q_RHD.shape[1], kv_pages_PSCD.shape[2] // 2,
        row_axes,
    )  # fmt: skip
    return jax.shard_map(
        local_fn,
        mesh=mesh,
        in_specs=(
            P(rows, heads, None),
            _pool_spec(kv_pages_PSCD, rows, heads=heads),
            P(rows, None),
            P(rows),
        ),  # fmt: skip
        out_specs=P(rows, heads, None),
        check_vma=False,
    )(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)


def _each_shard(local_fn, q_DRHD, kv_DPSCD, table_DRN, lens_DR):
    """local_fn on every index of the leading axis (one per device under shard_map)."""
    if q_DRHD.shape[0] == 1:
        first = jax.tree.map(lambda x: x[0], kv_DPSCD)
        return local_fn(q_DRHD[0], first, table_DRN[0], lens_DR[0])[None]
    return jax.lax.map(lambda a: local_fn(*a), (q_DRHD, kv_DPSCD, table_DRN, lens_DR))


def shard_leading(local_fn, q_DRHD, kv_DPSCD, table_DRN, lens_DR, *, row_axes=ROW_AXES):
    """local_fn per data shard of [D, ...] arrays: D over row_axes, heads over tp (if free)."""
    mesh = jax.sharding.get_abstract_mesh()
    each = lambda *a: _each_shard(local_fn, *a)
    if mesh.empty or not _split_axes(mesh, (*row_axes, HEAD_AXIS)):
        return each(q_DRHD, kv_DPSCD, table_DRN, lens_DR)
    D, _, H, _ = q_DRHD.shape
    shards, heads = mesh_specs(mesh, D, D, H, kv_DPSCD.shape[3] // 2, row_axes)
    return jax.shard_map(
        each,
        mesh=mesh,
        in_specs=(
            P(shards, None, heads, None),
            _pool_spec(kv_DPSCD, shards, None, heads=heads),
            P(shards, None),
            P(shards),
        ),
        out_specs=P(shards, None, heads, None),
        check_vma=False,
    )(q_DRHD, kv_DPSCD, table_DRN, lens_DR)


def _splits(q_RHD, kv_pages_PSCD, row_axes) -> bool:
    """Whether rows, pages and heads divide over the ambient mesh's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    try:
        mesh_specs(mesh, q_RHD.shape[0], kv_pages_PSCD.shape[0], q_RHD.shape[1],
                   kv_pages_PSCD.shape[2] // 2, row_axes)  # fmt: skip
    except ValueError:
        return False
    return True


def per_shard(local_fn, row_axes=ROW_AXES):
    """local_fn(q, kv_pages, page_table, kv_lens) for one shard's arrays, placed on the mesh
    by `shard_paged`, or vmapped over a leading shard axis, by `shard_leading`; rows and
    pages split over the mesh's `row_axes`.

    The unbatched function is traced even when the call is vmapped (custom_vmap's primal),
    so it cannot refuse shapes that do not divide the mesh: those run unsplit.
    """

    @jax.custom_batching.custom_vmap
    def attend(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R):
        if not _splits(q_RHD, kv_pages_PSCD, row_axes):
            return local_fn(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
        return shard_paged(
            local_fn, q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R, row_axes=row_axes
        )

    @attend.def_vmap
    def _batched(axis_size, in_batched, *args):
        full = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
        args = [jax.tree.map(full, x, b) for x, b in zip(args, in_batched)]
        return shard_leading(local_fn, *args, row_axes=row_axes), True

    return attend
