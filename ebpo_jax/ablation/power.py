"""Paired comparisons over seeds: t-test, 95% interval, Holm correction, verdicts, and the
number of seeds a paired t-test needs to detect an effect (power from the noncentral t).

Seeds pair the runs: seed s of method a and seed s of method b share the warm start, the
problem order and the sampler keys, so the test is on the per-seed differences d_s = a_s - b_s.
Power of the two-sided paired t-test with n seeds, true mean difference `effect` and
difference std `sd`: P(|T| > t_{1-alpha/2, n-1}) with T ~ noncentral t(n - 1,
effect * sqrt(n) / sd) (scipy.stats.nct). statsmodels' TTestPower computes the same; it is
not a dependency here, so the formula is written out and checked by Monte Carlo in the tests.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy import integrate, stats

VERDICTS = ("reproduced", "opposite", "inconclusive")


class PowerAnalysis(NamedTuple):
    """Seeds by power analysis: a pilot of `pilot_seeds`, then enough seeds (at most
    `max_seeds`) to detect `effect` with `power` (effect 0: off)."""

    effect: float = 0.0
    power: float = 0.8
    pilot_seeds: int = 4
    max_seeds: int = 20


def paired_power(n: int, effect: float, sd: float, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level `alpha` with n pairs."""
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if effect != 0 else alpha
    df, nc = n - 1, effect * math.sqrt(n) / sd
    crit = stats.t.ppf(1 - alpha / 2, df)
    out = float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    return out if math.isfinite(out) else _power_by_quadrature(crit, df, nc)


def _power_by_quadrature(crit: float, df: int, nc: float) -> float:
    """P(|T| > crit), T = (Z + nc) / sqrt(V / df), V ~ chi2(df): integrated over V.

    scipy's nct returns NaN for large noncentralities (e.g. nc = 42 at df = 1).
    """

    def tails(v):
        s = crit * math.sqrt(v / df)
        return (stats.norm.cdf(nc - s) + stats.norm.cdf(-s - nc)) * stats.chi2.pdf(v, df)

    return float(integrate.quad(tails, 0, np.inf, limit=200)[0])


def seeds_needed(
    effect: float, sd: float, *, power: float = 0.8, alpha: float = 0.05, max_n: int = 10_000
) -> int:
    """The smallest n >= 2 of paired seeds whose paired t-test reaches `power` (max_n if none)."""
    if effect <= 0:
        raise ValueError(f"effect must be > 0 (the smallest difference to detect), got {effect}")
    if not 0 < power < 1 or not 0 < alpha < 1:
        raise ValueError(f"power and alpha must be in (0, 1), got {power}, {alpha}")
    if not np.isfinite(sd):
        raise ValueError(f"the pilot's difference std is {sd}; a pilot needs >= 2 paired seeds")
    # The normal approximation is a lower bound; step up from it to the exact t answer.
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, math.floor((z * sd / effect) ** 2))
    while n < max_n and paired_power(n, effect, sd, alpha) < power:
        n += 1
    return n


def warm_starts_needed(
    effect: float, tau: float, sigma: float, seeds: int, *, power: float = 0.8, alpha: float = 0.05
) -> int:
    """Warm starts W a two-level claim needs for `power` at `effect` with `seeds` RL seeds
    under each: its test is the t over W warm-start means, whose sd is sqrt(tau2 + sigma2 / n)
    (tau: warm-start sd, sigma: RL-seed sd of the paired differences; twolevel.interval)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    return seeds_needed(effect, math.sqrt(tau**2 + sigma**2 / seeds), power=power, alpha=alpha)


def sd_upper(sd: float, n: int, confidence: float = 0.8) -> float:
    """One-sided upper confidence bound of a std estimated from n samples (chi-square)."""
    if n < 2:
        return math.nan
    return float(sd * math.sqrt((n - 1) / stats.chi2.ppf(1 - confidence, n - 1)))


def paired_test(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of a - b, its 95% t-interval, the two-sided paired t-test p-value, std and pairs."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    n = d.size
    out = {"diff": float(d.mean()) if n else math.nan, "seeds": n}
    if n < 2:
        return {**out, "ci_low": math.nan, "ci_high": math.nan, "p": math.nan, "sd": math.nan}
    sd = float(d.std(ddof=1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    if sd == 0:  # every seed gave the same difference: scipy returns NaN for 0 / 0
        p = 1.0 if out["diff"] == 0 else 0.0
    else:
        p = float(stats.ttest_rel(np.asarray(a, np.float64), np.asarray(b, np.float64)).pvalue)
    return {**out, "ci_low": out["diff"] - half, "ci_high": out["diff"] + half, "p": p, "sd": sd}


def holm(pvalues: Sequence[float], family: int | None = None) -> np.ndarray:
    """Holm step-down adjusted p-values; NaNs stay NaN. `family`: the number of hypotheses,
    NaNs included as never rejected (a claim not run); by default the finite p-values."""
    p = np.asarray(pvalues, np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = idx.size if family is None else family
    if m < idx.size:
        raise ValueError(f"Holm family of {m} hypotheses, but {idx.size} have p-values")
    order = idx[np.argsort(p[idx], kind="stable")]
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * p[i]))
        out[i] = running
    return out


def verdict(low: float, high: float, direction: int) -> str:
    """The pre-stated rule: `reproduced` when the interval excludes 0 on the paper's side
    (direction +1: a > b), `opposite` when it excludes 0 on the other side, else `inconclusive`."""
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction}")
    if not (np.isfinite(low) and np.isfinite(high)):
        return "inconclusive"
    if low > 0 or high < 0:
        return "reproduced" if (low > 0) == (direction > 0) else "opposite"
    return "inconclusive"


def holm_verdict(diff: float, p_holm: float, direction: int, alpha: float = 0.05) -> str:
    """The same rule at the family-wise level: the Holm-adjusted p-value decides."""
    if not np.isfinite(p_holm) or p_holm >= alpha:
        return "inconclusive"
    return "reproduced" if (diff > 0) == (direction > 0) else "opposite"
