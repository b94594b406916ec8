"""The batch-invariant mode's row blocks run per data shard (issue 47): SPMD does not split a
`lax.map` over rows, so without a shard_map each chip would gather every row (the pod's
update then needed terabytes). On 8 fake CPU devices (conftest's XLA_FLAGS)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models
from ebpo_jax.models import invariant

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _gathers(fn, *args) -> int:
    return len(re.findall(r"all-gather(?:-start)?\(", jax.jit(fn).lower(*args).compile().as_text()))


def test_a_blocked_dot_of_data_sharded_rows_gathers_nothing_and_keeps_its_bits():
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((64, 32), (32, 16)))
    alone = np.asarray(jax.jit(invariant.dot)(x, w))
    mesh = _mesh()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        assert _gathers(invariant.dot, xs, w) == 0
        np.testing.assert_array_equal(np.asarray(jax.jit(invariant.dot)(xs, w)), alone)


# Slow: about 4 minutes on the loaded 2-core CPU (compiles the gradient twice).
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_the_models_forward_and_gradient_on_data_shards_gather_no_rows(preset):
    """Forward bitwise the single device's; the weights' gradient (a sum over shards in
    another order) close to it; neither program gathers rows."""
    config = models.get_config(preset, dtype="float32", batch_invariant=True)
    params = models.init_params(config, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (8, 24)), jnp.int32)
    forward = lambda p, t: models.forward(config, p, t)
    grad = jax.grad(lambda p, t: jnp.sum(forward(p, t)[..., :4] ** 2))
    want, want_grad = jax.jit(forward)(params, tokens), jax.jit(grad)(params, tokens)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        ts = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        assert _gathers(forward, params, ts) == 0
        assert _gathers(grad, params, ts) == 0
        got, got_grad = jax.jit(forward)(params, ts), jax.jit(grad)(params, ts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
