"""What the static sampler (sampler.py) and the slot sampler (slots.py) share: the Generation
they return, and how their KV caches and rows are laid out over a mesh."""

import functools
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models

PAD_ID = 0


class Generation(NamedTuple):
    """Sampled completions; `ebpo_jax.sampler`'s docstring gives the padding convention."""

    tokens: jax.Array  # [B * num_samples, N] int32
    logprobs: jax.Array  # [B * num_samples, N] float32
    lengths: jax.Array  # [B * num_samples] int32, generated tokens including EOS


@functools.lru_cache(maxsize=64)
def _cache_batch_axes(config, cache_size):
    """Per cache leaf, the axis that indexes the batch (found by shape, not assumed)."""
    one = jax.eval_shape(lambda: models.init_cache(config, 1, cache_size))
    two = jax.eval_shape(lambda: models.init_cache(config, 2, cache_size))

    def axis(a, b):
        diff = [i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        assert len(diff) == 1, f"cannot find the batch axis of cache leaf {a.shape}"
        return diff[0]

    return jax.tree.map(axis, one, two)


def _constrain(x, batch_sharding, axis=0):
    """Shards dim `axis` of x over the data axes; other dims left to the compiler."""
    if batch_sharding is None:
        return x
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[axis] = batch_sharding.spec[0]
    return jax.lax.with_sharding_constraint(x, NamedSharding(batch_sharding.mesh, P(*spec)))


def _constrain_cache(cache, axes, batch_sharding):
    return jax.tree.map(lambda x, a: _constrain(x, batch_sharding, a), cache, axes)


def _on_cpu(sharding) -> bool:
    """Whether the program runs on CPU: its mesh's devices, else the default backend.

    There the sampler slices the layer-stacked weights once, before the decode loop: XLA:CPU
    copied every layer's weights on every step (decode 4-7% slower at batch 64-256). XLA:TPU
    hoists the slices itself, and slicing first held 2.8 GiB more per chip for Qwen3-8B.
    """
    if sharding is not None:
        return sharding.mesh.devices.flat[0].platform == "cpu"
    return jax.default_backend() == "cpu"
