"""What a rerun of a committed run shows: bitwise equality on the CPU family it ran on, and,
on another family (XLA:CPU kernels round differently, so SFT and every step drift), whether
its final pass@1 falls inside the seed band of its cell.

The seed band is the 95% prediction interval of one more seed of the cell, from the
committed seeds' final pass@1 (n >= 2): mean +- t_{0.975, n-1} * sd * sqrt(1 + 1/n). A
rerun inside it is as close to the record as another seed of the same cell would be.
"""

import math

import numpy as np
import pandas as pd
from scipy import stats

from ebpo_jax.ablation.provenance import cpu_family


def seed_band(finals: pd.DataFrame, where: dict) -> dict:
    """The cell's committed final pass@1 per seed (`where`: column -> value, the run's axes
    but its seed) and the 95% prediction interval of one more seed."""
    rows = finals
    for column, value in where.items():
        rows = rows[rows[column].astype(str) == str(value)]
    x = rows["pass@1"].to_numpy(np.float64)
    n = x.size
    out = {"seeds": n, "values": [float(v) for v in x], "low": math.nan, "high": math.nan}
    if n < 2:
        return out
    half = stats.t.ppf(0.975, n - 1) * x.std(ddof=1) * math.sqrt(1 + 1 / n)
    return {**out, "mean": float(x.mean()), "low": x.mean() - half, "high": x.mean() + half}


def verdict(match: bool, recorded_cpu: str, now_cpu: str, final: float, band: dict, atol=0.0):
    """`bitwise` (`within atol` for atol > 0) / `differs on the same CPU family` on the
    recorded family; across families `inside the seed band` / `outside the seed band`
    (`no seed band` with < 2 committed seeds)."""
    if cpu_family(recorded_cpu) == cpu_family(now_cpu):
        if not match:
            return "differs on the same CPU family"
        return "bitwise" if atol == 0 else f"within atol {atol}"
    if not (math.isfinite(band["low"]) and math.isfinite(final)):
        return "other CPU family: no seed band (< 2 committed seeds)"
    inside = band["low"] <= final <= band["high"]
    return f"other CPU family: {'inside' if inside else 'outside'} the seed band"
