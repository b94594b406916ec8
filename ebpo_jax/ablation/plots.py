"""PNG plots of an ablation's results with matplotlib (one set per grid block)."""

import os
from typing import NamedTuple

import numpy as np
import pandas as pd

# Figures, not pyplot: files only, no display and no global backend to set on pods or CI.
from matplotlib.figure import Figure

from ebpo_jax.ablation import twolevel
from ebpo_jax.ablation.provenance import FIELDS as PROVENANCE_FIELDS
from ebpo_jax.ablation.results import CURVES, final_rows, interval95

TRAIN_PANELS = (
    ("actor/grad_norm", "grad norm"),
    ("actor/entropy", "entropy"),
    ("actor/kl", "KL to reference"),
    ("adv/zero_frac", "zero-advantage fraction"),
    ("response_length/mean", "response length (tokens)"),
    ("eb/shrinkage_mean", "EB shrinkage S"),
)


class BlockAxes(NamedTuple):
    """The axes that vary in a block: one line per `series` value, one panel per `facet` value."""

    series: list[str]
    facet: str | None


WARM = "sft.seed"  # several warm starts: lines are their mean, intervals over their means


def _axes_of(df: pd.DataFrame, ignore=("seed", WARM)) -> BlockAxes:
    """The axes that vary in this block (RL seeds and warm starts averaged); group_size facets."""
    fixed = {"block", "run_id", "step", "generated_tokens", "pass@1", "val_pass@1", *CURVES}
    fixed.add("prompts_per_step")
    fixed |= set(PROVENANCE_FIELDS)  # runs adopted from other grids may differ in XLA flags
    axes = [c for c in df.columns if c not in fixed and not c.startswith("pass@1/")]  # bands
    varying = [a for a in axes if a not in ignore and df[a].nunique(dropna=True) > 1]
    facet = "group_size" if "group_size" in varying else None
    return BlockAxes([a for a in varying if a != facet], facet)


def _label(key, series) -> str:
    key = key if isinstance(key, tuple) else (key,)
    return (
        ", ".join(f"{v}" if a in ("method",) else f"{a}={v}" for a, v in zip(series, key)) or "run"
    )


def _facets(df, facet):
    return [(None, df)] if facet is None else list(df.groupby(facet, sort=True))


def _curve_plot(df, x, y, axes: BlockAxes, path, ylabel, window=1):
    """One panel per facet of `y` against `x`, a line per series (a rolling mean over `window`)."""
    series, facet = axes
    facets = _facets(df, facet)
    fig = Figure(figsize=(4 * len(facets), 3.2))
    axs = fig.subplots(1, len(facets), squeeze=False)
    for ax, (fv, sub) in zip(axs[0], facets):
        groups = sub.groupby(series, sort=True) if series else [((), sub)]
        for key, grp in groups:
            cols = [c for c in (x, y) if c != "step"]
            curve = grp.groupby("step")[cols].mean().reset_index().sort_values(x)
            vals = curve[y].rolling(window, min_periods=1).mean()
            ax.plot(curve[x], vals, label=_label(key, series))
        ax.set_title(f"{facet}={fv}" if facet else "")
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axs[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _final_levels(evals: pd.DataFrame, by: list[str]) -> tuple[pd.DataFrame, str]:
    """Final pass@1 per setting `by` with a 95% t-interval (pass@1, ci_low, ci_high): over
    the cell's warm-start means when it spans several (their spread is the noise that
    counts), else over its runs; and what the intervals are over."""
    rows, warm_cells = [], 0
    for key, cell in final_rows(evals).groupby(by, sort=True):
        warm = cell[WARM].astype(str) if WARM in cell else None  # a missing one: its own group
        if warm is not None and warm.nunique() > 1:
            t = twolevel.interval(cell["pass@1"], warm)
            level, warm_cells = (t["diff"], t["ci_low"], t["ci_high"]), warm_cells + 1
        else:
            level = interval95(cell["pass@1"])
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key)), **dict(zip(_LEVEL, level))})
    over = "seeds"
    if warm_cells:
        over = "warm starts" if warm_cells == len(rows) else "warm starts or seeds"
    return pd.DataFrame(rows), over


_LEVEL = ("pass@1", "ci_low", "ci_high")


def plot_block(evals: pd.DataFrame, steps: pd.DataFrame, block: str, out_dir: str) -> list[str]:
    """Write this block's PNGs to out_dir; returns their paths."""
    ev, st = evals[evals.block == block], steps[steps.block == block]
    axes = _axes_of(ev)
    series, facet = axes
    paths = []

    def path(name):
        paths.append(os.path.join(out_dir, f"{block}_{name}.png"))
        return paths[-1]

    _curve_plot(ev, "step", "pass@1", axes, path("pass1_vs_step"), "held-out pass@1")
    _curve_plot(ev, "generated_tokens", "pass@1", axes, path("pass1_vs_tokens"), "held-out pass@1")
    if facet:  # final pass@1 against G, one line per series, 95% intervals
        summ, over = _final_levels(ev, [*series, facet])
        fig = Figure(figsize=(5, 3.5))
        ax = fig.subplots()
        groups = summ.groupby(series, sort=True) if series else [((), summ)]
        for i, (key, grp) in enumerate(groups):
            grp = grp.sort_values(facet)
            shift = 1 + 0.03 * (i - len(groups) / 2)  # spread the error bars apart
            err = np.stack([grp["pass@1"] - grp.ci_low, grp.ci_high - grp["pass@1"]])
            ax.errorbar(
                grp[facet] * shift,
                grp["pass@1"],
                yerr=err,
                capsize=3,
                marker="o",
                label=_label(key, series),
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("group size G")
        ax.set_ylabel(f"final held-out pass@1\n(95% CI over {over})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path("final_vs_G"), dpi=100)
    if not st.empty:
        facets = _facets(st, facet)
        fig = Figure(figsize=(3.2 * len(TRAIN_PANELS), 2.6 * len(facets)))
        axs = fig.subplots(len(facets), len(TRAIN_PANELS), squeeze=False)
        for row, (fv, sub) in zip(axs, facets):
            groups = list(sub.groupby(series, sort=True)) if series else [((), sub)]
            for ax, (metric, title) in zip(row, TRAIN_PANELS):
                for key, grp in groups:
                    curve = grp.groupby("step")[metric].mean().rolling(10, min_periods=1).mean()
                    if curve.notna().any():
                        ax.plot(curve.index, curve.values, label=_label(key, series))
                ax.set_title(f"{title}" + (f" ({facet}={fv})" if facet else ""), fontsize=8)
                ax.grid(alpha=0.3)
        axs[0][0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path("train_curves"), dpi=90)
    return paths
