"""Paired comparisons and power analysis: scipy references, Monte Carlo, and Holm by hand."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ebpo_jax import ablation
from ebpo_jax.ablation import power


def _mc_power(n, effect, sd, alpha=0.05, sims=40_000, seed=0):
    """Rejection rate of scipy's paired t-test on simulated N(effect, sd) differences."""
    d = np.random.default_rng(seed).normal(effect, sd, (sims, n))
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    return float((p < alpha).mean())


@pytest.mark.parametrize("n,effect,sd", [(4, 0.02, 0.02), (10, 0.02, 0.03), (25, 0.01, 0.03)])
def test_power_matches_monte_carlo(n, effect, sd):
    got = power.paired_power(n, effect, sd)
    want = _mc_power(n, effect, sd)
    assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / 40_000) + 1e-3, (got, want)


def test_seeds_needed_is_minimal_and_matches_published_values():
    # Cohen's d = effect / sd; G*Power's one-sample two-tailed t-test, power 0.8, alpha 0.05.
    for d, n in [(0.3, 90), (0.5, 34), (0.8, 15), (1.0, 10)]:
        assert power.seeds_needed(d * 0.05, 0.05) == n
    for effect, sd in [(0.02, 0.05), (0.02, 0.01), (0.05, 0.2), (0.03, 0.001)]:
        n = power.seeds_needed(effect, sd, power=0.9, alpha=0.01)
        brute = next(k for k in range(2, 10_000) if power.paired_power(k, effect, sd, 0.01) >= 0.9)
        assert n == brute
    # Monte Carlo: the chosen count reaches the power, one fewer does not (effect 2 points).
    n = power.seeds_needed(0.02, 0.025)
    assert _mc_power(n, 0.02, 0.025) >= 0.79 and _mc_power(n - 1, 0.02, 0.025, seed=1) < 0.81
    with pytest.raises(ValueError, match="effect"):
        power.seeds_needed(0.0, 0.1)
    with pytest.raises(ValueError, match="pilot"):
        power.seeds_needed(0.02, float("nan"))


def test_sd_upper_is_a_chi_square_bound():
    rng = np.random.default_rng(0)
    samples = rng.normal(0, 0.04, (20_000, 4))
    sds = samples.std(axis=1, ddof=1)
    covered = np.mean([power.sd_upper(s, 4) >= 0.04 for s in sds[:5000]])
    assert abs(covered - 0.8) < 0.02


def test_paired_test_matches_scipy():
    rng = np.random.default_rng(1)
    a, b = rng.uniform(0.2, 0.4, 7), rng.uniform(0.2, 0.4, 7)
    got = power.paired_test(a, b)
    ref = stats.ttest_rel(a, b)
    lo, hi = ref.confidence_interval(0.95)
    assert got["p"] == pytest.approx(ref.pvalue)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((lo, hi))
    assert got["diff"] == pytest.approx((a - b).mean()) and got["seeds"] == 7
    assert got["sd"] == pytest.approx((a - b).std(ddof=1))
    same = power.paired_test([0.5, 0.75], [0.25, 0.5])  # constant difference: sd 0, p 0
    assert same["p"] == 0.0 and same["ci_low"] == same["ci_high"] == 0.25
    assert np.isnan(power.paired_test([0.3], [0.2])["p"])


def test_holm_hand_examples_and_step_down_definition():
    np.testing.assert_allclose(power.holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(power.holm([0.5, 0.9]), [1.0, 1.0])
    out = power.holm([0.02, np.nan, 0.01])  # NaN is no hypothesis: m = 2
    np.testing.assert_allclose(out, [0.02, np.nan, 0.02])
    rng = np.random.default_rng(0)
    for _ in range(200):  # adjusted <= alpha  <=>  rejected by Holm's step-down procedure
        p = rng.uniform(0, 0.1, rng.integers(1, 8))
        alpha = rng.uniform(0.01, 0.1)
        rejected, m = set(), len(p)
        for k, i in enumerate(np.argsort(p)):
            if p[i] > alpha / (m - k):
                break
            rejected.add(int(i))
        assert set(np.flatnonzero(power.holm(p) <= alpha).tolist()) == rejected


def test_verdict_rule():
    assert power.verdict(0.01, 0.05, 1) == "reproduced"
    assert power.verdict(-0.05, -0.01, 1) == "opposite"
    assert power.verdict(-0.05, -0.01, -1) == "reproduced"
    assert power.verdict(-0.01, 0.05, 1) == "inconclusive"
    assert power.verdict(np.nan, np.nan, 1) == "inconclusive"
    assert power.holm_verdict(0.02, 0.01, 1) == "reproduced"
    assert power.holm_verdict(-0.02, 0.01, 1) == "opposite"
    assert power.holm_verdict(0.02, 0.2, 1) == "inconclusive"
    with pytest.raises(ValueError, match="direction"):
        power.verdict(0.1, 0.2, 0)


def test_claims_hold_out_rows_without_direction():
    table = pd.DataFrame(
        {
            "diff": [0.03, -0.02, 0.01],
            "ci_low": [0.01, -0.03, -0.01],
            "ci_high": [0.05, -0.01, 0.03],
            "p": [0.01, 0.02, 0.3],
        }
    )
    out = ablation.claims(table, [1, 1, 0])
    np.testing.assert_allclose(out.p_holm[:2], [0.02, 0.02])
    assert np.isnan(out.p_holm[2])
    assert list(out.verdict) == ["reproduced", "opposite", "n/a"]
    assert list(out.verdict_holm) == ["reproduced", "opposite", "n/a"]


def test_quadrature_fallback_agrees_with_nct():
    for n, nc in [(2, 1.5), (5, 3.0), (12, 0.7)]:
        crit = stats.t.ppf(0.975, n - 1)
        ref = stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
        assert power._power_by_quadrature(crit, n - 1, nc) == pytest.approx(ref, abs=1e-7)
    # nct alone returns NaN at nc = 42, df = 1; Monte Carlo is the reference there.
    got = power.paired_power(2, 0.03, 0.001, 0.01)
    assert abs(got - _mc_power(2, 0.03, 0.001, alpha=0.01)) < 0.01
    assert power.seeds_needed(0.03, 0.001, power=0.9, alpha=0.01) == 3


def test_warm_starts_needed_reaches_power_on_simulated_two_level_data():
    """Simulated d_ws = mu + u_w + e_ws: at the W it returns, the t over warm-start means
    rejects ~80% of the time, and at W - 1 less."""
    effect, tau, sigma, n = 0.015, 0.011, 0.009, 2
    big_w = power.warm_starts_needed(effect, tau, sigma, n)
    assert big_w == power.seeds_needed(effect, np.sqrt(tau**2 + sigma**2 / n))
    assert power.warm_starts_needed(effect, tau, sigma, 8) <= big_w  # more seeds never hurt
    rng = np.random.default_rng(0)

    def rejects(w):
        d = effect + rng.normal(0, tau, (20000, w, 1)) + rng.normal(0, sigma, (20000, w, n))
        m = d.mean(2)
        t = m.mean(1) / (m.std(1, ddof=1) / np.sqrt(w))
        return np.mean(np.abs(t) > stats.t.ppf(0.975, w - 1))

    assert 0.79 <= rejects(big_w) <= 0.85 and rejects(big_w - 1) < 0.8
