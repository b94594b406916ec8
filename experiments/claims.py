"""The claims table of a family of grids: `python experiments/claims.py --grids=configs/ablations/reasoning.py`.

The grid file's CLAIMS (stated before the runs) each name seed-paired terms over the
results.csv of its parts; every claim gets its effect, 95% t-interval, paired p-value,
Holm-adjusted p-value across the claims with a direction, and the verdict rule of
`ablate.py`. A claim whose runs are missing says "not run". A family file's COMPARE names
another family (e.g. the same claims over the arithmetic grids) whose effects and verdicts
join as extra columns, by claim text. Writes the grid file's CLAIMS_OUT (markdown) and
prints it; its `seeds for +0.02` column is the paired seeds each claim would need for 80%
power at a 2-point effect, at the std it shows.
"""

import importlib.util
import os

import pandas as pd
from absl import app, flags

from ebpo_jax import ablation
from ebpo_jax.ablation import power
from ebpo_jax.ablation.results import final_rows

_GRIDS = flags.DEFINE_string("grids", "configs/ablations/reasoning.py", "Grid family file.")
RULE = (
    "Verdict rule, stated before the runs: `reproduced` when the 95% interval excludes 0 in "
    "the predicted direction, `opposite` when it excludes 0 the other way, `inconclusive` "
    "otherwise; the Holm column adjusts across every claim with a direction. `n/a`: a "
    "reference with no prediction.\n"
)
EFFECT = 0.02  # the smallest difference the seed counts are sized for (ablate.py's pilot)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_module(path: str):
    """The grid family's module (CLAIMS, CLAIMS_OUT, get_config(part))."""
    full = path if os.path.isabs(path) else os.path.join(_REPO, path)
    spec = importlib.util.spec_from_file_location("grid_family", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def term(finals: pd.DataFrame, where: dict) -> pd.Series:
    """Final pass@1 by seed of the rows of `finals` where every `where` column has its value."""
    rows = finals
    for column, value in where.items():
        if column not in rows:
            return pd.Series(dtype=float)
        rows = rows[rows[column].astype(str) == str(value)]
    return rows.set_index("seed")["pass@1"]


def side(terms, finals_of) -> pd.Series:
    """The seed-aligned sum of `terms` ((part, where) pairs); empty when any is missing."""
    series = []
    for part, where in terms:
        s = term(finals_of(part), where)
        if s.index.duplicated().any():  # e.g. GRPO G=4 sits in two blocks of one grid
            raise ValueError(
                f"claim term ({part!r}, {where}) matches {len(s)} runs for "
                f"{s.index.nunique()} seeds: name a block or more columns"
            )
        series.append(s)
    if any(s.empty for s in series):
        return pd.Series(dtype=float)
    both = pd.concat(series, axis=1, join="inner").dropna()
    return both.sum(axis=1)


def claims_table(claims, finals_of, alpha: float = 0.05) -> pd.DataFrame:
    """One row per claim: its paired test, and the verdicts (ablation.claims)."""
    rows = []
    for c in claims:
        plus, minus = side(c["plus"], finals_of), side(c["minus"], finals_of)
        both = pd.concat([plus, minus], axis=1, join="inner").dropna()
        test = power.paired_test(both.iloc[:, 0], both.iloc[:, 1]) if len(both) else {}
        rows.append({"claim": c["claim"], **power.paired_test([], []), **test})
    table = ablation.claims(pd.DataFrame(rows), [c["direction"] for c in claims], alpha)
    missing = table.seeds == 0
    table.loc[missing, ["verdict", "verdict_holm"]] = "not run"
    return table


def seeds_for(table: pd.DataFrame, effect: float, power_: float = 0.8, alpha: float = 0.05):
    """Paired seeds each claim needs to detect `effect` at `power_`, at its observed std."""
    return [
        power.seeds_needed(effect, sd, power=power_, alpha=alpha) if n >= 2 else -1
        for sd, n in zip(table.sd, table.seeds)
    ]


def results_loader(module):
    """part -> its final eval rows (empty when the part has no results.csv yet)."""
    cache = {}

    def finals_of(part: str) -> pd.DataFrame:
        if part not in cache:
            path = os.path.join(_REPO, module.get_config(part).out_dir, "results.csv")
            cache[part] = final_rows(pd.read_csv(path)) if os.path.exists(path) else pd.DataFrame()
        return cache[part]

    return finals_of


def _effects(table: pd.DataFrame) -> list[str]:
    """Each claim's "+d [low, high]", or "-" when it has no paired seeds."""
    return [
        f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" if n else "-"
        for d, lo, hi, n in zip(table["diff"], table.ci_low, table.ci_high, table.seeds)
    ]


def render(table: pd.DataFrame, compare: pd.DataFrame | None = None, name: str = "") -> str:
    """The markdown claims table: effect [interval], seeds, p, Holm p, verdicts; with
    `compare` (another family's claims_table) its effect, seeds and verdict by claim."""
    out = pd.DataFrame(
        {
            "claim": table.claim,
            "effect [95% interval]": _effects(table),
            "seeds": table.seeds,
            "p": table.p,
            "Holm p": table.p_holm,
            "verdict": table.verdict,
            "verdict (Holm)": table.verdict_holm,
            f"seeds for {EFFECT:+.2f}": [n if n > 0 else "-" for n in seeds_for(table, EFFECT)],
        }
    )
    if compare is not None:
        other = compare.assign(effect=_effects(compare)).set_index("claim")
        other = other.reindex(table.claim)
        out[f"{name}: effect"] = other.effect.fillna("-").to_numpy()
        out[f"{name}: seeds"] = other.seeds.fillna(0).astype(int).to_numpy()
        out[f"{name}: verdict"] = other.verdict.fillna("not run").to_numpy()
    return ablation.to_markdown(out)


def main(argv):
    del argv
    module = load_module(_GRIDS.value)
    table = claims_table(module.CLAIMS, results_loader(module))
    compare, name = None, ""
    if getattr(module, "COMPARE", None):  # a second family's effects, as extra columns
        other = load_module(module.COMPARE)
        compare, name = claims_table(other.CLAIMS, results_loader(other)), other.NAME
    text = "\n".join(
        [
            f"# Claims over {_GRIDS.value}'s grids (final held-out pass@1, paired by seed)\n",
            RULE,
            render(table, compare, name),
            "",
        ]
    )
    out = os.path.join(_REPO, module.CLAIMS_OUT)
    with open(out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
