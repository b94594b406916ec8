"""eb_advantage's transform contract: jit, vmap over independent streams, donation, lax.scan
over batches, with masks and clusters; against the float64 reference; one-line input errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from advantages_test import ReferenceEB

import ebpo_jax
from ebpo_jax import advantages

P, G, K, T, S = 6, 4, 3, 5, 3  # prompts, samples, clusters, batches, streams


def _stream(seed, batches=T):
    """`batches` batches of (rewards [P, G] f32, mask [P, G] bool, cluster ids [P] int32)."""
    rng = np.random.default_rng(seed)
    r = (rng.random((batches, P, G)) < rng.random((batches, P, 1))).astype(np.float32)
    m = rng.random((batches, P, G)) >= 0.25
    m[:, 0] = False  # an empty row every batch
    c = rng.integers(0, K, (batches, P)).astype(np.int32)
    return r, m, c


def _loop(fn, r_T, m_T, c_T, state):
    """fn over the batches one call at a time: (advantages [T, P, G], final state)."""
    out = []
    for r, m, c in zip(r_T, m_T, c_T):
        adv, state = fn(r, state, mask=m, cluster_ids=c)
        out.append(adv)
    return np.stack(out), state


class EbAdvantageVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_a_stream_with_masks_and_clusters_matches_the_float64_reference(self):
        fn = self.variant(ebpo_jax.eb_advantage)
        ref = ReferenceEB(num_clusters=K)
        state = ebpo_jax.init_eb_state(K)
        for r, m, c in zip(*_stream(0)):
            adv, state = fn(r, state, mask=m, cluster_ids=c)
            np.testing.assert_allclose(adv, ref(r, m, c)[0], atol=2e-5)
        np.testing.assert_allclose(state.reward.count.sum(), sum(map(len, ref.rewards)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_bad_input_is_refused_in_one_line(self):
        fn = self.variant(ebpo_jax.eb_advantage)
        s = ebpo_jax.init_eb_state(K)
        r = jnp.zeros((P, G))
        cases = [
            ((jnp.zeros((P, G, 1)), s), {}, ValueError, r"rewards must be \[P, G\]"),
            ((r, s), {"mask": jnp.ones((P, G))}, TypeError, "mask must be bool"),
            ((r, s), {"mask": jnp.ones((P, G - 1), bool)}, ValueError, "mask shape"),
            ((r, s), {"cluster_ids": jnp.zeros(P)}, TypeError, "cluster_ids must be integers"),
            ((r, s), {"cluster_ids": jnp.zeros(P + 1, int)}, ValueError, r"cluster_ids must be \["),
            (
                (r, s._replace(group=s.group._replace(m2=jnp.zeros(K + 1)))),
                {},
                ValueError,
                "all be",
            ),
            (
                (r, s._replace(reward=s.reward._replace(count=jnp.zeros(K, int)))),
                {},
                TypeError,
                "floating",
            ),
            ((r, (s.reward, s.group)), {}, TypeError, "state must be an EBState"),
        ]
        for args, kwargs, error, match in cases:
            with pytest.raises(error, match=match) as info:
                fn(*args, **kwargs)
            assert "\n" not in str(info.value), str(info.value)


def test_vmap_over_independent_streams_each_with_its_own_state():
    r_ST, m_ST, c_ST = (np.stack(x, 1) for x in zip(*(_stream(s) for s in range(S))))
    step = jax.jit(jax.vmap(lambda r, s, m, c: ebpo_jax.eb_advantage(r, s, mask=m, cluster_ids=c)))
    states = jax.tree.map(lambda x: jnp.stack([x] * S), ebpo_jax.init_eb_state(K))
    advs = []
    for t in range(T):
        adv_S, states = step(r_ST[t], states, m_ST[t], c_ST[t])
        advs.append(adv_S)
    for s in range(S):
        alone, state = _loop(ebpo_jax.eb_advantage, *_stream(s), ebpo_jax.init_eb_state(K))
        np.testing.assert_allclose(np.stack(advs)[:, s], alone, atol=1e-5)
        chex.assert_trees_all_close(jax.tree.map(lambda x, s=s: x[s], states), state, atol=1e-5)


def test_inside_lax_scan_over_batches_and_vmap_over_streams():
    def run(r_T, m_T, c_T):
        def body(state, batch):
            r, m, c = batch
            adv, state = ebpo_jax.eb_advantage(r, state, mask=m, cluster_ids=c)
            return state, adv

        state, adv_T = jax.lax.scan(body, ebpo_jax.init_eb_state(K), (r_T, m_T, c_T))
        return adv_T, state

    streams = [_stream(s) for s in range(S)]
    adv_ST, state_S = jax.jit(jax.vmap(run))(*(np.stack(x) for x in zip(*streams)))
    for s, batches in enumerate(streams):
        adv_T, state = _loop(ebpo_jax.eb_advantage, *batches, ebpo_jax.init_eb_state(K))
        np.testing.assert_allclose(adv_ST[s], adv_T, atol=1e-5)
        chex.assert_trees_all_close(jax.tree.map(lambda x, s=s: x[s], state_S), state, atol=1e-5)


def test_donated_state_gives_the_same_stream_and_frees_the_old_buffers():
    fn = lambda r, s, m, c: ebpo_jax.eb_advantage(r, s, mask=m, cluster_ids=c)
    donating, plain = jax.jit(fn, donate_argnums=1), jax.jit(fn)
    s_donated, s_plain = ebpo_jax.init_eb_state(K), ebpo_jax.init_eb_state(K)
    for r, m, c in zip(*_stream(1)):
        before = jax.tree.leaves(s_donated)
        adv_d, s_donated = donating(r, s_donated, m, c)
        adv_p, s_plain = plain(r, s_plain, m, c)
        assert all(x.is_deleted() for x in before)
        np.testing.assert_array_equal(adv_d, adv_p)
    chex.assert_trees_all_equal(s_donated, s_plain)


def test_estimate_is_the_same_function_under_the_transforms():
    def body(state, batch):
        r, m, c = batch
        adv, state, _ = advantages.estimate("ebpo", r, state, mask=m, cluster_ids=c)
        return state, adv

    r_T, m_T, c_T = _stream(2)
    state, adv_T = jax.jit(lambda b: jax.lax.scan(body, ebpo_jax.init_eb_state(K), b))(
        (r_T, m_T, c_T)
    )
    ref_T, ref_state = _loop(ebpo_jax.eb_advantage, r_T, m_T, c_T, ebpo_jax.init_eb_state(K))
    np.testing.assert_allclose(adv_T, ref_T, atol=1e-5)
    chex.assert_trees_all_close(state, ref_state, atol=1e-5)
