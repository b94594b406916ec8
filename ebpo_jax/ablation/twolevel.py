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
