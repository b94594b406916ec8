"""An on-disk memo of AOT compiles: a program whose lowered text is byte-identical to one
compiled before, for the same devices, topology, compiler and flags, reuses that compile's
memory and cost analysis instead of compiling again.

JAX's persistent compilation cache does not serve the deviceless compiles: with the
compile-only TPU client it writes entries but cannot read them back ("PjRtCompiler must be
constructed with a Client to call DeserializeLoadedExecutable"; jax 0.10.2, libtpu 0.0.42.1).

The key is the SHA-256 of the StableHLO text (`Lowered.as_text()`: shardings and constants
included, source locations not), the program's device ids, the topology, the jax, jaxlib and
libtpu versions and the compiler's flags. An entry is a small JSON file `<key>.json` that
also holds the compiled outputs' shardings, which the next program of a call traces with.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import types

import jax
from jax.sharding import NamedSharding, PartitionSpec

# The compiler's flags that change what a program compiles to (or how much memory it takes).
FLAG_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


class MemoizedOutOfMemory(RuntimeError):
    """A program the compiler could not fit (RESOURCE_EXHAUSTED) when it was first compiled."""


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the AOT report reads of a compiled program, compiled now or reused from the memo."""

    key: str
    reused: bool
    memory: dict
    cost: dict
    output_shardings: list
    first: str = ""  # the run that compiled it

    def memory_analysis(self):
        return types.SimpleNamespace(**self.memory)

    def cost_analysis(self) -> dict:
        return dict(self.cost)

    @property
    def how(self) -> str:
        """'compiled' or 'reused from <first>', with the key."""
        return f"reused from {self.first}" if self.reused else "compiled"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def key_of(lowered, mesh, topology: str) -> str:
    """The memo key of `lowered` on `mesh`'s devices for `topology`."""
    h = hashlib.sha256()
    versions = [_version(n) for n in ("jax", "jaxlib", "libtpu")]
    parts = [
        topology,
        ",".join(str(d.id) for d in mesh.devices.flat),
        *versions,
        *(os.environ.get(v, "") for v in FLAG_VARS),
    ]
    h.update("\n".join(parts).encode())
    h.update(lowered.as_text().encode())
    return h.hexdigest()


def _spec_json(sharding, mesh):
    """A compiled output's sharding as JSON (its PartitionSpec), or None when it is not a
    NamedSharding over `mesh`, which this memo cannot rebuild."""
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        return None
    axes = [list(a) if isinstance(a, tuple) else a for a in sharding.spec]
    return {"spec": axes, "memory_kind": sharding.memory_kind}


def _spec_of(entry, mesh) -> NamedSharding:
    axes = [tuple(a) if isinstance(a, list) else a for a in entry["spec"]]
    return NamedSharding(mesh, PartitionSpec(*axes), memory_kind=entry["memory_kind"])


class Memo:
    """Compiles through the memo folder `folder`; `label` names this run in its new entries."""

    def __init__(self, folder: str, topology: str, label: str = ""):
        self.folder, self.topology, self.label = folder, topology, label
        os.makedirs(folder, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.json")

    def compile(self, lowered, mesh) -> Compiled:
        """`lowered` compiled, or its memo entry; an entry whose outputs cannot be rebuilt
        compiles again. A stored out-of-memory result raises MemoizedOutOfMemory."""
        key = key_of(lowered, mesh, self.topology)
        entry = self._read(key)
        if entry is not None and None not in entry["outputs"]:
            if entry.get("error"):
                raise MemoizedOutOfMemory(entry["error"])
            return self._reused(key, entry, mesh)
        try:
            compiled = lowered.compile()
        except Exception as e:
            from ebpo_jax.pods.aot_report import is_resource_exhausted

            if is_resource_exhausted(e):
                self._write(key, {"error": str(e)[:2000], "outputs": [], "first": self.label})
            raise
        entry = {
            "first": self.label,
            "memory": {f: int(getattr(compiled.memory_analysis(), f)) for f in MEMORY_FIELDS},
            "cost": _cost(compiled),
            "outputs": [_spec_json(s, mesh) for s in jax.tree.leaves(compiled.output_shardings)],
        }
        self._write(key, entry)
        outs = jax.tree.leaves(compiled.output_shardings)
        return Compiled(key, False, entry["memory"], entry["cost"], outs, self.label)

    def _reused(self, key, entry, mesh) -> Compiled:
        outs = [_spec_of(o, mesh) for o in entry["outputs"]]
        return Compiled(key, True, entry["memory"], entry["cost"], outs, entry["first"])

    def _read(self, key: str) -> dict | None:
        try:
            with open(self.path(key)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _write(self, key: str, entry: dict) -> None:
        tmp = f"{self.path(key)}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path(key))  # a concurrent reader sees the old file or the new


def _cost(compiled) -> dict:
    """compiled.cost_analysis()'s numbers (a dict, or a list of one on older jax)."""
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))}


def compile_with(memo: Memo | None, lowered, mesh):
    """`lowered.compile()`, through `memo` when there is one (None or "": none)."""
    return memo.compile(lowered, mesh) if memo else lowered.compile()
