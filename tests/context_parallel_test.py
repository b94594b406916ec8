"""Context parallelism: a packed or padded update with each row's tokens split over the mesh's
`context` axis (8 fake CPU devices) equals the unsplit one; the zig-zag split's balance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packing_test import _config, _layout, _rollout

from ebpo_jax import losses, models, sharding
from ebpo_jax.config import ConfigError, validate
from ebpo_jax.models import lora
from ebpo_jax.trainer import packing
from ebpo_jax.trainer.update import completion_logprobs

TP, N, ROW = 7, 6, 16  # rows of 16 slots: 8 chunks of 2 at context=4, so sequences straddle


def _grad_fn(model_config, B):
    """The update's grad_fn on a token-mean PPO loss with an entropy term (log-probs padded, or
    packed when the micro-batch has rows, through the chunked head); packing_test covers KL
    and the other aggregations."""
    opts = losses.LossOptions(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)

    def loss_fn(params, mb, denom):
        if mb.packed is None:
            out = completion_logprobs(model_config, params, mb, with_entropy=True)
        else:
            out = packing.packed_completion_logprobs(
                model_config, params, mb.packed, slots=(B, N), with_entropy=True, chunk_size=8
            )
        logp_BN, ent_BN = out
        old_BN, mask_BN = mb.logprobs.reshape(B, N), mb.loss_mask.reshape(B, N)
        terms = losses.TokenTerms(logp_BN, old_BN, mb.adv.reshape(B), mask_BN, entropy_BT=ent_BN)
        return losses.policy_loss(terms, opts, denominator=denom)

    def grad_fn(params, frozen, mb, denom):
        return jax.value_and_grad(loss_fn, has_aux=True)(params, mb, denom)

    return grad_fn


def _run(model_config, lay, B):
    """jit(params, mb) -> ((loss, metrics), grads) of the mini-batch (padded when lay is None)."""

    def run(params, mb):
        denom = mb.loss_mask.sum().astype(jnp.float32)
        if lay is None:
            return _grad_fn(model_config, B)(params, None, mb, denom)
        grads, loss, metrics = packing.accumulate(
            _grad_fn(model_config, B), params, None, mb, denom, lay
        )
        return (loss, metrics), grads

    return jax.jit(run)


def _params(model_config, with_lora):
    params = models.init_params(model_config, jax.random.key(0))
    if with_lora:
        spec = lora.LoraSpec(4, 8.0, tuple(lora.TARGETS))
        adapters = lora.init_adapters(model_config, spec, jax.random.key(1))
        adapters = jax.tree.map(lambda x: x + 0.02, adapters)  # B = 0 would hide the adapters
        params = lora.attach(params, adapters, spec)
    return params


def _on_mesh(tree, mesh):
    """`tree` replicated on `mesh` (the step's in-jit constraints do the splitting)."""
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _compare(preset, mesh_axes, packed, with_lora=False):
    """The update on `mesh_axes` (4 or 8 devices) equals the one-device update to float32
    rounding."""
    model_config = models.get_config(preset, remat="full")  # the pod configs' policy
    n = np.prod([size for _, size in mesh_axes])
    mesh = sharding.make_mesh(mesh_axes, devices=jax.devices()[:n])
    context = dict(mesh_axes)["context"]
    budget = 2 * ROW if packed else 0
    config = _config(budget=budget, row_len=ROW if packed else 0, N=N)
    lay_1 = _layout(config, model_config, TP, batch_shards=2) if packed else None
    lay_c = _layout(config, model_config, TP, batch_shards=2, context=context) if packed else None
    params = _params(model_config, with_lora)
    mb, _ = _rollout(seed=1, Tp=TP, N=N)
    mb = mb._replace(adv=jnp.linspace(-1.0, 1.0, mb.lengths.size).reshape(mb.lengths.shape))
    B = mb.lengths.size
    want = _run(model_config, lay_1, B)(params, mb)
    with jax.set_mesh(mesh):
        on = lambda t: _on_mesh(t, mesh)
        compiled = _run(model_config, lay_c, B).lower(on(params), on(mb)).compile()
        got = compiled(on(params), on(mb))
    if packed:  # keys and values gathered over the context shards (models/attention.py)
        assert "all-gather" in compiled.as_text()
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    jax.tree.map(close, got, want)
    norm = sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(want[1]))
    assert norm > 1e-6  # gradients are not trivially zero
    return lay_c


def test_packed_update_over_context_4_equals_one_device_with_lora():
    """fsdp=2 x context=4, shared-prompt packed rows whose sequences straddle the shards."""
    lay = _compare("tiny", [("fsdp", 2), ("context", 4)], packed=True, with_lora=True)
    assert lay.context == 4 and lay.row_len == ROW


def test_padded_moe_update_over_context_4_equals_one_device():
    """The mixture-of-experts model on padded rows (4 devices): with the LoRA test above, the
    default suite covers dense and MoE, packed and padded."""
    _compare("tiny_moe", [("context", 4)], packed=False)


# Two compiles of a whole update each: slow.
@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, axes, packed",
    [
        ("tiny_moe", [("data", 2), ("context", 2), ("tp", 2)], True),
        ("tiny", [("fsdp", 4), ("context", 2)], False),
    ],
)
def test_update_over_context_equals_one_device(preset, axes, packed):
    """The other combinations: MoE packed over data x context x tp, dense padded on fsdp."""
    _compare(preset, axes, packed)


def test_zigzag_rows_keep_every_token_and_straddle_shards():
    """micro_batch under context=4: the same tokens, slot order zig-zag, a sequence over shards."""
    model_config = models.get_config("tiny")
    config = _config(budget=2 * ROW, row_len=ROW, N=N)
    lay_1 = _layout(config, model_config, TP)
    lay_4 = _layout(config, model_config, TP, context=4)
    mb, _ = _rollout(seed=1, Tp=TP, N=N)
    pl = packing.plan(lay_1, mb.prompt_lengths, packing.loss_span(mb.loss_mask.reshape(-1, N)))
    args = (pl, mb.prompt_tokens, mb.prompt_lengths, mb.tokens.reshape(-1, N), 0)
    rows = jax.jit(packing.micro_batch, static_argnums=0)
    plain, zig = rows(lay_1, *args), rows(lay_4, *args)
    order = sharding.zigzag_order(ROW, 4)
    np.testing.assert_array_equal(order, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(zig["slots"][0], order)
    for k, v in plain.items():
        np.testing.assert_array_equal(zig[k], np.asarray(v)[:, order], err_msg=k)
    shard_of_slot = np.argsort(order) // (ROW // 4)
    seg = np.asarray(plain["segment_ids"][0])
    assert any(len(set(shard_of_slot[seg == s])) > 1 for s in set(seg[seg > 0].tolist()))


def test_zigzag_balances_causal_attention():
    """One 64-slot causal row: contiguous shards do (2c-1)/c of the mean work, zig-zag 1."""
    pairs = packing.attention_pairs(np.ones(64, int))
    np.testing.assert_array_equal(pairs, np.arange(1, 65))
    for c in (2, 4, 8):
        assert packing.shard_balance(pairs, c) == pytest.approx((2 * c - 1) / c, rel=0.02)
        assert packing.shard_balance(pairs, c, sharding.zigzag_order(64, c)) == 1.0
    # Packed: segment 1 (a shared prompt of 3) opens to segment 2's queries.
    seg, pre = np.array([1, 1, 1, 2, 2, 0]), np.array([1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(packing.attention_pairs(seg, pre), [1, 2, 3, 4, 5, 0])


def test_row_length_must_split_into_zigzag_chunks():
    """A pack_row_len that 2 x context does not divide is refused, naming the setting."""
    config = _config(budget=2 * 14, row_len=14, N=N)
    with pytest.raises(ValueError, match="loss.pack_row_len=14 must be a multiple of 2 x"):
        _layout(config, models.get_config("tiny"), TP, context=4)


@pytest.mark.parametrize(
    "row_len, attention, message",
    [
        (36, "xla", "loss.pack_row_len=36 must be a multiple of 2 x"),
        (32, "splash", "attention='splash' with a context mesh axis"),
        (32, "xla", "mesh.axes has context=4: set sampler.mesh"),
    ],
)
def test_context_config_errors_name_the_setting(row_len, attention, message):
    """The mode rules refuse a row that does not split into zig-zag chunks, splash, and
    sampling on the trainer's mesh (its context chips would decode the same rows)."""
    c = _config(budget=64, row_len=row_len, N=N)
    c.mesh.shape, c.mesh.axes = (2, 4), ("fsdp", "context")
    c.model.overrides.attention = attention
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_context_balance_script_measures_a_packed_minibatch():
    """experiments/context_balance.py at small sizes: zig-zag no worse than contiguous."""
    from conftest import load_experiment

    out = load_experiment("context_balance").balance(16, 48, 4, 2, 4, 4)
    assert out["one_full_row"] == {"contiguous": pytest.approx(1.75, rel=0.05), "zigzag": 1.0}
    assert 1.0 <= out["zigzag_within_rows"] <= out["contiguous_within_rows"]
    assert 0.0 < out["row_fill"] <= 1.0


def test_packed_logprobs_over_context_4_equal_one_device():
    """Log-probs and entropies of zig-zag rows on fsdp=2 x context=4 equal the plain rows'."""
    model_config = models.get_config("tiny")
    config = _config(budget=2 * ROW, row_len=ROW, N=N)
    lay_1 = _layout(config, model_config, TP)
    lay_4 = _layout(config, model_config, TP, batch_shards=2, context=4)
    mb, _ = _rollout(seed=2, Tp=TP, N=N)
    pl = packing.plan(lay_1, mb.prompt_lengths, packing.loss_span(mb.loss_mask.reshape(-1, N)))
    args = (pl, mb.prompt_tokens, mb.prompt_lengths, mb.tokens.reshape(-1, N), 0)
    params = models.init_params(model_config, jax.random.key(3))
    B = mb.lengths.size

    def logprobs(lay):
        rows = packing.micro_batch(lay, *args)
        return packing.packed_completion_logprobs(
            model_config, params, rows, slots=(B, N), with_entropy=True
        )

    want = jax.jit(logprobs, static_argnums=0)(lay_1)
    mesh = sharding.make_mesh([("fsdp", 2), ("context", 4)])
    with jax.set_mesh(mesh):
        got = jax.jit(logprobs, static_argnums=0)(lay_4)
    assert float(jnp.abs(want[0]).sum()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
