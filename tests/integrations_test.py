"""EBPOStream: EBPO's state between a host framework's stateless estimator calls."""

import numpy as np
import pytest

import ebpo_jax
from ebpo_jax.advantages import merge_batch
from ebpo_jax.integrations.stream import EBPOStream

P, G = 8, 4


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.random((P, G)) < rng.random((P, 1))).astype(np.float32) for _ in range(n)]


def _assert_states_equal(a, b):
    for x, y in zip(ebpo_jax.EBState(*a), ebpo_jax.EBState(*b)):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


def test_one_call_per_step_is_exactly_eb_advantage_over_the_stream():
    stream, state = EBPOStream(forgetting=0.9, normalize="group"), ebpo_jax.init_eb_state()
    for r in _batches(20):
        adv = stream(r)
        want, state = ebpo_jax.eb_advantage(r, state, forgetting=0.9, normalize="group")
        np.testing.assert_array_equal(adv, want)
    _assert_states_equal(stream.state, state)


def test_evaluation_calls_score_against_the_state_and_never_feed_it():
    stream = EBPOStream()
    for r in _batches(3):
        stream(r)
    before = stream.state
    for r in _batches(4, seed=1):
        with stream.evaluating():
            adv = stream(r)
        np.testing.assert_array_equal(adv, ebpo_jax.eb_advantage(r, before)[0])
        assert stream.training
    _assert_states_equal(stream.state, before)


def test_micro_batches_are_merged_once_per_step():
    stream, state = EBPOStream(prompts_per_step=P, forgetting=0.5), ebpo_jax.init_eb_state()
    for r in _batches(3):
        halves = r[: P // 2], r[P // 2 :]
        start = stream.state
        adv_first = stream(halves[0])
        _assert_states_equal(stream.state, start)  # not yet: the step has more prompts
        assert stream.pending_prompts == P // 2
        adv_second = stream(halves[1])
        assert stream.pending_prompts == 0
        # Each micro-batch is scored against the state at the step's start ...
        np.testing.assert_array_equal(
            adv_second, ebpo_jax.eb_advantage(halves[1], start, forgetting=0.5)[0]
        )
        np.testing.assert_array_equal(
            adv_first, ebpo_jax.eb_advantage(halves[0], start, forgetting=0.5)[0]
        )
        # ... and the step is merged as one batch, so the history decays once, not twice.
        state = merge_batch(state, r, forgetting=0.5)
        _assert_states_equal(stream.state, state)
    np.testing.assert_allclose(stream.state.reward.count, [P * G * (1 + 0.5 + 0.25)])


def test_a_micro_batch_that_crosses_a_step_is_refused():
    stream = EBPOStream(prompts_per_step=6)
    stream(_batches(1)[0][: P // 2])
    with pytest.raises(ValueError, match="would cross a step: 8 prompts, prompts_per_step=6"):
        stream(_batches(1)[0][: P // 2])
    assert stream.pending_prompts == P // 2  # the refused micro-batch left nothing behind
    with pytest.raises(ValueError, match="prompts_per_step must be >= 1"):
        EBPOStream(prompts_per_step=0)


def test_state_dict_round_trips_through_np_savez_mid_step(tmp_path):
    stream, batches = EBPOStream(prompts_per_step=P, num_clusters=1), _batches(4)
    stream(batches[0])
    stream(batches[1][: P // 2])  # a step half done
    np.savez(tmp_path / "eb.npz", **stream.state_dict())
    restored = EBPOStream(prompts_per_step=P)
    restored.load_state_dict(dict(np.load(tmp_path / "eb.npz")))
    assert restored.pending_prompts == P // 2
    for s in (stream, restored):
        s(batches[1][P // 2 :])
    np.testing.assert_array_equal(restored(batches[2]), stream(batches[2]))
    _assert_states_equal(restored.state, stream.state)
