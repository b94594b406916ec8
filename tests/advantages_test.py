"""EBPO and baseline estimators against float64 numpy references and the paper's claims."""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ebpo_jax
from ebpo_jax import advantages

EPS = 1e-6


class ReferenceEB:
    """Float64 brute force: keeps every reward and group mean seen, per cluster.

    `per_batch` forgets the history every call; `mu_glob="group_means"` shrinks toward the
    mean of the group means (both: the authors' released code); `normalize` as eb_advantage.
    """

    def __init__(self, num_clusters=1, mu_glob="all_rewards", per_batch=False, normalize="batch"):
        self.num_clusters, self.mu_glob, self.per_batch = num_clusters, mu_glob, per_batch
        self.normalize = normalize
        self.rewards = [[] for _ in range(num_clusters)]
        self.group_means = [[] for _ in range(num_clusters)]

    def __call__(self, rewards, mask=None, cluster_ids=None):
        if self.per_batch:
            self.__init__(self.num_clusters, self.mu_glob, False, self.normalize)
            self.per_batch = True
        r = np.asarray(rewards, np.float64)
        m = np.ones(r.shape, bool) if mask is None else np.asarray(mask)
        cids = np.zeros(len(r), int) if cluster_ids is None else np.asarray(cluster_ids)
        for q in range(len(r)):
            if m[q].any():
                self.rewards[cids[q]].extend(r[q][m[q]])
                self.group_means[cids[q]].append(r[q][m[q]].mean())
        raw = np.zeros_like(r)
        shrink, prior_std = np.zeros(len(r)), np.zeros(len(r))
        for q in range(len(r)):
            if not m[q].any():
                continue
            k = cids[q]
            rew, gm = np.array(self.rewards[k]), np.array(self.group_means[k])
            sigma2 = rew.var() if len(rew) >= 2 else 0.0
            tau2 = gm.var() if len(gm) >= 2 else 0.0
            mu = rew.mean() if self.mu_glob == "all_rewards" else gm.mean()
            noise = sigma2 / m[q].sum()
            s = noise / (noise + tau2) if noise + tau2 > EPS else 1.0
            v = (1 - s) * r[q][m[q]].mean() + s * mu
            raw[q] = r[q] - v
            shrink[q], prior_std[q] = s, np.sqrt(sigma2)
        if self.normalize == "none":
            return np.where(m, raw, 0.0), shrink
        if self.normalize == "group":
            adv = np.zeros_like(r)
            for q in range(len(r)):
                vals = raw[q][m[q]]
                # A constant group (or a singleton) has std exactly 0: the prior's std instead.
                std = vals.std(ddof=1) if vals.size > 1 and np.ptp(vals) > 0 else 0.0
                adv[q] = raw[q] / ((std if std > 0 else prior_std[q]) + EPS)
            return np.where(m, adv, 0.0), shrink
        vals = raw[m]
        std = vals.std(ddof=1) if vals.size > 1 else 0.0
        adv = np.where(m, (raw - vals.mean()) / (std + EPS), 0.0)
        return adv, shrink


def _random_batch(rng, P, G, p_mask=0.0, num_clusters=1):
    rewards = (rng.random((P, G)) < rng.random((P, 1))).astype(np.float32)
    mask = rng.random((P, G)) >= p_mask
    cids = rng.integers(0, num_clusters, P)
    return rewards, mask, cids


@pytest.mark.parametrize("num_clusters,p_mask", [(1, 0.0), (1, 0.3), (3, 0.0), (3, 0.3)])
def test_eb_advantage_matches_float64_reference_over_a_stream(num_clusters, p_mask):
    rng = np.random.default_rng(0)
    ref = ReferenceEB(num_clusters)
    state = ebpo_jax.init_eb_state(num_clusters)
    step = jax.jit(lambda r, s, m, c: ebpo_jax.eb_advantage(r, s, mask=m, cluster_ids=c))
    for _ in range(6):
        r, m, c = _random_batch(rng, 16, 4, p_mask, num_clusters)
        adv, state = step(r, state, m, c)
        want, want_shrink = ref(r, m, c)
        np.testing.assert_allclose(adv, want, atol=2e-5, rtol=1e-4)
        diag = ebpo_jax.eb_diagnostics(r, state, mask=m, cluster_ids=c)
        np.testing.assert_allclose(diag["shrinkage"], want_shrink, atol=1e-5)


@pytest.mark.parametrize(
    "mu_glob,per_batch,normalize",
    [
        ("group_means", True, "batch"),  # the authors' released code
        ("group_means", False, "batch"),
        ("all_rewards", False, "group"),
        ("group_means", True, "group"),
    ],
)
def test_eb_variants_match_float64_reference(mu_glob, per_batch, normalize):
    rng = np.random.default_rng(5)
    ref = ReferenceEB(3, mu_glob, per_batch, normalize)
    opts = {"mu_glob": mu_glob, "per_batch": per_batch, "normalize": normalize}
    step = jax.jit(lambda r, s, m, c: ebpo_jax.eb_advantage(r, s, mask=m, cluster_ids=c, **opts))
    state, other = ebpo_jax.init_eb_state(3), ebpo_jax.init_eb_state(3)
    differs = False
    for _ in range(4):
        # G = 8 with masks: constant groups (all fail / all pass) and unequal group sizes.
        r, m, c = _random_batch(rng, 16, 8, 0.3, 3)
        adv, state = step(r, state, m, c)
        want, want_shrink = ref(r, m, c)
        np.testing.assert_allclose(adv, want, atol=2e-5, rtol=1e-4)
        assert np.abs(adv).max() < 50  # the 1e5 blow-up of constant groups is gone
        diag = ebpo_jax.eb_diagnostics(r, state, mask=m, cluster_ids=c, mu_glob=mu_glob)
        np.testing.assert_allclose(diag["shrinkage"], want_shrink, atol=1e-5)
        flip = {"all_rewards": "group_means", "group_means": "all_rewards"}[mu_glob]
        adv_other, other = ebpo_jax.eb_advantage(
            r, other, mask=m, cluster_ids=c, **(opts | {"mu_glob": flip})
        )
        differs |= bool(np.abs(np.asarray(adv) - np.asarray(adv_other)).max() > 1e-3)
    assert differs  # the two mu_glob choices really differ on these batches


CONSTANTS = (0.0, 1.0, 0.3, 1e3, -2.7)
ESTIMATOR_CASES = [("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("reinforce_pp_baseline", {})] + [
    ("ebpo", {"normalize": n, "mu_glob": g, "per_batch": b})
    for n in ("batch", "group", "none")
    for g, b in (("all_rewards", False), ("group_means", True))
]


@pytest.mark.parametrize("name,options", ESTIMATOR_CASES, ids=lambda x: str(x))
def test_constant_batches_give_exactly_zero(name, options):
    # Float32 sums of 7-8 equal values are not exact: unshifted, the std of a constant group
    # came out around 1e-9..5e-7 instead of 0 and EBPO's group normalisation gave 1e5.
    rewards = np.array(CONSTANTS, np.float32)[:, None, None] * np.ones((1, 3, 8), np.float32)
    mask = np.ones((3, 8), bool)
    mask[1, 7] = False  # one G = 7 group
    rewards[:, 1, 7] = 123.0  # masked: must not count
    state = ebpo_jax.init_eb_state()
    fn = lambda r: advantages.estimate(name, r, state, mask=mask, **options)[0]
    adv = jax.jit(jax.vmap(fn))(rewards)
    np.testing.assert_array_equal(adv, 0.0)


def test_constant_groups_in_a_varied_batch():
    rewards = np.repeat(np.array(CONSTANTS + (0.0,), np.float32)[:, None], 8, axis=1)
    rewards[-1] = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    for name in ("grpo", "dr_grpo", "rloo"):
        np.testing.assert_array_equal(advantages.get(name)(rewards)[:-1], 0.0, err_msg=name)
    for normalize in ("group", "batch", "none"):
        adv, _ = ebpo_jax.eb_advantage(rewards, ebpo_jax.init_eb_state(), normalize=normalize)
        want, _ = ReferenceEB(normalize=normalize)(rewards)
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6, err_msg=normalize)


def test_cluster_matmuls_run_at_full_float32_precision():
    # TPUs run DEFAULT-precision float32 matmuls as one bfloat16 pass; the one-hot gathers
    # and per-cluster sums of the EB statistics must not.
    r, m, c = _random_batch(np.random.default_rng(6), 8, 4, 0.2, 3)
    fn = lambda r: advantages.estimate("ebpo", r, ebpo_jax.init_eb_state(3), mask=m, cluster_ids=c)
    text = str(jax.make_jaxpr(fn)(r))
    assert text.count("dot_general[") >= 8
    assert text.count("dot_general[") == text.count(
        "precision=(Precision.HIGHEST, Precision.HIGHEST)"
    )


def test_eb_hand_computed_example():
    # Rows: half right, all wrong. sigma2 = 0.1875, tau2 = 0.0625, S = 0.046875 / 0.109375.
    r = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    adv, state = ebpo_jax.eb_advantage(r, ebpo_jax.init_eb_state())
    s = 0.046875 / 0.109375
    v = np.array([(1 - s) * 0.5 + s * 0.25, s * 0.25])
    raw = np.asarray(r) - v[:, None]
    want = (raw - raw.mean()) / (raw.std(ddof=1) + EPS)
    np.testing.assert_allclose(adv, want, rtol=1e-5)
    np.testing.assert_allclose(state.reward.count, [8.0])
    np.testing.assert_allclose(state.group.m2, [0.125])


def test_all_fail_group_gets_negative_advantage_where_grpo_gives_zero():
    state = ebpo_jax.init_eb_state()
    history = jnp.array([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    _, state = ebpo_jax.eb_advantage(history, state)
    fail = jnp.array([[0.0, 0.0, 0.0, 0.0]])
    adv, _ = ebpo_jax.eb_advantage(fail, state, normalize="none")
    assert (adv < 0).all()
    np.testing.assert_array_equal(ebpo_jax.grpo_advantage(fail), 0.0)


def test_a_batch_that_fails_everywhere_standardises_to_zero():
    """PAPER.md's batch standardisation: equal raw advantages (one cluster, one G) map to 0."""
    state = ebpo_jax.init_eb_state()
    _, state = ebpo_jax.eb_advantage(jnp.array([[1.0, 1.0, 0.0, 1.0]]), state)
    fail = jnp.zeros((3, 4))
    raw, _ = ebpo_jax.eb_advantage(fail, state, normalize="none")
    adv, _ = ebpo_jax.eb_advantage(fail, state)
    assert (raw < 0).all() and jnp.unique(raw).size == 1
    np.testing.assert_array_equal(adv, 0.0)
    some_pass = fail.at[0, 0].set(1.0)  # one success: the failing groups fall below 0 again
    adv, _ = ebpo_jax.eb_advantage(some_pass, state)
    assert (adv[1:] < 0).all() and adv[0, 0] > 0


def test_failing_an_easy_cluster_costs_more_than_a_hard_one():
    state = ebpo_jax.init_eb_state(num_clusters=2)
    easy_hard = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]] * 2)
    cids = jnp.array([0, 0, 1, 0, 0, 1])
    _, state = ebpo_jax.eb_advantage(easy_hard, state, cluster_ids=cids)
    fail = jnp.zeros((2, 4))
    adv, _ = ebpo_jax.eb_advantage(fail, state, cluster_ids=jnp.array([0, 1]), normalize="none")
    assert adv[0, 0] < adv[1, 0] < 0


def test_clusters_are_independent():
    state = ebpo_jax.init_eb_state(num_clusters=2)
    r = jnp.array([[1.0, 0.0], [0.0, 0.0]])
    _, state = ebpo_jax.eb_advantage(r, state, cluster_ids=jnp.array([0, 0]))
    before = jax.tree.map(lambda x: x[0], state)
    _, state = ebpo_jax.eb_advantage(r * 0.3, state, cluster_ids=jnp.array([1, 1]))
    chex.assert_trees_all_equal(before, jax.tree.map(lambda x: x[0], state))
    assert state.reward.count[1] == 4


@settings(max_examples=15, deadline=None)  # each split shape compiles its own merge
@given(
    values=hnp.arrays(np.float32, (12, 3), elements=st.floats(-100, 100, width=32)),
    splits=st.lists(st.integers(1, 11), max_size=4, unique=True),
)
def test_streaming_merge_equals_two_pass(values, splits):
    state = ebpo_jax.init_eb_state()
    for chunk in np.split(values, sorted(splits)):
        state = advantages.merge_batch(state, chunk)
    flat = values.astype(np.float64).ravel()
    np.testing.assert_allclose(state.reward.count, [flat.size])
    np.testing.assert_allclose(state.reward.mean, [flat.mean()], atol=1e-3, rtol=1e-5)
    np.testing.assert_allclose(state.reward.m2 / flat.size, [flat.var()], atol=1e-2, rtol=1e-4)
    group = values.astype(np.float64).mean(1)
    np.testing.assert_allclose(state.group.m2 / group.size, [group.var()], atol=1e-2, rtol=1e-4)


def test_merge_is_stable_at_1e8_counts():
    n = 1e8
    state = advantages.EBState(
        advantages.Welford(jnp.array([n]), jnp.array([0.3]), jnp.array([0.21 * n])),
        advantages.Welford(jnp.array([n / 4]), jnp.array([0.3]), jnp.array([0.05 * n / 4])),
    )
    r = np.random.default_rng(1).random((512, 8)).round().astype(np.float32)
    adv, new = ebpo_jax.eb_advantage(r, state)
    assert np.isfinite(adv).all()
    want_mean = (0.3 * n + r.sum()) / (n + r.size)
    np.testing.assert_allclose(new.reward.mean, [want_mean], rtol=1e-6)
    want_var = (
        0.21 * n + ((r - r.mean()) ** 2).sum() + (r.mean() - 0.3) ** 2 * n * r.size / (n + r.size)
    ) / (n + r.size)
    np.testing.assert_allclose(new.reward.m2 / new.reward.count, [want_var], rtol=1e-5)


def test_shrinkage_in_unit_interval_and_affine_invariance():
    rng = np.random.default_rng(2)
    r, m, _ = _random_batch(rng, 32, 4, 0.2)
    r = r + rng.normal(size=r.shape).astype(np.float32) * 0.1
    state = ebpo_jax.init_eb_state()
    adv, new = ebpo_jax.eb_advantage(r, state, mask=m)
    s = ebpo_jax.eb_diagnostics(r, new, mask=m)["shrinkage"]
    assert ((s >= 0) & (s <= 1)).all()
    adv_scaled, _ = ebpo_jax.eb_advantage(3.0 * r - 7.0, state, mask=m)
    np.testing.assert_allclose(adv, adv_scaled, atol=2e-4)


def test_eb_baseline_has_lower_mse_than_group_mean():
    # Gaussian model: prompt difficulty ~ N(mu, tau2), rewards ~ N(difficulty, sigma2).
    rng = np.random.default_rng(3)
    P, G, mu, tau, sigma = 4096, 4, 0.4, 0.1, 0.5
    theta = rng.normal(mu, tau, P)
    r = (theta[:, None] + rng.normal(0, sigma, (P, G))).astype(np.float32)
    _, state = ebpo_jax.eb_advantage(r, ebpo_jax.init_eb_state())
    baseline = np.asarray(ebpo_jax.eb_diagnostics(r, state)["baseline"], np.float64)
    mse_eb = ((baseline - theta) ** 2).mean()
    mse_group = ((r.mean(1) - theta) ** 2).mean()
    assert mse_eb < 0.5 * mse_group  # closed form ratio here is (1 - S) ~ 0.14


def test_per_batch_forgetting_and_group_normalize():
    r1 = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    r2 = jnp.array([[0.0, 0.0], [1.0, 0.0]])
    _, s1 = ebpo_jax.eb_advantage(r1, ebpo_jax.init_eb_state())
    a_fresh, _ = ebpo_jax.eb_advantage(r2, ebpo_jax.init_eb_state())
    a_pb, s_pb = ebpo_jax.eb_advantage(r2, s1, per_batch=True)
    np.testing.assert_allclose(a_pb, a_fresh)
    assert s_pb.reward.count[0] == 4
    _, s_f = ebpo_jax.eb_advantage(r2, s1, forgetting=0.5)
    np.testing.assert_allclose(s_f.reward.count, [4 * 0.5 + 4])
    a_g, _ = ebpo_jax.eb_advantage(r2, s1, normalize="group")
    assert np.isfinite(a_g).all() and (a_g[0] < 0).all()
    with pytest.raises(ValueError, match="normalize"):
        ebpo_jax.eb_advantage(r2, s1, normalize="batchh")
    with pytest.raises(ValueError, match="forgetting"):
        ebpo_jax.eb_advantage(r2, s1, forgetting=0.0)


def test_baselines_hand_computed():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(
        ebpo_jax.grpo_advantage(r)[0], (np.array([1, 0, 0, 1]) - 0.5) / (std + EPS), rtol=1e-6
    )
    np.testing.assert_array_equal(ebpo_jax.grpo_advantage(r)[1], 0.0)
    np.testing.assert_allclose(ebpo_jax.dr_grpo_advantage(r)[0], [0.5, -0.5, -0.5, 0.5])
    # RLOO: 1 - mean(0, 0, 1) = 2/3.
    np.testing.assert_allclose(
        ebpo_jax.rloo_advantage(r)[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6
    )
    centred = np.array([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])
    want = (centred - centred.mean()) / (centred.std(ddof=1) + EPS)
    np.testing.assert_allclose(ebpo_jax.reinforce_pp_baseline_advantage(r), want, rtol=1e-5)


def test_masks_in_baselines_and_singletons():
    r = jnp.array([[1.0, 0.0, 5.0, 5.0], [3.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    m = jnp.array([[True, True, False, False], [True, False, False, False], [False] * 4])
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        adv = advantages.get(name)(r, mask=m)
        assert np.isfinite(adv).all()
        np.testing.assert_array_equal(adv[~np.asarray(m)], 0.0)
    np.testing.assert_allclose(ebpo_jax.dr_grpo_advantage(r, mask=m)[0, :2], [0.5, -0.5])
    # Singleton group: verl's convention (mean 0, std 1) gives A = r.
    np.testing.assert_allclose(ebpo_jax.grpo_advantage(r, mask=m)[1, 0], 3.0, rtol=1e-5)


def test_masked_entries_do_not_touch_state():
    r = jnp.array([[1.0, 0.0, 100.0], [0.0, 1.0, -50.0]])
    m = jnp.array([[True, True, False], [True, True, False]])
    adv, s = ebpo_jax.eb_advantage(r, ebpo_jax.init_eb_state(), mask=m)
    _, s_ref = ebpo_jax.eb_advantage(r[:, :2], ebpo_jax.init_eb_state())
    chex.assert_trees_all_close(s, s_ref)
    np.testing.assert_array_equal(adv[:, 2], 0.0)


@pytest.mark.parametrize(
    "rewards,mask",
    [
        (np.ones((4, 4)), None),
        (np.array([[1.0], [0.0], [1.0]]), None),
        (np.ones((2, 3)), np.zeros((2, 3), bool)),
        (np.array([[1.0, 0.0]]), np.array([[True, False]])),
    ],
    ids=["all-equal", "G=1", "empty-mask", "one-valid"],
)
def test_no_nan_on_degenerate_inputs(rewards, mask):
    for name in advantages.names():
        adv, _, metrics = advantages.estimate(name, rewards, ebpo_jax.init_eb_state(), mask=mask)
        assert np.isfinite(adv).all(), name
        assert all(np.isfinite(v) for v in metrics.values()), name


def test_jit_equals_nojit_and_vmap():
    rng = np.random.default_rng(4)
    r, m, c = _random_batch(rng, 8, 4, 0.2, 2)
    s = ebpo_jax.init_eb_state(2)
    fn = lambda r, s: ebpo_jax.eb_advantage(r, s, mask=m, cluster_ids=c)
    chex.assert_trees_all_close(fn(r, s), jax.jit(fn)(r, s), atol=1e-6)
    # vmap over independent experiments: leading axis on rewards and state.
    rs = np.stack([r, 1 - r])
    ss = jax.tree.map(lambda x: jnp.stack([x, x]), s)
    adv_v, _ = jax.vmap(fn)(rs, ss)
    np.testing.assert_allclose(adv_v[1], fn(1 - r, s)[0], atol=1e-6)
    g = jax.vmap(lambda r: ebpo_jax.grpo_advantage(r, mask=m))(rs)
    np.testing.assert_allclose(g[0], ebpo_jax.grpo_advantage(r, mask=m), atol=1e-6)


def test_bad_input_errors():
    s = ebpo_jax.init_eb_state(2)
    with pytest.raises(ValueError, match=r"rewards must be \[P, G\]"):
        ebpo_jax.eb_advantage(jnp.ones(4), s)
    with pytest.raises(ValueError, match="mask shape"):
        ebpo_jax.eb_advantage(jnp.ones((2, 4)), s, mask=jnp.ones((2, 3), bool))
    with pytest.raises(ValueError, match="cluster_ids must lie in"):
        ebpo_jax.eb_advantage(jnp.ones((2, 4)), s, cluster_ids=jnp.array([0, 2]))
    with pytest.raises(ValueError, match=r"cluster_ids must be \[P\]"):
        jax.jit(lambda c: ebpo_jax.eb_advantage(jnp.ones((2, 4)), s, cluster_ids=c))(
            jnp.zeros(3, int)
        )
    with pytest.raises(ValueError, match="rewards must be"):
        jax.jit(ebpo_jax.grpo_advantage)(jnp.ones((2, 4, 1)))
    with pytest.raises(KeyError, match="known: dr_grpo, ebpo, grpo"):
        advantages.get("gpro")


def test_registry_and_estimate_metrics():
    assert {"ebpo", "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"} <= set(advantages.names())
    assert advantages.get("grpo") is ebpo_jax.grpo_advantage
    r = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    _, _, metrics = advantages.estimate("ebpo", r, ebpo_jax.init_eb_state())
    np.testing.assert_allclose(metrics["eb/shrinkage_mean"], 0.046875 / 0.109375, rtol=1e-6)
    np.testing.assert_allclose(metrics["eb/tau2"], 0.0625)

    @advantages.register("zero_test")
    def zero(rewards, *, mask=None):
        return jnp.zeros_like(rewards)

    try:
        adv, state, metrics = advantages.estimate("zero_test", r, ebpo_jax.init_eb_state())
        assert metrics == {} and not adv.any() and state.reward.count[0] == 0
    finally:
        advantages._REGISTRY.entries.pop("zero_test")


def test_init_state_can_be_donated():
    state = ebpo_jax.init_eb_state(2)
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len({x.unsafe_buffer_pointer() for x in leaves})
    out = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    np.testing.assert_array_equal(out.reward.count, [1.0, 1.0])
