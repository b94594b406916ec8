"""A grid's tables: paired comparisons with verdicts, the power pilot's seed choice, and
results.csv / steps.csv.gz / problems.csv.gz / summary.md / plots."""

import os

REFERENCE = "grpo"  # the method every other one is compared with, paired by seed
VERDICT_RULE = (
    "Verdict rule, stated before the runs: `reproduced` when the 95% interval excludes 0 in "
    "the paper's direction (EBPO variants above the reference), `opposite` when it excludes 0 "
    "the other way, `inconclusive` otherwise; `verdict_holm` applies the rule to Holm-adjusted "
    "p-values across every claim of the grid (alpha {alpha}). `n/a`: no claim in the paper, "
    "shown for reference.\n"
)
# Columns of a comparisons() row that are statistics, not the setting compared.
_STATS = ("diff", "seeds", "ci_low", "ci_high", "p", "sd", "direction", "p_holm", "verdict")
_STATS += ("verdict_holm",)


def comparisons(evals, runs, alpha: float = 0.05):
    """Every method minus REFERENCE, paired by seed, per setting of each block's other axes;
    EBPO variants are the paper's claims (direction +1), Holm-corrected across the grid."""
    import pandas as pd

    from ebpo_jax import ablation

    tables = []
    for block in dict.fromkeys(r.block for r in runs):
        ev = evals[evals.block == block] if not evals.empty else evals
        axes = [a for a, _ in next(r for r in runs if r.block == block).values if a != "seed"]
        if ev.empty or "method" not in axes or "seed" not in ev or REFERENCE not in set(ev.method):
            continue
        others = [a for a in axes if a != "method"]
        for m in dict.fromkeys(ev.method):
            if m == REFERENCE:
                continue
            t = ablation.paired_difference(ev, others or ["block"], "method", m, REFERENCE)
            if not t.empty:
                tables.append(t.assign(block=block, method=f"{m} - {REFERENCE}"))
    if not tables:
        return pd.DataFrame()
    table = pd.concat(tables, ignore_index=True)
    table = table[["block", "method", *(c for c in table.columns if c not in ("block", "method"))]]
    direction = [1 if m.startswith("ebpo") else 0 for m in table.method]
    return ablation.claims(table, direction, alpha)


def problem_comparisons(problems, runs):
    """Every method minus REFERENCE per setting, paired by problem (pass rates summed over
    the seeds both share): the problem-level view of `comparisons`."""
    import pandas as pd

    from ebpo_jax import ablation

    tables = []
    for block in dict.fromkeys(r.block for r in runs):
        rows = problems[problems.block == block] if not problems.empty else problems
        axes = [a for a, _ in next(r for r in runs if r.block == block).values if a != "seed"]
        if rows.empty or "method" not in axes or REFERENCE not in set(rows.method):
            continue
        others = [a for a in axes if a != "method"] or ["block"]
        for m in dict.fromkeys(rows.method):
            if m != REFERENCE:
                t = ablation.paired_by_problem(rows, others, "method", m, REFERENCE)
                tables.append(t.assign(block=block, method=f"{m} - {REFERENCE}"))
    tables = [t for t in tables if not t.empty]
    if not tables:
        return pd.DataFrame()
    table = pd.concat(tables, ignore_index=True)
    return table[["block", "method", *(c for c in table.columns if c not in ("block", "method"))]]


def choose_seeds(evals, runs, analysis, *, alpha: float, log=print) -> dict:
    """Seeds for `analysis.power` to detect `analysis.effect` on every claim, from the pilot's
    difference stds (an ablation.power.PowerAnalysis)."""
    import pandas as pd

    from ebpo_jax import ablation
    from ebpo_jax.ablation import power as power_lib

    effect, power, pilot, max_seeds = analysis
    table = comparisons(evals, runs, alpha)
    claims = table[table.direction != 0] if not table.empty else table
    if claims.empty:
        raise ValueError(
            f"power analysis needs claims: a method axis with {REFERENCE!r} and an EBPO variant"
        )
    rows = []
    for row in claims.itertuples(index=False):
        n = power_lib.seeds_needed(effect, row.sd, power=power, alpha=alpha)
        upper = power_lib.sd_upper(row.sd, row.seeds)
        n_up = power_lib.seeds_needed(effect, upper, power=power, alpha=alpha)
        setting = {k: v for k, v in row._asdict().items() if k not in _STATS}
        rows.append(
            {
                **setting,
                "pilot_sd": row.sd,
                "seeds_needed": n,
                "sd_upper80": upper,
                "seeds_needed_upper80": n_up,
            }
        )
    needed = max(r["seeds_needed"] for r in rows)
    chosen = max(pilot, min(needed, max_seeds))
    achieved = min(power_lib.paired_power(chosen, effect, r["pilot_sd"], alpha) for r in rows)
    log(ablation.to_markdown(pd.DataFrame(rows)))
    capped = f" (capped by --max_seeds={max_seeds})" if needed > chosen else ""
    log(
        f"power analysis: {needed} paired seeds detect {effect} at power {power} (two-sided "
        f"paired t, alpha {alpha}) on every claim; running {chosen}{capped}, "
        f"power >= {achieved:.2f} at the pilot's stds"
    )
    return {
        "effect": effect,
        "power": power,
        "alpha": alpha,
        "pilot_seeds": pilot,
        "max_seeds": max_seeds,
        "seeds_needed": needed,
        "seeds": chosen,
        "power_at_seeds": achieved,
        "claims": rows,
    }


def write_results(grid, runs, out, *, alpha: float = 0.05, log=print) -> dict:
    """results.csv, steps.csv.gz, summary.md (settings, comparisons, verdicts) and plots."""
    from ebpo_jax import ablation
    from ebpo_jax.ablation import plots, record

    evals, steps = record.collect(out, runs)
    paths = record.write(out, evals, steps)
    problems = record.collect_problems(out, runs)
    paths["problems"] = record.write_problems(out, problems)
    plot_dir = os.path.join(out, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    paths["plots"] = []
    lines = [f"# {grid.name}: final held-out pass@1 (mean over seeds, 95% t-interval)\n"]
    for block in dict.fromkeys(r.block for r in runs):
        ev = evals[evals.block == block] if not evals.empty else evals
        if ev.empty:
            continue
        axes = [a for a, _ in next(r for r in runs if r.block == block).values if a != "seed"]
        lines += [f"## {block}\n", ablation.to_markdown(ablation.summarize(ev, axes)), ""]
        paths["plots"] += plots.plot_block(evals, steps, block, plot_dir)
    table = comparisons(evals, runs, alpha)
    if not table.empty:
        lines += [
            f"## Paired comparisons (final pass@1 minus {REFERENCE}'s, paired by seed)\n",
            VERDICT_RULE.format(alpha=alpha),
            ablation.to_markdown(table.drop(columns=["direction"])),
            "",
        ]
    by_problem = problem_comparisons(problems, runs) if not problems.empty else problems
    if not by_problem.empty:
        lines += [
            (
                f"## Paired by problem (final pass rate minus {REFERENCE}'s per held-out "
                "problem, over the seeds both share; the interval treats problems as the "
                "sample)\n"
            ),
            ablation.to_markdown(by_problem),
            "",
        ]
    paths["summary"] = os.path.join(out, "summary.md")
    with open(paths["summary"], "w") as f:
        f.write("\n".join(lines))
    log("\n".join(lines))
    return paths
