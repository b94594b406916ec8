"""sampler.Session with turns: rows continued over several calls with their pages kept draw the tokens a
full forward pass over the episode redraws with the row-and-token keys; given tokens are
fed, not drawn, and stop nothing; sharded equals unsharded."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sampler_test import CONFIG, LENGTHS, PROMPTS, reference, sampled_reference

from ebpo_jax import models, sampler, sharding

N = 14


@pytest.fixture(scope="module")
def params():
    # As sampler_test's: weights scaled so that logits are far from uniform.
    p = models.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p)


GIVEN = [40, 41, 42]


def _session(params, *, mesh=None, rng=None, eos_ids=(), temperature=1.0, **layout):
    """Three calls: first turns of [3, 5, 2, 14] tokens; rows 0-2 then get GIVEN[:b+1] and
    3 more tokens; row 0 alone decodes on to N. Returns (generations, given mask)."""
    sampling = sampler.Sampling(temperature, 6 if temperature else 0)
    spec = sampler.SamplerSpec(max_new_tokens=N, eos_ids=eos_ids, sampling=sampling, **layout)
    session = sampler.Session(CONFIG, spec, mesh=mesh, turns=True)
    rng = jax.random.key(3) if rng is None else rng
    g1 = session.start(params, PROMPTS, LENGTHS, rng=rng, row_limits=np.array([3, 5, 2, N]))
    len1 = np.asarray(g1.lengths)
    given, mask = np.zeros((4, N), np.int32), np.zeros((4, N), bool)
    for b in range(3):
        given[b, len1[b] : len1[b] + b + 1] = GIVEN[: b + 1]
        mask[b, len1[b] : len1[b] + b + 1] = True
    go = np.array([True, True, True, False])
    limits = np.minimum(len1 + np.arange(1, 5) + 3, N)
    g2 = session.resume(params, given, mask, go, limits)
    g3 = session.resume(params, given, mask, np.array([True, False, False, False]), [N] * 4)
    return (g1, g2, g3), mask, rng


def _drawn(gen, mask):
    """Tokens the engine drew: inside each row's length and not given."""
    return ~mask & (np.arange(N)[None] < np.asarray(gen.lengths)[:, None])


def _check(params, gen, mask, rng, temperature=1.0):
    """Drawn tokens equal a redraw from one forward pass over the episode with the
    row-and-token keys; their log-probs equal that pass's; given tokens have log-prob 0."""
    sampling = sampler.Sampling(temperature, 6 if temperature else 0, 1.0)
    want = sampled_reference(params, gen, rng, PROMPTS, LENGTHS, 1, sampling)
    drawn = _drawn(gen, mask)
    np.testing.assert_array_equal(np.asarray(gen.tokens)[drawn], want[drawn])
    np.testing.assert_array_equal(np.asarray(gen.logprobs)[mask], 0.0)
    ref, _ = reference(params, np.asarray(gen.tokens), PROMPTS, LENGTHS)
    np.testing.assert_allclose(np.asarray(gen.logprobs)[drawn], ref[drawn], rtol=0, atol=1e-5)


def test_continued_rows_draw_by_the_episode_keys(params):
    # Steps on buckets of the live rows (1-4 of 4): the last call runs row 0 alone.
    (g1, g2, g3), mask, rng = _session(params, live_buckets=4)
    np.testing.assert_array_equal(g1.lengths, [3, 5, 2, N])
    # Row b: its first turn, b + 1 given tokens, 3 drawn; row 0 then decodes on to N.
    np.testing.assert_array_equal(g2.lengths, [3 + 1 + 3, 5 + 2 + 3, 2 + 3 + 3, N])
    np.testing.assert_array_equal(g3.lengths, [N, 10, 8, N])
    for b in range(3):  # the given tokens sit where they were given, after the first turn
        np.testing.assert_array_equal(np.asarray(g3.tokens)[b][mask[b]], GIVEN[: b + 1])
    for b, n in enumerate(np.asarray(g1.lengths)):  # the first turns are kept as they were
        np.testing.assert_array_equal(np.asarray(g3.tokens)[b, :n], np.asarray(g1.tokens)[b, :n])
    _check(params, g3, mask, rng)


def test_given_stop_ids_stop_nothing_and_token0_stops_continue(params):
    g1 = _session(params, temperature=0.0)[0][0]
    # Stop on each row's greedy token 0 and on a given token: the first turn ends at token 0,
    # and the rows still continue, fed GIVEN (40 among the stop ids stops nothing).
    stops = tuple(sorted({int(t) for t in np.asarray(g1.tokens)[:, 0]} | {GIVEN[0]}))
    (h1, h2, _), mask, rng = _session(params, eos_ids=stops, temperature=0.0)
    np.testing.assert_array_equal(h1.lengths, [1, 1, 1, 1])
    assert np.all(np.asarray(h2.lengths)[:3] >= 1 + np.arange(1, 4) + 1)
    _check(params, h2, mask, rng, temperature=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("tp, dp_attention", [(4, False), (2, True)])
def test_sharded_turns_equal_unsharded(params, tp, dp_attention):
    """2 data x tp shards; with dp attention the 4 rows go one per (data, tp) chip."""
    (_, _, want), _, _ = _session(params)
    devices = np.array(jax.devices()[: 2 * tp]).reshape(2, tp)  # dp: 4 rows over 4 chips
    mesh = jax.sharding.Mesh(devices, ("data", "tp"))
    # The tiny model's 2 kv heads split over tp=2; over tp=4 the weights stay replicated.
    placed = sharding.param_shardings(CONFIG, params, mesh) if tp == 2 else NamedSharding(mesh, P())
    p = jax.device_put(params, placed)
    (_, _, got), _, _ = _session(p, mesh=mesh, dp_attention=dp_attention)
    for a, b in zip(want[:3], got[:3]):  # tokens, lengths, log-probs (stats are per shard)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
