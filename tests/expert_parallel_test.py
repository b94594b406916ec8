"""Expert parallelism in the sampler (sampler.expert_parallel): the sharded dispatch equals the
unsharded one, generate is unchanged by it, and the settings it cannot serve are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from settings_test import _micro

from ebpo_jax import models, sampler, sharding
from ebpo_jax.config import ConfigError, validate
from ebpo_jax.models import moe

E, K, D, I = 8, 3, 16, 12  # experts, top-k, hidden, expert width


def _experts(key):
    ks = jax.random.split(key, 3)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[-2])
    return w(ks[0], (E, D, I)), w(ks[1], (E, D, I)), w(ks[2], (E, I, D))


def _reference(x_ND, experts_Nk, weights_Nk, w):
    fn = lambda x_MD, sizes_E: moe.swiglu_experts(x_MD, sizes_E, *w, "xla")
    return moe.dispatch(x_ND, experts_Nk, weights_Nk, fn, E)


def _routings(N):
    """name -> experts [N, K]: random distinct experts; every pair on shard 0's or 3's
    experts (the others receive none; one shard far past its even share)."""
    keys = jax.random.split(jax.random.key(1), N)
    rand = jax.vmap(lambda k: jax.random.permutation(k, E)[:K])(keys)
    lumped = jnp.tile(jnp.array([0, 1, 6]), (N, 1))  # shards of 2 experts: 0, 0, 3
    return {"random": rand, "two_shards_only": lumped}


# 32 rows move the tokens to the experts; 256 rows (as prefill's many) gather the experts.
@pytest.mark.parametrize(
    ("routing", "N"), [("random", 32), ("two_shards_only", 32), ("random", 256)]
)
def test_sharded_dispatch_with_expert_parallel_equals_dispatch(routing, N):
    x_ND = jax.random.normal(jax.random.key(0), (N, D), jnp.float32)
    experts_Nk = _routings(N)[routing]
    weights_Nk = jax.nn.softmax(jax.random.normal(jax.random.key(2), (N, K)), axis=-1)
    w = _experts(jax.random.key(3))
    want = _reference(x_ND, experts_Nk, weights_Nk, w)
    assert moe.moves_tokens(x_ND, w, 4, 4, 2) == (N == 32)
    mesh = sharding.make_mesh([("data", 4), ("tp", 2)])
    rules = moe.expert_parallel_rules()
    w_sh = NamedSharding(mesh, P("data", None, "tp")), NamedSharding(mesh, P("data", "tp", None))
    placed = jax.device_put(w, (w_sh[0], w_sh[0], w_sh[1]))
    rows = NamedSharding(mesh, P("data"))
    args = jax.device_put((x_ND, experts_Nk, weights_Nk), rows)
    run = jax.jit(lambda a, w: moe.sharded_dispatch(*a, w, "xla", rules))
    with jax.set_mesh(mesh):
        got = run(args, placed)
        hlo = run.lower(args, placed).as_text()
        one_row = run(jax.tree.map(lambda a: a[:1], (x_ND, experts_Nk, weights_Nk)), placed)
    assert ("reduce_scatter" in hlo) == (N == 32)  # the tokens' way back, or none
    assert got.sharding.spec == P("data")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_row, want[:1], rtol=1e-5, atol=1e-6)  # rows whole: psum


def test_owned_dispatch_runs_every_window_and_masks_garbage_rows():
    N = 16
    x_ND = jax.random.normal(jax.random.key(0), (N, D), jnp.float32)
    experts_Nk, w = _routings(N)["two_shards_only"], _experts(jax.random.key(3))
    weights_Nk = jnp.full((N, K), 1.0 / K)
    want = _reference(x_ND, experts_Nk, weights_Nk, w)

    def nan_past_groups(x_MD, sizes_E):  # as megablox may leave rows past the groups
        y = moe.swiglu_experts(x_MD, sizes_E, *w, "xla")
        return jnp.where(jnp.arange(x_MD.shape[0])[:, None] < sizes_E.sum(), y, jnp.nan)

    # Experts 0..7 all here, windows of 8 pairs: 48 pairs take 6 windows.
    got = moe.owned_dispatch(x_ND, experts_Nk, weights_Nk, nan_past_groups, E, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Shard 3's experts (6, 7) hold one pair per token; the rest are someone else's.
    w3 = tuple(a[6:] for a in w)
    fn3 = lambda x_MD, sizes_E: moe.swiglu_experts(x_MD, sizes_E, *w3, "xla")
    part = moe.owned_dispatch(x_ND, experts_Nk - 6, weights_Nk, fn3, 2, 8)
    only6 = _reference(x_ND, experts_Nk, jnp.where(experts_Nk == 6, weights_Nk, 0.0), w)
    np.testing.assert_allclose(part, only6, rtol=1e-5, atol=1e-6)


CONFIG = models.get_config("tiny_moe", num_layers=2)
PROMPTS = np.array([[5, 6, 7, 8], [9, 10, 77, 77], [11, 12, 13, 77], [14, 77, 77, 77]], np.int32)
LENGTHS = np.array([4, 2, 3, 1], np.int32)


def _generate(params, mesh, **kw):
    spec = sampler.SamplerSpec(
        max_new_tokens=5, num_samples=2, sampling=sampler.Sampling(temperature=0.0), **kw
    )
    return sampler.generate(
        CONFIG, params, PROMPTS, LENGTHS, spec, rng=jax.random.key(0), mesh=mesh
    )


@pytest.mark.parametrize("dp_attention", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_generate_with_expert_parallel_equals_without(dp_attention, monkeypatch):
    traced = []  # the expert-parallel dispatch ran (a silent fallback would match too)
    ep_dispatch = moe._ep_dispatch
    monkeypatch.setattr(moe, "_ep_dispatch", lambda *a: traced.append(a[-1]) or ep_dispatch(*a))
    params = models.init_params(CONFIG, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)  # clear argmax margins
    mesh = sharding.make_mesh([("data", 4), ("tp", 2)])
    ep_config = moe.expert_parallel_config(CONFIG)
    placed = jax.device_put(params, sharding.param_shardings(CONFIG, params, mesh))
    ep_placed = jax.device_put(params, sharding.param_shardings(ep_config, params, mesh))
    assert ep_placed["moe"]["gate"][...].sharding.spec == P(None, "data", None, "tp")
    off = _generate(placed, mesh, dp_attention=dp_attention)
    assert not traced
    on = _generate(ep_placed, mesh, dp_attention=dp_attention, expert_parallel=True)
    assert traced and all(ep == ("data",) for ep in traced)
    np.testing.assert_array_equal(on.tokens, off.tokens)
    np.testing.assert_array_equal(on.lengths, off.lengths)
    np.testing.assert_allclose(on.logprobs, off.logprobs, atol=1e-5)


@pytest.mark.slow
def test_generate_with_expert_parallel_inside_a_jit_as_the_trainer_runs_it():
    params = models.init_params(CONFIG, jax.random.key(0))
    mesh = sharding.make_mesh([("data", 4), ("tp", 2)])
    ep = sharding.param_shardings(moe.expert_parallel_config(CONFIG), params, mesh)
    want = _generate(params, mesh)
    with jax.set_mesh(mesh):  # the trainer's rollout: traced under the sampler's mesh
        got = jax.jit(lambda p: _generate(p, mesh, expert_parallel=True))(
            jax.device_put(params, ep)
        )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_expert_parallel_refuses_a_dense_model():
    with pytest.raises(ValueError, match="expert_parallel needs a mixture-of-experts"):
        sampler.Session(models.get_config("tiny"), sampler.SamplerSpec(4, expert_parallel=True))


EP = {"sampler.expert_parallel": True, "model.preset": "tiny_moe", "sampler.mesh": "data=8"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model.preset": "tiny"}, r"sampler.expert_parallel needs a mixture-of-experts policy: "),
        ({"model.overrides.num_experts": 6}, r"6 experts do not split over sampler.mesh.s 8 data"),
        ({"model.batch_invariant": True}, r"sampler.expert_parallel with model.batch_invariant"),
    ],
)
def test_expert_parallel_settings_it_cannot_serve_are_one_line_errors(changes, message):
    validate(_micro(**EP))  # the layout it serves
    with pytest.raises(ConfigError, match=message) as err:
        validate(_micro(**(EP | changes)))
    assert "\n" not in str(err.value)
