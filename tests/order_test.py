"""Record orders: topic grouping, easy-to-hard monotonicity, resume, disjoint host shards."""

import numpy as np
import pytest

from ebpo_jax.data import RecordOrder
from ebpo_jax.data.order import Shard

N = 103
RNG = np.random.default_rng(0)
TOPICS = RNG.integers(0, 5, size=N)
DIFFICULTY = RNG.integers(0, 17, size=N) / 16  # e.g. 1 - pass rate over 16 samples: many ties


def make(order="naive", **kw):
    return RecordOrder(N, order=order, seed=3, topic_ids=TOPICS, difficulty=DIFFICULTY, **kw)


def runs(labels):
    """Number of maximal runs of equal consecutive labels."""
    labels = np.asarray(labels)
    return 1 + int((labels[1:] != labels[:-1]).sum())


@pytest.mark.parametrize("order", ["naive", "topic", "difficulty"])
def test_each_epoch_is_a_permutation(order):
    o = make(order)
    for epoch in range(3):
        assert sorted(o.global_order(epoch).tolist()) == list(range(N))
    assert not np.array_equal(o.global_order(0), o.global_order(1))


def test_topic_order_groups_clusters():
    o = make("topic")
    for epoch in range(3):
        stream = TOPICS[o.global_order(epoch)]
        assert runs(stream) == len(np.unique(TOPICS))  # each cluster is one contiguous block
    # Cluster order changes across epochs (seeded), and is ascending when not shuffled.
    firsts = {int(TOPICS[o.global_order(e)][0]) for e in range(8)}
    assert len(firsts) > 1
    fixed = make("topic", shuffle_clusters=False)
    assert np.all(np.diff(TOPICS[fixed.global_order(0)]) >= 0)
    # The shuffled baseline does not group them.
    assert runs(TOPICS[make("naive").global_order(0)]) > 3 * len(np.unique(TOPICS))


def test_difficulty_order_is_monotone_and_ties_shuffled():
    o = make("difficulty")
    batches = np.concatenate([o.next_indices(10) for _ in range(N // 10)])
    assert np.all(np.diff(DIFFICULTY[batches]) >= 0)  # easy to hard across batches
    easy = np.flatnonzero(DIFFICULTY == DIFFICULTY.min())
    first0 = RecordOrder(N, order="difficulty", seed=0, difficulty=DIFFICULTY).global_order(0)
    first1 = RecordOrder(N, order="difficulty", seed=1, difficulty=DIFFICULTY).global_order(0)
    assert set(first0[: easy.size]) == set(easy)
    assert not np.array_equal(first0, first1)  # ties broken by the seed


def test_resume_continues_at_the_same_record():
    for order in ("naive", "topic", "difficulty"):
        ref = make(order)
        want = [ref.next_indices(7) for _ in range(40)]  # crosses several epoch boundaries
        run = make(order)
        got = [run.next_indices(7) for _ in range(13)]
        saved = dict(run.state())
        fresh = make(order)
        fresh.restore(saved)
        got += [fresh.next_indices(7) for _ in range(27)]
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))


def test_epoch_boundary_and_state():
    o = make("naive")
    o.next_indices(N - 2)
    batch = o.next_indices(5)
    np.testing.assert_array_equal(batch[:2], o.global_order(0)[-2:])
    np.testing.assert_array_equal(batch[2:], o.global_order(1)[:3])
    assert (o.state()["epoch"], o.state()["position"]) == (1, 3)


def test_hosts_see_disjoint_equal_shards():
    for order in ("naive", "topic", "difficulty"):
        hosts = [make(order, shard=Shard(h, 4)) for h in range(4)]
        shards = [set(h.next_indices(N // 4).tolist()) for h in hosts]
        assert all(len(s) == N // 4 for s in shards)
        for i in range(4):
            for j in range(i + 1, 4):
                assert not shards[i] & shards[j]
        # A host's stream keeps the order's structure.
        h0 = hosts[0].epoch_order(0)
        if order == "topic":
            assert runs(TOPICS[h0]) == len(np.unique(TOPICS[h0]))
        if order == "difficulty":
            assert np.all(np.diff(DIFFICULTY[h0]) >= 0)
        # Every host is in the same epoch after the same number of steps.
        assert {h.state()["epoch"] for h in hosts} == {1}


def test_restore_rejects_other_data_or_sharding():
    saved = make("topic", shard=Shard(0, 2)).state()
    with pytest.raises(ValueError, match="saved for other data"):
        make("topic", shard=Shard(1, 2)).restore(saved)
    with pytest.raises(ValueError, match="saved for other data"):
        make("naive", shard=Shard(0, 2)).restore(saved)
    with pytest.raises(ValueError, match="out of range"):
        make("naive").restore({"epoch": 0, "position": N})


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown order 'shuffle'"):
        RecordOrder(N, order="shuffle")
    with pytest.raises(ValueError, match="order 'topic' needs topic_ids"):
        RecordOrder(N, order="topic")
    with pytest.raises(ValueError, match="difficulty has shape"):
        RecordOrder(N, order="difficulty", difficulty=DIFFICULTY[:5])
    with pytest.raises(ValueError, match="NaN"):
        RecordOrder(3, order="difficulty", difficulty=[0.1, np.nan, 0.2])
    with pytest.raises(ValueError, match="host_id 2 not in"):
        RecordOrder(N, shard=Shard(2, 2))
    with pytest.raises(ValueError, match="batch_size must be"):
        RecordOrder(N).next_indices(0)
