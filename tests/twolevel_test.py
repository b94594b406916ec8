"""The held intervals of ebpo_jax/ablation/twolevel.py against hand and brute-force references."""

import numpy as np
import pytest
from scipy import stats

from ebpo_jax.ablation import twolevel


def _anova(d_wn):
    """Balanced one-way ANOVA by hand: grand mean, MS between, MS within."""
    big_w, n = d_wn.shape
    grand = d_wn.mean()
    ms_between = n * ((d_wn.mean(1) - grand) ** 2).sum() / (big_w - 1)
    ms_within = ((d_wn - d_wn.mean(1, keepdims=True)) ** 2).sum() / (big_w * (n - 1))
    return grand, ms_between, ms_within


def test_floor_binds_when_warm_start_means_agree_more_than_seed_noise_allows():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, (5, 3))
    d_wn = 0.01 + noise - noise.mean(1, keepdims=True) + rng.normal(0, 1e-4, (5, 1))
    warm = np.repeat(np.arange(5), 3)
    grand, ms_between, ms_within = _anova(d_wn)
    out = twolevel.floored(d_wn.ravel(), warm)
    se, se_floor = np.sqrt(ms_between / 15), np.sqrt(ms_within / 15)
    t = stats.t.ppf(0.975, 4)
    assert out["floored"] and out["se"] == pytest.approx(se) and se < se_floor
    assert out["se_floor"] == pytest.approx(se_floor)
    assert out["ci_high"] - grand == pytest.approx(t * se_floor)
    assert out["p"] == pytest.approx(2 * stats.t.sf(abs(grand) / se_floor, 4))
    # Spread-out warm starts: the floor does not bind and the interval is the two-level one.
    d_wn = d_wn + rng.normal(0, 0.05, (5, 1))
    out, plain = twolevel.floored(d_wn.ravel(), warm), twolevel.interval(d_wn.ravel(), warm)
    assert not out["floored"]
    assert (out["ci_low"], out["ci_high"], out["p"]) == pytest.approx(
        (plain["ci_low"], plain["ci_high"], plain["p"])
    )


def test_floor_with_unequal_seeds_per_warm_start():
    d = np.array([0.010, 0.012, 0.011, 0.030, 0.011, -0.010, 0.013])
    warm = np.array([0, 0, 0, 1, 1, 2, 2])
    out = twolevel.floored(d, warm)
    groups = [d[warm == w] for w in range(3)]
    sigma2 = sum(((g - g.mean()) ** 2).sum() for g in groups) / (len(d) - 3)
    want = np.sqrt(sigma2 * sum(1 / len(g) for g in groups)) / 3
    assert out["se_floor"] == pytest.approx(want)
    assert out["diff"] == pytest.approx(np.mean([g.mean() for g in groups]))


@pytest.mark.slow  # 500 simulated grids: ~9 s on a quiet 2-core machine, minutes loaded
def test_floored_interval_covers_at_least_95pct():
    """No warm-start effect (tau = 0): the floored interval covers mu at >= 95%."""
    rng = np.random.default_rng(2)
    reps, big_w, n, mu = 500, 3, 3, 0.01
    d = mu + rng.normal(0, 0.01, (reps, big_w, n))
    warm = np.repeat(np.arange(big_w), n)
    outs = [twolevel.floored(x.ravel(), warm) for x in d]
    hits = np.mean([o["ci_low"] <= mu <= o["ci_high"] for o in outs])
    assert hits >= 0.95, hits
    assert np.mean([o["floored"] for o in outs]) > 0.2  # the floor is doing something


def test_bootstrap_equals_a_brute_force_resample_with_the_same_draws():
    rng = np.random.default_rng(3)
    big_k, big_j = 6, 7
    d_kj = rng.normal(0.01, 0.2, (big_k, big_j))
    d_kj[4, 2] = np.nan  # a problem one run did not evaluate
    cluster = np.array([2, 2, 5, 5, 9, 9])
    out = twolevel.bootstrap(d_kj, cluster, draws=50, seed=7)
    draw = np.random.default_rng(7)
    n_c = draw.multinomial(3, np.full(3, 1 / 3), size=50)
    n_j = draw.multinomial(big_j, np.full(big_j, 1 / big_j), size=50)
    effects = []
    for b in range(50):
        clusters = np.repeat([2, 5, 9], n_c[b])
        problems = np.repeat(np.arange(big_j), n_j[b])
        per_cluster = []
        for c in clusters:
            runs = d_kj[cluster == c]
            per_problem = [np.nanmean(runs[:, j]) for j in problems]  # mean over its runs
            per_cluster.append(np.mean(per_problem))
        effects.append(np.mean(per_cluster))
    lo, hi = np.quantile(effects, [0.025, 0.975])
    assert (out["ci_low"], out["ci_high"]) == pytest.approx((lo, hi), rel=1e-12)
    p = 2 * min(np.mean(np.array(effects) <= 0), np.mean(np.array(effects) >= 0))
    assert out["p"] == pytest.approx(min(p, 1.0))
    per_cluster = [np.nanmean(d_kj[cluster == c], axis=0).mean() for c in (2, 5, 9)]
    assert out["diff"] == pytest.approx(np.mean(per_cluster))
    assert out["clusters"] == 3 and out["problems"] == big_j


def test_bootstrap_covers_when_problems_are_the_binding_noise():
    """Crossed data (problem effects shared by every run, small cluster effects): the
    problem bootstrap covers ~95%, a seed-only interval far less."""
    rng = np.random.default_rng(4)
    reps, big_c, big_j, mu = 200, 5, 60, 0.01
    hits, seed_only = [], []
    cluster = np.repeat(np.arange(big_c), 3)
    for _ in range(reps):
        d = (mu + rng.normal(0, 0.15, (1, big_j)) + rng.normal(0, 0.005, (big_c, 1, 1))
             + rng.normal(0, 0.05, (big_c, 3, big_j))).reshape(-1, big_j)  # fmt: skip
        out = twolevel.bootstrap(d, cluster, draws=1000, seed=0)
        hits.append(out["ci_low"] <= mu <= out["ci_high"])
        plain = twolevel.interval(d.mean(1), cluster)
        seed_only.append(plain["ci_low"] <= mu <= plain["ci_high"])
    assert 0.9 <= np.mean(hits) <= 0.99, np.mean(hits)
    assert np.mean(seed_only) < 0.7, np.mean(seed_only)
