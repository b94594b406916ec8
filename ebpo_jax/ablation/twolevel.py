"""A claim's interval across warm starts: paired differences d_ws of RL seed s under warm
start w, modelled at two levels, d_ws = mu + u_w + e_ws, u_w ~ N(0, tau2) (warm start),
e_ws ~ N(0, sigma2) (RL seed).

The interval for mu is the t-interval over the warm starts' mean differences m_w, with
W - 1 degrees of freedom: each m_w ~ N(mu, tau2 + sigma2 / n_w) independently, so with
equal n_w this is exact (and equals the REML random-effects interval of the balanced
one-way model whenever its tau2 estimate is positive). Chosen over a hierarchical bootstrap
because the grids have 3-5 warm starts: resampling 3-5 clusters gives a handful of distinct
resamples, no small-sample t correction, and intervals that cover well below 95%; the
pooled paired t-test over all W x n pairs treats the warm starts as if they were RL seeds
and is too narrow whenever tau2 > 0. Unequal n_w keep mu's estimate unbiased (equal weight
per warm start) and the interval approximate. Variance components come from the one-way
ANOVA (method of moments).

`floored` keeps that interval from being narrower than RL-seed noise alone allows: Var(mean
of m_w) = (1 / W^2) sum_w (tau2 + sigma2 / n_w) >= sigma2 sum_w (1 / n_w) / W^2, so with 3-5
warm starts whose means happen to agree the standard error is raised to that bound (sigma
from the within-warm-start spread). `bootstrap` resamples warm starts (or, with one, RL
seeds) and held-out problems independently, the crossed "pigeonhole" bootstrap (Owen 2007),
so the interval also covers which problems were drawn; written out with numpy (a percentile
interval over B count vectors) because scipy.stats.bootstrap resamples one axis only.
"""

import math

import numpy as np
import pandas as pd
from scipy import stats


def interval(d, warm) -> dict:
    """mu's estimate, 95% interval and two-sided p-value from differences `d` grouped by
    warm start `warm`; with the pairs, warm starts and variance components (tau, sigma)."""
    frame = pd.DataFrame({"d": np.asarray(d, np.float64), "w": np.asarray(warm)})
    m_w = frame.groupby("w", sort=True)["d"].mean().to_numpy()
    n_w = frame.groupby("w", sort=True)["d"].size().to_numpy()
    big_w = m_w.size
    out = {"diff": float(m_w.mean()) if big_w else math.nan, "seeds": len(frame)}
    out.update(warm_starts=big_w, ci_low=math.nan, ci_high=math.nan, p=math.nan)
    out.update(tau=math.nan, sigma=math.nan)
    if big_w < 2:
        return out
    se = m_w.std(ddof=1) / math.sqrt(big_w)
    half = stats.t.ppf(0.975, big_w - 1) * se
    p = 2 * stats.t.sf(abs(out["diff"]) / se, big_w - 1) if se > 0 else float(out["diff"] == 0)
    out.update(ci_low=out["diff"] - half, ci_high=out["diff"] + half, p=float(p))
    out.update(_components(frame, m_w, n_w))
    return out


def _components(frame: pd.DataFrame, m_w: np.ndarray, n_w: np.ndarray) -> dict:
    """One-way ANOVA estimates of the warm-start (tau) and RL-seed (sigma) stds."""
    resid = frame.d - frame.groupby("w")["d"].transform("mean")
    dof = len(frame) - m_w.size
    sigma2 = float((resid**2).sum() / dof) if dof > 0 else math.nan
    n_bar = float(np.mean(n_w))
    tau2 = float(m_w.var(ddof=1) - (sigma2 / n_bar if math.isfinite(sigma2) else 0.0))
    return {"tau": math.sqrt(max(tau2, 0.0)), "sigma": math.sqrt(sigma2) if dof > 0 else math.nan}


def floored(d, warm) -> dict:
    """`interval`, its standard error raised to sigma sqrt(sum 1 / n_w) / W when below it;
    `se`, `se_floor` and `floored` (whether the floor bound) added."""
    out = interval(d, warm)
    if out["warm_starts"] < 2 or not math.isfinite(out["sigma"]):
        return {**out, "se": math.nan, "se_floor": math.nan, "floored": False}
    big_w, df = out["warm_starts"], out["warm_starts"] - 1
    n_w = pd.Series(np.asarray(warm)).value_counts().to_numpy()
    t_crit = stats.t.ppf(0.975, df)
    se = (out["ci_high"] - out["ci_low"]) / (2 * t_crit)
    se_floor = out["sigma"] * math.sqrt(float(np.sum(1.0 / n_w))) / big_w
    held = max(se, se_floor)
    p = 2 * stats.t.sf(abs(out["diff"]) / held, df) if held > 0 else float(out["diff"] == 0)
    out.update(ci_low=out["diff"] - t_crit * held, ci_high=out["diff"] + t_crit * held)
    return {**out, "p": float(p), "se": se, "se_floor": se_floor, "floored": se_floor > se}


def bootstrap(d_kj, cluster_k, *, draws: int = 10_000, seed: int = 0) -> dict:
    """Percentile 95% interval and two-sided p of the mean difference over clusters and
    problems: `d_kj` [runs, problems] per-problem differences of each paired run k (nan:
    missing), `cluster_k` its cluster (warm start, or RL seed with one warm start).

    The effect is the mean over clusters of the mean over their runs of the mean over
    problems, the two-level estimate; each draw resamples clusters and problems with
    replacement, independently. A cluster none of whose runs has a problem (e.g. a
    difficulty band of its own warm start) averages over the problems it has.
    """
    d_kj = np.asarray(d_kj, np.float64)
    labels, cluster_k = np.unique(np.asarray(cluster_k), return_inverse=True)
    big_c, big_j = labels.size, d_kj.shape[1]
    # a_cj: per cluster, the mean over its runs of each problem's difference (nan: none).
    seen_cj = np.stack([np.isfinite(d_kj[cluster_k == c]).sum(0) for c in range(big_c)])
    sum_cj = np.stack([np.nansum(d_kj[cluster_k == c], axis=0) for c in range(big_c)])
    a_cj = np.where(seen_cj > 0, sum_cj / np.maximum(seen_cj, 1), np.nan)
    rng = np.random.default_rng(seed)
    n_c = rng.multinomial(big_c, np.full(big_c, 1 / big_c), size=draws)
    n_j = rng.multinomial(big_j, np.full(big_j, 1 / big_j), size=draws)
    if np.isfinite(a_cj).all():
        effects = np.einsum("bc,cj,bj->b", n_c, a_cj, n_j) / (big_c * big_j)
        diff = float(a_cj.mean())
    else:  # clusters with their own problems (e.g. a band per warm start)
        effects, diff = _ragged(a_cj, n_c, n_j)
    lo, hi = np.quantile(effects, [0.025, 0.975])
    p = min(1.0, 2 * min((effects <= 0).mean(), (effects >= 0).mean()))
    return {"diff": diff, "ci_low": float(lo), "ci_high": float(hi), "p": float(p),
            "clusters": big_c, "problems": big_j}  # fmt: skip


def _ragged(a_cj, n_c, n_j):
    """(draws' effects, effect) when a cluster lacks some problems (nan): each cluster's mean
    over the drawn problems it has, then the mean over the drawn clusters that have any; a
    draw where none has any is left out."""
    has_cj = np.isfinite(a_cj)
    num_bc = n_j @ np.where(has_cj, a_cj, 0.0).T
    den_bc = n_j @ has_cj.T.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_bc = num_bc / den_bc
        w_bc = n_c * np.isfinite(mean_bc)
        effects = (w_bc * np.nan_to_num(mean_bc)).sum(1) / w_bc.sum(1)
    diff = np.mean([row[ok].mean() for row, ok in zip(a_cj, has_cj) if ok.any()])
    return effects[np.isfinite(effects)], float(diff)
