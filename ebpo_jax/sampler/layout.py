"""How the sampler's rows, slots and pages lie over a mesh: split over its data axes.

Each data shard holds its own rows, slots and page pool (leading axis D of every array),
so admission, refills and page moves never cross shards. With attention data-parallel over
tp (`SamplerSpec.dp_attention`), tp is the last of those axes: a shard per chip.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import sharding

TP = "tp"


def _as_axes(entry) -> tuple:
    """A PartitionSpec entry (None, an axis name or a tuple of them) as a tuple of names."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def data_axes(mesh, axes=None, rules=None, over_tp=False) -> tuple:
    """`axes`, or by default the rules table's `batch` axes that the mesh has, and `tp` after
    them with over_tp (attention data-parallel over the tp chips)."""
    if axes is None:
        axes = _as_axes(sharding.logical_to_spec(("batch",), rules, mesh)[0])
        if over_tp and TP in mesh.axis_names and TP not in axes:
            axes += (TP,)
    return tuple(axes)


def lead_axes(lead_sharding):
    """The mesh axes a `leading_sharding` splits axis 0 over (None without a mesh)."""
    return None if lead_sharding is None else _as_axes(lead_sharding.spec[0])


def _over_tp(lead_sharding):
    """(row axes, those but tp) when the rows split over tp too, else None."""
    axes = lead_axes(lead_sharding)
    if axes is None or TP not in axes:
        return None
    return axes, tuple(a for a in axes if a != TP) or None


def data_size(mesh, axes=None, rules=None, over_tp=False) -> int:
    """Data shards of the mesh (1 without a mesh)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in data_axes(mesh, axes, rules, over_tp)]))


def leading_sharding(mesh, axes=None, rules=None, over_tp=False):
    """Axis 0 over the data axes (None without a mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, P(data_axes(mesh, axes, rules, over_tp)))


def constrain(x, lead_sharding, axis=0):
    """Shards dim `axis` of x over the data axes; other dims left to the compiler."""
    if lead_sharding is None:
        return x
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[axis] = lead_sharding.spec[0]
    return jax.lax.with_sharding_constraint(x, NamedSharding(lead_sharding.mesh, P(*spec)))


def rows_over_tp(q_BTHd, k_BTKd, v_BTKd, lead_sharding):
    """q, k and v with their rows split over the data axes and tp, every head on each chip;
    unchanged without tp in the lead axes.

    One all-to-all per layer moves the three (XLA's own resharding sends each apart, three
    collectives on the decode step's critical path): each chip's heads of q, k and v are
    packed together, their rows dealt out over tp, and the packs unpacked by head.
    """
    split = _over_tp(lead_sharding)
    if split is None:
        return q_BTHd, k_BTKd, v_BTKd
    axes, rows = split
    if axes[-1] != TP:  # chip t of a data shard takes its t-th block of rows
        raise ValueError(f"rows split over {axes}: tp must be the last of the sampler's row axes")
    mesh, tp = lead_sharding.mesh, lead_sharding.mesh.shape[TP]
    dtype = jnp.result_type(q_BTHd, k_BTKd)  # the wider: k and v come back exact
    h, k = q_BTHd.shape[2] // tp, k_BTKd.shape[2] // tp  # heads per chip before the move

    def move(q, k_, v):
        packed = jnp.concatenate([x.astype(dtype) for x in (q, k_, v)], axis=2)
        packed = jax.lax.all_to_all(packed, TP, split_axis=0, concat_axis=2, tiled=True)
        b, t, _, d = packed.shape
        by_chip = packed.reshape(b, t, tp, 2 * k + h, d)
        unpack = lambda lo, n: by_chip[:, :, :, lo : lo + n].reshape(b, t, tp * n, d)
        return unpack(0, h), unpack(h, k), unpack(h + k, k)

    heads = P(rows, None, TP, None)
    q, k_, v = jax.shard_map(
        move, mesh=mesh, in_specs=(heads,) * 3, out_specs=(P(axes, None, None, None),) * 3,
        check_vma=False,
    )(q_BTHd, k_BTKd, v_BTKd)  # fmt: skip
    return q.astype(q_BTHd.dtype), k_.astype(k_BTKd.dtype), v.astype(v_BTKd.dtype)


def heads_split_error(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why `tp` cannot split the attention heads (None when it can): each chip takes whole
    query and kv heads, in the projections, the paged pool and kernels (kernels/paged_shard.py)
    and, with dp attention, before `rows_over_tp`'s all-to-all."""
    if num_heads % tp == 0 and num_kv_heads % tp == 0:
        return None
    return (
        f"tp={tp} does not divide the model's {num_kv_heads} kv heads and {num_heads} query "
        f"heads (each chip takes whole heads); use a tp dividing {np.gcd(num_heads, num_kv_heads)}"
    )


def heads_over_tp(x_BTHd, lead_sharding):
    """Rows over the data axes but tp, heads over tp: attention's output handed back to the
    tp-split output projection (rows split over tp too would gather its weights instead)."""
    split = _over_tp(lead_sharding)
    if split is None:
        return x_BTHd
    spec = P(split[1], None, TP, None)
    return jax.lax.with_sharding_constraint(x_BTHd, NamedSharding(lead_sharding.mesh, spec))


def constrain_tree(tree, lead_sharding):
    return jax.tree.map(lambda x: constrain(x, lead_sharding), tree)


def on_cpu(lead_sharding) -> bool:
    """Whether the program runs on CPU: its mesh's devices, else the default backend.

    There the sampler slices the layer-stacked weights once, before the decode loop: XLA:CPU
    copied every layer's weights on every step. XLA:TPU hoists the slices itself, and
    slicing first held more memory per chip.
    """
    if lead_sharding is not None:
        return lead_sharding.mesh.devices.flat[0].platform == "cpu"
    return jax.default_backend() == "cpu"
