"""TPU slices on Ray: reserve one slice, run one task per host on it, all or none.

On a TPU VM Ray advertises `TPU` (chips per host) and the pod's name (1 per host) on every
host, and `TPU-<type>-head` on host 0. A slice is reserved as levanter, marin and Ray's own
`ray.util.tpu` do: a placement group on the head resource claims a free slice and a task in
it reads the slice's name; then a placement group with one bundle per host on that name
gang-schedules the hosts (Ray places a group's bundles all together or not at all). Every
host gets the same `jax.distributed` coordinator: host 0's address and a free port there.
The chips-per-host table is ours: `ray.util.tpu` sizes slices from a topology ("4x4x4"),
not from the type name users give (`v5p-64`).
"""

import os
from typing import NamedTuple

# TPU generation -> (TensorCores per chip as the type name counts them, chips per host).
_GENERATIONS = {"v4": (2, 4), "v5p": (2, 4), "v5litepod": (1, 4), "v5e": (1, 4), "v6e": (1, 4)}


class SliceSpec(NamedTuple):
    """A TPU slice type (`v5p-64`): its head resource name, hosts and chips per host."""

    name: str
    hosts: int
    chips_per_host: int

    @property
    def head(self) -> str:
        return f"TPU-{self.name}-head"


def parse_slice(name: str) -> SliceSpec:
    """`v5p-64` -> SliceSpec("v5p-64", hosts=8, chips_per_host=4); ValueError naming it."""
    gen, _, size = name.rpartition("-")
    if gen not in _GENERATIONS or not size.isdigit() or int(size) < 1:
        known = ", ".join(f"{g}-N" for g in _GENERATIONS)
        raise ValueError(f"--slice={name!r}: not a TPU slice type (one of {known})")
    cores_per_chip, per_host = _GENERATIONS[gen]
    chips = max(1, int(size) // cores_per_chip)
    if cores_per_chip == 1 and chips <= 8:  # v5e / v6e up to 8 chips: one host holds them
        return SliceSpec(name, 1, chips)
    return SliceSpec(name, max(1, chips // per_host), min(chips, per_host))


class Reservation(NamedTuple):
    """A reserved slice: the head's and the hosts' placement groups, the slice's name, and an
    ObjectRef of the coordinator address ("ip:port" on host 0)."""

    head_pg: object
    hosts_pg: object
    pod: str
    coordinator: object
    spec: SliceSpec


def _pod_name() -> str:
    """The TPU slice name of this node (TPU_NAME, else the TPU VM's metadata)."""
    import ray.util.tpu

    name = ray.util.tpu.get_current_pod_name()
    if not name:
        raise RuntimeError("this node has a TPU head resource but no TPU slice name")
    return name


def _coordinator() -> str:
    """This node's address (the one Ray's nodes reach it at) and a port free on it: where
    jax.distributed's coordinator listens."""
    import socket

    import ray

    node = ray.get_runtime_context().get_node_id()
    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ip}:{port}"


def reserve(spec: SliceSpec, timeout_s: float | None = None) -> Reservation:
    """Claim a free slice of type `spec` (waits until one is free, or `timeout_s`)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

    head_pg = placement_group([{spec.head: 1}])
    if not _ready(head_pg, timeout_s):
        raise TimeoutError(f"no free {spec.name} slice ({spec.head}) in {timeout_s} s")
    name_task = ray.remote(_pod_name).options(num_cpus=0, scheduling_strategy=InGroup(head_pg, 0))
    pod = ray.get(name_task.remote())
    bundle = {"CPU": 1, "TPU": spec.chips_per_host, pod: 1}
    hosts_pg = placement_group([bundle] * spec.hosts, strategy="SPREAD")
    coord_task = ray.remote(_coordinator).options(
        num_cpus=0, scheduling_strategy=InGroup(hosts_pg, 0)
    )
    return Reservation(head_pg, hosts_pg, pod, coord_task.remote(), spec)


def _ready(pg, timeout_s: float | None) -> bool:
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    return bool(ready)


def release(res: Reservation) -> None:
    """Give the slice back (its hosts' group first, then the head's)."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(res.hosts_pg)
    remove_placement_group(res.head_pg)


def host_options(res: Reservation, host: int) -> dict:
    """`.options(...)` of host `host`'s task: its bundle of the slice's placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

    return {
        "num_cpus": 1,
        "resources": {"TPU": res.spec.chips_per_host, res.pod: 1},
        "scheduling_strategy": InGroup(res.hosts_pg, host),
    }


def host_env(coordinator: str, hosts: int, host: int) -> dict:
    """The variables that start jax.distributed on host `host` (ebpo_jax.runtime.distributed reads them)."""
    return {
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(hosts),
        "JAX_PROCESS_ID": str(host),
    }


def apply_env(env: dict) -> None:
    """Set `env` in this (fresh) worker process, before jax starts."""
    os.environ.update(env)
