"""Multi-host helpers: start the JAX distributed runtime, process 0, per-process data shards.

On a TPU pod the same command runs on every worker; each process sees its own chips,
reads its own slice of every batch, and process 0 alone writes logs and metrics
(checkpoints are written by all processes: orbax coordinates them).
"""

import os

import jax
import numpy as np

# Environment variables that mean "this process is one of several".
_MULTI_PROCESS_ENV = (
    "JAX_COORDINATOR_ADDRESS",  # explicit (any platform)
    "MEGASCALE_COORDINATOR_ADDRESS",  # multi-slice TPU
)


def needs_initialize(env=None) -> bool:
    """True when this process is one of several and the runtime must be told so."""
    env = os.environ if env is None else env
    if any(env.get(k) for k in _MULTI_PROCESS_ENV):
        return True
    # libtpu's own fallback value is a sentence ("WARNING: could not determine ..."): not hosts.
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 and not any(" " in h.strip() for h in hosts):
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    """Start jax.distributed where the platform needs it (before any other JAX call).

    Explicit arguments win; then JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (any platform, e.g. several CPU or GPU processes on one host); otherwise
    JAX detects TPU pods, SLURM and Open MPI itself. A single-host run does nothing.
    Returns whether the runtime is (now) initialized.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    explicit = coordinator_address is not None or num_processes is not None
    if not explicit and not needs_initialize():
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True


def is_main_process() -> bool:
    """Process 0: the one that logs, writes metrics and prints."""
    return jax.process_index() == 0


def process_slice(num_items: int, process_index=None, process_count=None) -> slice:
    """This process's contiguous block of `num_items` rows; the blocks partition the rows.

    The global batch must split evenly: an uneven split would give processes different
    shapes, and every process must run the same program.
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if not 0 <= index < count:
        raise ValueError(f"process_index {index} is not in [0, {count})")
    if num_items % count:
        raise ValueError(f"{num_items} rows do not split evenly over {count} processes")
    per = num_items // count
    return slice(index * per, (index + 1) * per)


def local_rows(tree, process_index=None, process_count=None):
    """Every leaf's leading-axis block for this process (host arrays in, host arrays out)."""
    leaves = jax.tree.leaves(tree)
    rows = {np.shape(x)[0] for x in leaves}
    if len(rows) != 1:
        raise ValueError(f"leaves disagree on the number of rows: {sorted(rows)}")
    s = process_slice(rows.pop(), process_index, process_count)
    return jax.tree.map(lambda x: x[s], tree)


def map_row_blocks(fn, tree, num_rows: int):
    """fn over this process's block of `tree`'s rows (leaves with `num_rows` leading rows;
    other leaves whole), every block's result joined in row order on every process.

    A host reward scored this way costs each host its share of the batch, not all of it.
    Rows that do not split evenly over the processes are all given to fn on every process.
    """
    count = jax.process_count()
    if count == 1 or num_rows % count:
        return np.asarray(fn(tree))
    rows = process_slice(num_rows)
    mine = np.asarray(fn(jax.tree.map(lambda x: _rows_of(x, rows, num_rows), tree)))
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, block, ...]
    return every.reshape(num_rows, *mine.shape[1:])


def _rows_of(x, rows: slice, num_rows: int):
    """`x[rows]` for a leaf of `num_rows` leading rows; any other leaf as it is."""
    return x[rows] if np.ndim(x) and np.shape(x)[0] == num_rows else x


def global_batch(local_tree, sharding):
    """One global jax.Array per leaf from each process's block of rows (no host gather)."""

    def one(x):
        x = np.asarray(x)
        shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(one, local_tree)


def to_host(tree):
    """A pytree of (possibly cross-process) arrays as host numpy arrays on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
