"""Mesh construction, logical-axis rules, and FSDP x TP sharded model == single device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models, sharding


def test_make_mesh_resolves_rest_and_uses_auto_axes():
    mesh = sharding.make_mesh([("data", 2), ("fsdp", -1), ("tp", 2)])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tp": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)

    class Cfg:
        axes, shape = ("data", "tp"), (-1, 4)

    assert dict(sharding.make_mesh(Cfg()).shape) == {"data": 2, "tp": 4}
    with pytest.raises(ValueError, match="does not divide"):
        sharding.make_mesh([("data", 3), ("tp", -1)])
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh([("data", 2), ("tp", 2)])


def test_rules_map_logical_names():
    mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tp", 2)])
    rules = sharding.DEFAULT_RULES
    assert sharding.logical_to_spec(("batch", "seq", "act_embed"), rules, mesh) == P(
        ("data", "fsdp"), None, None
    )
    assert sharding.logical_to_spec(("layers", "embed", "mlp"), rules, mesh) == P(
        None, "fsdp", "tp"
    )
    # A mesh axis is never used twice in one spec; axes absent from the mesh are skipped.
    assert sharding.logical_to_spec(("batch", "embed"), rules) == P(("data", "fsdp"), None)
    small = sharding.make_mesh([("data", 8)])
    assert sharding.logical_to_spec(("embed", "mlp"), rules, small) == P(None, None)
    with pytest.raises(ValueError, match="'nope' has no sharding rule"):
        sharding.logical_to_spec(("nope",), rules)
    with pytest.raises(ValueError, match="does not split"):
        sharding.logical_to_spec(("mlp",), rules, mesh, shape=(3,), what="param w")


def test_every_param_has_logical_axes_and_config_rules_override():
    config = models.get_config("tiny_qwen3")
    params = models.abstract_params(config)
    variables = jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "get_metadata"))
    for v in variables:
        assert len(v.get_metadata()["axes"]) == len(v.get_value().shape)
    mesh = sharding.make_mesh([("fsdp", 4), ("tp", 2)])
    default = sharding.param_shardings(config, params, mesh)
    assert default["layers"]["mlp"]["gate"].get_value().spec == P(None, "fsdp", "tp")
    pure_fsdp = config.replace(
        sharding_rules=[("embed", ["fsdp", "tp"]), *sharding.DEFAULT_RULES[:3]]
    )
    with pytest.raises(ValueError, match="no sharding rule"):
        sharding.param_shardings(pure_fsdp, params, mesh)
    rules = [*sharding.DEFAULT_RULES, ("embed", ["fsdp", "tp"]), ("mlp", None), ("vocab", None)]
    override = config.replace(sharding_rules=rules)
    hash(override)  # still a valid jit static argument
    got = sharding.param_shardings(override, params, mesh)
    assert got["layers"]["mlp"]["gate"].get_value().spec == P(None, ("fsdp", "tp"), None)


def test_fsdp_tp_forward_and_grads_match_single_device():
    # Untied head and q/k norms: every kind of parameter in one (compile-heavy) test.
    config = models.get_config("tiny", qk_norm=True)
    params = models.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, config.vocab_size)
    mask = jnp.arange(16)[None, :] < jnp.array([[16], [9], [12], [5]])

    def loss_fn(params, tokens, mask):
        logits = models.forward(config, params, tokens, mask=mask)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:]), logits

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    one = jax.devices()[0]
    (ref_loss, ref_logits), ref_grads = step(*jax.device_put((params, tokens, mask), one))

    mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tp", 2)])
    sharded = sharding.shard_params(config, params, mesh)
    assert sharded["layers"]["attn"]["q"][...].sharding.spec == P(None, "fsdp", "tp", None)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        (loss, logits), grads = step(
            sharded, jax.device_put(tokens, rows), jax.device_put(mask, rows)
        )
    assert len(logits.sharding.device_set) == 8
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), grads, ref_grads
    )
