"""How the sampler's rows, slots and pages lie over a mesh: split over its data axes.

Each data shard holds its own rows, slots and page pool (leading axis D of every array),
so admission, refills and page moves never cross shards.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import sharding


def data_axes(mesh, axes=None, rules=None) -> tuple:
    """`axes`, or by default the rules table's `batch` axes that the mesh has."""
    if axes is None:
        entry = sharding.logical_to_spec(("batch",), rules, mesh)[0]
        return (entry,) if isinstance(entry, str) else tuple(entry or ())
    return tuple(axes)


def data_size(mesh, axes=None, rules=None) -> int:
    """Data shards of the mesh (1 without a mesh)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in data_axes(mesh, axes, rules)]))


def leading_sharding(mesh, axes=None, rules=None):
    """Axis 0 over the data axes (None without a mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, P(data_axes(mesh, axes, rules)))


def constrain(x, lead_sharding, axis=0):
    """Shards dim `axis` of x over the data axes; other dims left to the compiler."""
    if lead_sharding is None:
        return x
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[axis] = lead_sharding.spec[0]
    return jax.lax.with_sharding_constraint(x, NamedSharding(lead_sharding.mesh, P(*spec)))


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
