"""Device mesh from a config, and logical axis names -> mesh axes through one rules table.

Parameters carry logical axis names (`nnx.Param(..., axes=("embed", "mlp"))`); activations are
named where they are made (`constrain(x, ("batch", "seq", "act_embed"), rules)`). The rules
table alone decides the parallelism: the default is FSDP over `fsdp`, tensor parallelism over
`tp`, rows over `data` x `fsdp` and, where the mesh has a `context` axis, each row's tokens
over it (context parallelism: attention gathers the keys and values of the whole row, `kv_seq`).
Knows nothing of the model.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tp")

# Logical name -> mesh axis, tuple of mesh axes, or None (replicated). Activation names are
# separate from parameter names because FSDP shards the `embed` dim of weights, not of the
# residual stream (which is already split over rows).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", "context"),  # a mesh without a `context` axis leaves the sequence whole
    ("kv_seq", None),  # keys and values as attention reads them: the whole row on each chip
    ("layers", None),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("norm", None),
    ("lora_rank", None),
    ("expert", "fsdp"),  # expert parallelism: MoE experts split over the FSDP axis
    ("moe_mlp", "tp"),
    ("router", None),  # LoRA adapters' rank dim: small, never split
    ("act_embed", None),
    ("act_mlp", "tp"),
    ("act_heads", "tp"),
    ("act_kv_heads", "tp"),
    ("act_vocab", "tp"),
)


def make_mesh(spec, devices=None) -> Mesh:
    """Mesh with Auto axes from `[(axis, size), ...]`, a mesh section or the run's `spec.MeshSpec`.

    One size may be -1: the devices that remain. Over `devices`, else over the first
    `mesh.devices` devices of a MeshSpec (0 = every device; fewer than every device in one
    process only); over every device, `jax.make_mesh` lays the axes out along the topology.
    """
    n = 0
    if hasattr(spec, "mesh"):  # a MeshSpec: its section's axes and devices, the resolved shape
        axes, shape, n = tuple(spec.mesh.axes), tuple(int(s) for s in spec.shape), spec.mesh.devices
    elif hasattr(spec, "axes"):  # a mesh section (schema.Mesh or the config's `mesh`)
        axes, shape = tuple(spec.axes), tuple(int(s) for s in spec.shape)
    else:
        axes, shape = tuple(a for a, _ in spec), tuple(int(s) for _, s in spec)
    if len(axes) != len(shape) or len(set(axes)) != len(axes):
        raise ValueError(f"mesh axes {axes} and shape {shape} must pair up, names unique")
    auto = (AxisType.Auto,) * len(axes)
    if devices is None:
        n = n or jax.device_count()
        if n < jax.device_count() and jax.process_count() > 1:
            raise ValueError(
                f"mesh.devices={n}: a multi-process run's mesh must span all {jax.device_count()}"
            )
        if n == jax.device_count():
            return jax.make_mesh(resolve_shape(shape, n), axes, axis_types=auto)
        devices = jax.devices()[:n]
    devices = list(devices)
    grid = np.asarray(devices).reshape(resolve_shape(shape, len(devices)))
    return Mesh(grid, axes, axis_types=auto)


def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """`shape` with its one -1 replaced by the devices that remain; ValueError if impossible."""
    shape = tuple(int(s) for s in shape)
    if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: sizes must be positive, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh shape {shape} does not divide the {num_devices} devices")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {num_devices}")
    return shape


def parse_mesh(text: str) -> list[tuple[str, int]]:
    """`data=8,tp=4` -> [("data", 8), ("tp", 4)] (-1 allowed once)."""
    try:
        pairs = [p.split("=") for p in text.split(",") if p]
        return [(a.strip(), int(s)) for a, s in pairs]
    except ValueError:
        raise ValueError(f"mesh {text!r} is not like 'data=8,tp=4'") from None


def rules_from(config=None, rules=None) -> dict:
    """The rules as a dict: `rules` if given, else `config.sharding_rules`, else DEFAULT_RULES."""
    if rules is None:
        rules = getattr(config, "sharding_rules", None) or DEFAULT_RULES
    if isinstance(rules, dict):
        return rules
    table = {}
    for pair in rules:
        if len(pair) != 2:
            raise ValueError(f"sharding rule {pair!r} is not a (logical name, mesh axes) pair")
        name, axes = pair
        table[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return table


def logical_to_spec(names: Sequence[str | None], rules, mesh=None, shape=None, what="array") -> P:
    """PartitionSpec for an array whose dims have logical `names`.

    A mesh axis absent from `mesh` is skipped, and one already used by an earlier dim is not
    reused. With `shape`, a dim its mesh axes don't divide raises (naming `what`).
    """
    table = rules_from(rules=rules)
    mesh_shape = dict(mesh.shape) if mesh is not None else None
    used, spec = set(), []
    for d, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"{what}: logical axis {name!r} has no sharding rule; known: {sorted(table)}"
            )
        axes = tuple(
            a for a in table[name] if a not in used and (mesh_shape is None or a in mesh_shape)
        )
        if shape is not None and mesh_shape is not None:
            n = math.prod(mesh_shape[a] for a in axes)
            if shape[d] % n:
                raise ValueError(
                    f"{what}: dim {d} ({name}={shape[d]}) does not split over mesh axes {axes} ({n})"
                )
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def _is_var(x):
    return isinstance(x, nnx.Variable)


def _quantized(value) -> bool:
    # A quantized weight (qwix's QArray) by its fields: this module knows nothing of qwix.
    return hasattr(value, "qvalue") and hasattr(value, "scale")


def param_specs(params, rules=None, mesh=None):
    """Pytree (like params) of PartitionSpecs from each Param's `axes` metadata; a quantized
    weight's values split like the weight, its scales likewise but whole along the dims
    they reduce."""
    table = rules_from(rules=rules)

    def spec(path, leaf):
        names = leaf.get_metadata().get("axes") if _is_var(leaf) else None
        value = leaf.get_value() if _is_var(leaf) else leaf
        if names is None:
            return leaf.replace(value=P()) if _is_var(leaf) else P()
        where = "param " + jax.tree_util.keystr(path)
        out = logical_to_spec(names, table, mesh, tuple(value.shape), where)
        if not _quantized(value):
            return leaf.replace(value=out)
        s_shape = tuple(value.scale.shape)
        s_names = [n if s == d else None for n, s, d in zip(names, s_shape, value.shape)]
        s_spec = logical_to_spec(s_names, table, mesh, s_shape, where)
        return leaf.replace(value=dataclasses.replace(value, qvalue=out, scale=s_spec))

    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)
    return jax.tree_util.tree_unflatten(treedef, [spec(path, leaf) for path, leaf in flat])


def param_shardings(config, params, mesh: Mesh, rules=None):
    """Pytree (like params) of NamedShardings; rules default to config.sharding_rules."""
    table = rules_from(config, rules)
    specs = param_specs(params, table, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(config, params, mesh: Mesh, rules=None):
    """`params` placed on `mesh` by the rules (device_put; params may be abstract-free arrays)."""
    return jax.device_put(params, param_shardings(config, params, mesh, rules))


def rows_spec(mesh: Mesh, rows: int, rules=None, axis: int = 0) -> P:
    """Dim `axis` over the batch axes; P() (replicated) when they don't divide `rows`."""
    names = (None,) * axis + ("batch",)
    spec = logical_to_spec(names, rules, mesh)
    entry = spec[axis]
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return spec if rows % math.prod(mesh.shape[a] for a in axes) == 0 else P()


def rows_sharding(mesh: Mesh, rows: int, rules=None, axis: int = 0) -> NamedSharding:
    """`rows_spec` on `mesh`."""
    return NamedSharding(mesh, rows_spec(mesh, rows, rules, axis))


def shards_of(name: str, rules=None, mesh=None) -> int:
    """Devices logical axis `name` is split over on `mesh` (default: the ambient one, else 1)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return 1
    entry = logical_to_spec((name,), rules, mesh)[0]
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[a] for a in axes)


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Slot order [length] whose contiguous split over `shards` gives shard i the row's chunks
    i and 2*shards-1-i of 2*shards: each shard then holds as many causal (query, key) pairs."""
    if length % (2 * shards):
        raise ValueError(f"a row of {length} tokens does not split into 2 x {shards} equal chunks")
    chunks = np.arange(length).reshape(2 * shards, -1)
    pairs = [np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)]
    return np.concatenate(pairs)


def batch_sharded(tree, mesh: Mesh, rows: int, rules=None, axis: int = 0, strict: bool = True):
    """Shardings splitting every leaf whose dim `axis` is `rows` over the batch axes.

    Other leaves are replicated. Rows the batch axes don't divide raise (naming them), or
    with `strict=False` stay replicated (e.g. 4 prompts on 8 data shards: the P x G rows
    are split inside the step).
    """
    spec = P() if strict else rows_spec(mesh, rows, rules, axis)

    def one(x):
        if x.ndim > axis and x.shape[axis] == rows:
            if not strict:
                return NamedSharding(mesh, spec)
            names = (None,) * axis + ("batch",) + (None,) * (x.ndim - axis - 1)
            return NamedSharding(mesh, logical_to_spec(names, rules, mesh, x.shape, "batch rows"))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree)


def put(tree, shardings):
    """Host arrays (identical on every process) -> global arrays placed by `shardings`."""

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def put_batch(tree, mesh: Mesh, rows: int, axis: int = 0, strict: bool = True):
    """Host arrays (the same on every process) placed as `batch_sharded` lays them out."""
    return put(tree, batch_sharded(tree, mesh, rows, axis=axis, strict=strict))


def constrain(x, names: Sequence[str | None], rules=None):
    """with_sharding_constraint by logical names under the ambient mesh (`jax.set_mesh`); else x.

    Dims the mesh axes don't divide (e.g. a batch of 1 while decoding) are left unconstrained.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    table = rules_from(rules=rules)
    spec = list(logical_to_spec(names, table, mesh))
    for d, axes in enumerate(spec):
        axes_t = (axes,) if isinstance(axes, str) else axes or ()
        if x.shape[d] % math.prod(mesh.shape[a] for a in axes_t):
            spec[d] = None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def abstract(tree, shardings):
    """ShapeDtypeStruct leaves of `tree` carrying `shardings` (a matching pytree or one)."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def abstract_outputs(traced, compiled=None):
    """A traced program's outputs as ShapeDtypeStructs, with the compiled one's shardings."""
    out = traced.out_info
    if compiled is None:
        return out
    leaves = jax.tree.leaves(compiled.output_shardings)
    return jax.tree.unflatten(jax.tree.structure(out), abstract(jax.tree.leaves(out), leaves))
