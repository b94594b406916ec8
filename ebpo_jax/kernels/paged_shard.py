"""Run a per-device paged decode attention under the ambient mesh, with `shard_map`.

A Pallas call is opaque to XLA's partitioner, which would gather the whole KV pool onto
every device; here each device runs the kernel on its own block instead:
  rows (q, page table, lengths)  split over the mesh's `data`/`fsdp` axes,
  the pool's pages               split over the same axes (each row shard owns a pool slab,
                                 and its page table holds indices local to that slab),
  heads                          split over `tp` (query heads and combined K/V heads alike:
                                 K and V interleave per head, so a contiguous split keeps
                                 each shard's pairs together).
"""

import jax
from jax.sharding import PartitionSpec as P

ROW_AXES = ("data", "fsdp")
HEAD_AXIS = "tp"


def _split_axes(mesh, names) -> tuple:
    """The axes of `names` that split arrays here: on the mesh, of size > 1, not already manual
    (inside a caller's shard_map each device holds its block already)."""
    manual = set(mesh.manual_axes)
    return tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)


def mesh_specs(mesh, rows: int, pages: int, heads: int, kv_heads: int):
    """(row/page axes, head axis) for shard_map on `mesh`; ValueError if a size does not split."""
    row_axes = _split_axes(mesh, ROW_AXES)
    n = 1
    for a in row_axes:
        n *= mesh.shape[a]
    if rows % n or pages % n:
        raise ValueError(
            f"paged attention: {rows} rows / {pages} pages do not split over {row_axes} ({n})"
        )
    tp = mesh.shape[HEAD_AXIS] if _split_axes(mesh, (HEAD_AXIS,)) else 1
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"paged attention: {heads} heads / {kv_heads} kv heads do not split over tp={tp}"
        )
    return (row_axes or None), (HEAD_AXIS if tp > 1 else None)


def shard_paged(local_fn, q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R):
    """local_fn(q, kv_pages, page_table, kv_lens) per device of the ambient mesh (if any)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not _split_axes(mesh, (*ROW_AXES, HEAD_AXIS)):
        return local_fn(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
    rows, heads = mesh_specs(
        mesh, q_RHD.shape[0], kv_pages_PSCD.shape[0], q_RHD.shape[1], kv_pages_PSCD.shape[2] // 2
    )
    return jax.shard_map(
        local_fn,
        mesh=mesh,
        in_specs=(P(rows, heads, None), P(rows, None, heads, None), P(rows, None), P(rows)),
        out_specs=P(rows, heads, None),
        check_vma=False,
    )(q_RHD, kv_pages_PSCD, page_table_RN, kv_lens_R)
