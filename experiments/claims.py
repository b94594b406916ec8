"""The claims table of a family of grids: `python experiments/claims.py --grids=configs/ablations/reasoning.py`.

The claims file's CLAIMS (stated before the runs) each name terms over the results.csv of
its parts, paired by seed (by warm start and seed when the runs have an `sft.seed` axis);
every claim gets its effect, 95% t-interval, paired p-value, Holm-adjusted p-value across
the claims with a direction, and the verdict rule of `ablate.py`. Beside them:
`registration` (ebpo_jax/ablation/registration.py: pre-registered when every run it reads
recorded the claims file's current SHA-256; post hoc otherwise; git history for runs from
before hashes, plus the file's NOTES), the same claim at equal generated tokens (each
term's pass@1 read at the smallest final token count among the terms, from the eval rows'
cumulative token counts), and across several warm starts the two-level interval
(ebpo_jax/ablation/twolevel.py) next to the first warm start's. A claim with `select`
({"axis": "lr", "by": "val_pass@1"}) reads each term at its own best value on the
validation split. A claim with `band` (e.g. "q4") reads that held-out band's pass@1
(`pass@1/q4`: a difficulty quartile of tasks/difficulty.py) and bootstraps over its problems;
a term's `step` reads that evaluation instead of the last. A claim whose runs are missing
says "not run". A family file's COMPARE
names another family whose effects and verdicts join as extra columns, by claim text.
The paper's own number for each claim sits beside it (configs/ablations/paper_numbers.py).
Writes the file's CLAIMS_OUT (markdown) and prints it; its `seeds for +0.02` column is the
paired seeds each claim would need for 80% power at a 2-point effect, at the std it shows.
"""

import importlib.util
import os

import numpy as np
import pandas as pd
from absl import app, flags
from pandas.api.types import is_numeric_dtype

from ebpo_jax import ablation
from ebpo_jax.ablation import power, registration, twolevel
from ebpo_jax.ablation.results import final_rows

_GRIDS = flags.DEFINE_string("grids", "configs/ablations/reasoning.py", "Grid family file.")
RULE = (
    "Verdict rule, stated before the runs: `reproduced` when the 95% interval excludes 0 in "
    "the predicted direction, `opposite` when it excludes 0 the other way, `inconclusive` "
    "otherwise; the Holm column adjusts across every claim with a direction. `n/a`: a "
    "reference with no prediction.\n"
)
_COLUMNS = (
    "`paper (points)`: the paper's number for the claim (configs/ablations/paper_numbers.py: "
    "Qwen3-8B, Pass@1 points, EBPO minus the baseline; `direction only` where PAPER.md gives "
    "none; `-`: not the paper's claim). "
    "`registration`: `pre-registered` when every run it reads recorded the SHA-256 of this "
    "claims file as it is now (the file was committed before they trained); otherwise post "
    "hoc, or, for runs from before hashes were recorded, what git says of when the claim's "
    "text and its results were first committed. `equal tokens`: the same claim with every "
    "term's pass@1 read at the smallest final generated-token count among its terms (per "
    "seed, linear between eval steps); `token ratio`: largest over smallest final token "
    "count. With several warm starts (`sft.seed`) the effect is the two-level model's "
    "(ebpo_jax/ablation/twolevel.py), next to the first warm start's paired interval.\n\n"
)
_HELD_TEXT = (
    "`held: effect` is the same interval with its standard error floored at the RL-seed "
    "noise, sigma sqrt(sum 1/n_w) / W (`*`: the floor binds), and `equal tokens` is "
    "two-level and floored too across warm starts; `bootstrap over problems x clusters` "
    "resamples the held-out problems and the warm starts (one warm start: the RL seeds) "
    "independently (twolevel.bootstrap, 10,000 draws, percentile). `held: verdict` applies "
    "the verdict rule to the span of the floored and bootstrap intervals, and its Holm to "
    "the larger of their p-values: a verdict holds only under both. "
)
_HELD_AFTER = (
    "Held columns (issue 49, added after these runs; the registered columns are unchanged): "
    + _HELD_TEXT
    + "`changed`: where the held verdicts differ from the registered ones. "
)
_HELD_REGISTERED = (
    "Held columns (registered: the verdict rule above makes them decide, not the first "
    "columns): " + _HELD_TEXT + "`changed`: where the held verdicts differ from the first "
    "columns' (unfloored, no bootstrap). "
)
_BEST = (
    "`best rate (validation)`: each term's value of a `select` axis, best on the validation "
    "split; `(not bracketed)` when it is the smallest or largest value among that term's "
    "runs; `(tied with ..)` when other values share its mean (the smallest is taken).\n"
)


def columns_text(module) -> str:
    """What the columns mean; the held columns as registered when the file's verdict rule
    names the floored interval (the paper grids), else as added after the runs."""
    registered = "twolevel.floored" in getattr(module, "VERDICT_RULE", "")
    return _COLUMNS + (_HELD_REGISTERED if registered else _HELD_AFTER) + _BEST


EFFECT = 0.02  # the smallest difference the seed counts are sized for (ablate.py's pilot)
PAIR = ("sft.seed", "seed")  # runs pair by warm start and RL seed
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_NUMBERS = "configs/ablations/paper_numbers.py"  # the paper's number for each claim


def load_module(path: str):
    """The grid family's module (CLAIMS, CLAIMS_OUT, get_config(part))."""
    full = path if os.path.isabs(path) else os.path.join(_REPO, path)
    spec = importlib.util.spec_from_file_location("grid_family", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _where(rows: pd.DataFrame, where: dict) -> pd.DataFrame:
    """The rows where every `where` column has its value (none when a column is missing)."""
    for column, value in where.items():
        if column not in rows:
            return rows.iloc[0:0]
        rows = rows[rows[column].astype(str) == str(value)]
    return rows


def _finals(rows: pd.DataFrame) -> pd.DataFrame:
    """Each run's last eval row (rows without run ids and steps are final rows already)."""
    if rows.empty or "step" not in rows or "run_id" not in rows:
        return rows
    return final_rows(rows)


def _select(rows: pd.DataFrame, select: dict | None) -> pd.DataFrame:
    """With `select` ({"axis": a, "by": metric}): the rows at the value of axis `a` whose
    final `metric` has the highest mean over seeds (e.g. the learning rate that is best on
    the validation split)."""
    if not select or rows.empty:
        return rows
    return rows[rows[select["axis"]] == _best_value(rows, select)]


def _means(rows: pd.DataFrame, select: dict) -> pd.Series:
    """Per value of select's axis (ascending), the mean over runs of the final select["by"]."""
    axis, by = select["axis"], select["by"]
    if by not in rows or rows[by].isna().all():
        raise ValueError(f"select by {by!r}: the rows have no {by} (a validation split?)")
    return _finals(rows).groupby(axis)[by].mean()


def _top(means: pd.Series) -> pd.Index:
    """The values whose mean is the highest, ascending; equal means that differ only by the
    order of their float sums count as tied."""
    return means.index[np.isclose(means, means.max(), rtol=0, atol=1e-12)]


def _best_value(rows: pd.DataFrame, select: dict):
    """The value of select's axis whose final select["by"] has the highest mean over seeds
    (a tie: the smallest such value)."""
    return _top(_means(rows, select))[0]


def _short(value) -> str:
    """A number in its shortest form (1e-05), anything else as text."""
    return f"{value:g}" if isinstance(value, (int, float, np.number)) else str(value)


def best_values(claim, finals_of) -> str:
    """Each term's best value of the claim's `select` axis, `(not bracketed)` where it is the
    smallest or largest number the term's runs hold (the grid's end), `(tied with ..)` where
    others share its mean (the smallest is taken); "" without `select`."""
    sel, out = claim.get("select"), []
    for part, where in claim["plus"] + claim["minus"] if sel else ():
        rows = _where(finals_of(part), where)
        if rows.empty:
            return ""
        means = _means(rows, sel)
        top = _top(means)
        best = top[0]
        ends = (means.index[0], means.index[-1]) if is_numeric_dtype(means.index) else ()
        edge = " (not bracketed)" if best in ends else ""
        tie = f" (tied with {', '.join(map(_short, top[1:]))})" if len(top) > 1 else ""
        out.append(f"{'/'.join(map(str, where.values()))} {_short(best)}{edge}{tie}")
    return "; ".join(out)


def _indexed(rows: pd.DataFrame, column: str) -> pd.Series:
    """`column` of final rows indexed by the pairing key: (sft.seed, seed) or seed."""
    key = [c for c in PAIR if c in rows]
    if rows.empty or not key:
        return pd.Series(dtype=float)
    return rows.set_index(key)[column]


def metric(claim: dict) -> str:
    """The results column a claim reads: pass@1, or its band's (`pass@1/<band>`)."""
    return f"pass@1/{claim['band']}" if claim.get("band") else "pass@1"


def term(finals: pd.DataFrame, where: dict, select: dict | None = None, column: str = "pass@1"):
    """Final `column` (pass@1) by pairing key of the rows where every `where` column has its
    value."""
    rows = _finals(_select(_where(finals, where), select))
    return _indexed(rows, column) if column in rows or rows.empty else pd.Series(dtype=float)


def side(terms, finals_of, select: dict | None = None, column: str = "pass@1") -> pd.Series:
    """The key-aligned sum of `terms` ((part, where) pairs); empty when any is missing."""
    series = []
    for part, where in terms:
        s = term(finals_of(part), where, select, column)
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


def _difference(claim, rows_of) -> pd.Series:
    """plus - minus by pairing key."""
    sel = claim.get("select")
    col = metric(claim)
    plus, minus = side(claim["plus"], rows_of, sel, col), side(claim["minus"], rows_of, sel, col)
    both = pd.concat([plus, minus], axis=1, join="inner").dropna()
    return both.iloc[:, 0] - both.iloc[:, 1] if len(both) else pd.Series(dtype=float)


def _test(d: pd.Series) -> dict:
    """The paired test of differences `d`: the two-level model (twolevel.py) when they span
    >= 2 warm starts, with the first warm start's paired test as `one_*`; else paired t."""
    warm = d.index.get_level_values(0) if d.index.nlevels == 2 else None
    if warm is None or warm.nunique() < 2:
        return {**power.paired_test(d.to_numpy(), np.zeros(len(d))), "warm_starts": 1}
    first = d[warm == warm.min()].to_numpy()
    one = power.paired_test(first, np.zeros(len(first)))
    out = twolevel.interval(d.to_numpy(), warm)
    return {**out, **{f"one_{k}": one[k] for k in ("diff", "ci_low", "ci_high", "seeds")}}


def held_test(d: pd.Series) -> dict:
    """The interval that holds: across >= 2 warm starts the two-level one with its standard
    error floored at the RL-seed noise (twolevel.floored); else the paired t over seeds."""
    warm = d.index.get_level_values(0) if d.index.nlevels == 2 else None
    if warm is None or warm.nunique() < 2:
        return {**power.paired_test(d.to_numpy(), np.zeros(len(d))), "floored": False}
    return twolevel.floored(d.to_numpy(), warm)


def problem_differences(claim, problems_of, finals_of) -> pd.DataFrame:
    """Per pairing key (rows) and held-out problem (columns): plus - minus of each problem's
    pass rate (correct / samples) in the final evaluation; empty without problems.csv.gz."""
    sel, total = claim.get("select"), None
    for sign, terms in ((1, claim["plus"]), (-1, claim["minus"])):
        for part, where in terms:
            rows = _where(problems_of(part), where)
            if rows.empty:
                return pd.DataFrame()
            rows = rows[rows["set"] == "heldout"]
            if claim.get("band"):  # that band's problems (none without the column)
                rows = rows[rows.get("band", pd.Series("", rows.index)) == claim["band"]]
            if sel:
                best = _best_value(_where(finals_of(part), where), sel)
                rows = _where(rows, {sel["axis"]: best})
            key = [c for c in PAIR if c in rows]
            rate = rows.assign(rate=rows.correct / rows.samples)
            rate = rate.pivot_table(index=key, columns="problem_id", values="rate")
            total = sign * rate if total is None else total.add(sign * rate)
    return total.dropna(how="all") if total is not None else pd.DataFrame()


def problem_bootstrap(claim, problems_of, finals_of) -> dict:
    """twolevel.bootstrap of the claim over its clusters (warm starts, else RL seeds) and
    held-out problems, as `boot_*` columns; empty without per-problem outputs."""
    d = problem_differences(claim, problems_of, finals_of)
    if d.empty or len(d) < 2:
        return {}
    idx = d.index
    cluster = idx.get_level_values(0) if idx.nlevels == 2 else idx
    if idx.nlevels == 2 and cluster.nunique() < 2:
        cluster = idx.get_level_values(1)  # one warm start: resample its RL seeds
    out = twolevel.bootstrap(d.to_numpy(), np.asarray(cluster))
    return {f"boot_{k}": v for k, v in out.items()}


def claims_table(claims, finals_of, alpha: float = 0.05, problems_of=None) -> pd.DataFrame:
    """One row per claim: its paired test (across warm starts when its runs have several),
    the verdicts (ablation.claims) and the equal-token comparison when eval rows hold tokens;
    `held_*` the floored interval with its own Holm and verdicts, and with `problems_of`
    (part -> problems.csv.gz rows) the bootstrap over problems (`boot_*`)."""
    rows = []
    for c in claims:
        d = _difference(c, finals_of)
        test = _test(d) if len(d) else {}
        rows.append({"claim": c["claim"], **power.paired_test([], []), **test})
        held = held_test(d) if len(d) else {}
        rows[-1].update({f"held_{k}": held.get(k, np.nan) for k in _HELD})
        rows[-1].update(equal_tokens(c, finals_of), best=best_values(c, finals_of))
        if problems_of is not None:
            rows[-1].update(problem_bootstrap(c, problems_of, finals_of))
    directions = [c["direction"] for c in claims]
    # The family is every registered claim with a direction: one not run yet stays in it
    # (never rejected), so verdicts read part-way through the grids are not more liberal.
    table = ablation.claims(pd.DataFrame(rows), directions, alpha, whole=True)
    missing = table.seeds == 0
    table.loc[missing, ["verdict", "verdict_holm"]] = "not run"
    held = ablation.claims(_held_with_bootstrap(table), directions, alpha, whole=True)
    for k in ("p_holm", "verdict", "verdict_holm"):
        table[f"held_{k}"] = np.where(missing, "not run", held[k]) if "verdict" in k else held[k]
    return table


_HELD = ("diff", "ci_low", "ci_high", "p", "floored")


def holm_family(table: pd.DataFrame) -> str:
    """The line stating Holm's family: every claim with a direction, those not run counted."""
    directed = table.direction != 0
    absent = int((directed & (table.verdict_holm == "not run")).sum())
    return (
        f"Holm family: the {int(directed.sum())} claims with a direction, {absent} of them not "
        "run (in the family with an unknown p, never rejected, so the family does not shrink "
        "with the runs read).\n"
    )


def _held_with_bootstrap(table: pd.DataFrame) -> pd.DataFrame:
    """What the held verdicts read: the floored interval widened to the problem bootstrap's
    (the span of both) and the larger of their p-values, so a verdict must survive both."""
    held = table[[f"held_{k}" for k in _HELD]].rename(columns=lambda k: k[5:])
    held = held.assign(p=held.p.astype(float))
    if "boot_diff" not in table:
        return held
    has = table.boot_diff.notna()
    lo, hi = np.fmin(held.ci_low, table.boot_ci_low), np.fmax(held.ci_high, table.boot_ci_high)
    p = np.fmax(held.p, table.boot_p)
    return held.assign(ci_low=np.where(has, lo, held.ci_low),
                       ci_high=np.where(has, hi, held.ci_high), p=np.where(has, p, held.p))  # fmt: skip


def _curves(rows: pd.DataFrame, column: str = "pass@1") -> dict:
    """Pairing key -> (cumulative generated tokens, `column`) at a run's eval steps."""
    key = [c for c in PAIR if c in rows]
    out = {}
    for k, run in rows.sort_values("step").groupby(key):
        k = k if len(key) > 1 else (k[0] if isinstance(k, tuple) else k)
        out[k] = (run.generated_tokens.to_numpy(np.float64), run[column].to_numpy(np.float64))
    return out


def _up_to(rows: pd.DataFrame, where: dict) -> pd.DataFrame:
    """The rows of `where`, its `step` read as every evaluation up to that one."""
    rows = _where(rows, {k: v for k, v in where.items() if k != "step"})
    if "step" not in where:
        return rows
    return rows[rows.step <= where["step"]] if "step" in rows else rows.iloc[0:0]


def equal_tokens(claim, rows_of) -> dict:
    """The claim at equal generated tokens: per pairing key, every term's pass@1 at the
    smallest final token count among the terms (linear between its eval steps), summed
    plus - minus; the paired test of that, and the mean ratio of the largest to the
    smallest final token count. A term's `step` ends its curve there. Empty when the rows
    hold no per-step eval tokens, or when the terms name different steps (such a claim
    compares budgets by design)."""
    sel, signed = claim.get("select"), []
    if len({where.get("step") for _, where in claim["plus"] + claim["minus"]}) > 1:
        return {}
    for sign, terms in ((1, claim["plus"]), (-1, claim["minus"])):
        for part, where in terms:
            rows = _select(_up_to(rows_of(part), where), sel)
            need = ("generated_tokens", "step", metric(claim))
            if rows.empty or any(c not in rows for c in need):
                return {}
            signed.append((sign, _curves(rows, metric(claim))))
    keys = sorted(set.intersection(*(set(c) for _, c in signed)))
    d, ratio = [], []
    for k in keys:
        ends = [c[k][0][-1] for _, c in signed]
        budget = min(ends)
        d.append(sum(s * np.interp(budget, *c[k]) for s, c in signed))
        ratio.append(max(ends) / budget if budget > 0 else np.nan)
    test = power.paired_test(d, np.zeros(len(d)))
    out = {f"tok_{k}": test[k] for k in ("diff", "ci_low", "ci_high", "seeds")}
    out["token_ratio"] = float(np.nanmean(ratio)) if ratio else np.nan
    if keys and isinstance(keys[0], tuple):  # (warm start, seed): two-level, floored
        held = held_test(pd.Series(d, index=pd.MultiIndex.from_tuples(keys)))
        out.update({f"tok_{k}": held[k] for k in ("diff", "ci_low", "ci_high", "p")})
    return out


def seeds_for(table: pd.DataFrame, effect: float, power_: float = 0.8, alpha: float = 0.05):
    """Paired seeds each claim needs to detect `effect` at `power_`, at its observed std."""
    return [
        power.seeds_needed(effect, sd, power=power_, alpha=alpha)
        if n >= 2 and np.isfinite(sd)  # a two-level claim has no single paired std
        else -1
        for sd, n in zip(table.sd, table.seeds)
    ]


def results_loader(module):
    """part -> its eval rows (empty when the part has no results.csv yet)."""
    cache = {}

    def rows_of(part: str) -> pd.DataFrame:
        if part not in cache:
            path = _results_path(module, part)
            cache[part] = pd.read_csv(path) if os.path.exists(path) else pd.DataFrame()
        return cache[part]

    return rows_of


def _results_path(module, part: str) -> str:
    return os.path.join(_REPO, module.get_config(part).out_dir, "results.csv")


def registrations(module, claims, rows_of) -> list[str]:
    """Each claim's registration (registration.status): the claims SHA-256 its runs
    recorded against the claims file's now, else git history; plus the file's NOTES."""
    path = module.__file__
    current, notes = registration.file_sha256(path), getattr(module, "NOTES", {})
    out = []
    for c in claims:
        parts = dict.fromkeys(part for part, _ in c["plus"] + c["minus"])
        recorded, absent = [], False
        for part, where in c["plus"] + c["minus"]:
            finals = _finals(_where(rows_of(part), where))
            recorded += list(finals.get("claims_sha256", pd.Series([""] * len(finals))))
            absent |= finals.empty  # a term without runs: the claim is not run, as its row says
        results = [os.path.relpath(_results_path(module, p), _REPO) for p in parts]
        rel = os.path.relpath(path, _REPO)
        history = lambda: registration.git_history(_REPO, rel, c["claim"], results)  # noqa: B023
        label = "not run" if absent else registration.status(recorded, current, history)
        note = notes.get(c["claim"])
        out.append(f"{label}; {note}" if note else label)
    return out


def _effects(table: pd.DataFrame) -> list[str]:
    """Each claim's "+d [low, high]", or "-" when it has no paired seeds."""
    return [
        f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]" if n else "-"
        for d, lo, hi, n in zip(table["diff"], table.ci_low, table.ci_high, table.seeds)
    ]


def _interval(d, lo, hi, n) -> list[str]:
    return [
        f"{a:+.3f} [{b:+.3f}, {c:+.3f}]" if k and np.isfinite(a) else "-"
        for a, b, c, k in zip(d, lo, hi, n)
    ]


def render(
    table: pd.DataFrame, compare: pd.DataFrame | None = None, name: str = "", paper=None
) -> str:
    """The markdown claims table: the paper's number (`paper`, by claim, when any is
    known), registration, effect [interval], seeds (and warm starts, with the first warm
    start's interval, when runs span several), p, Holm p, verdicts, the effect at equal
    generated tokens; with `compare` (another family's claims_table) its effect, seeds and
    verdict by claim."""
    out = pd.DataFrame({"claim": table.claim})
    if paper is not None and any(n != "-" for n in paper):
        out["paper (points)"] = list(paper)
    if "registration" in table:
        out["registration"] = table.registration.to_numpy()
    out["effect [95% interval]"] = _effects(table)
    out["seeds"] = table.seeds.to_numpy()
    if "one_diff" in table and table.one_diff.notna().any():
        out["warm starts"] = table.warm_starts.fillna(1).astype(int).to_numpy()
        out["one warm start: effect"] = _interval(
            table.one_diff, table.one_ci_low, table.one_ci_high, table.one_seeds.fillna(0)
        )
    out["p"], out["Holm p"] = table.p.to_numpy(), table.p_holm.to_numpy()
    out["verdict"], out["verdict (Holm)"] = table.verdict.to_numpy(), table.verdict_holm.to_numpy()
    if "tok_diff" in table:
        n = table.tok_seeds.fillna(0)
        out["equal tokens: effect"] = _interval(
            table.tok_diff, table.tok_ci_low, table.tok_ci_high, n
        )
        out["token ratio"] = table.token_ratio.to_numpy()
    out[f"seeds for {EFFECT:+.2f}"] = [n if n > 0 else "-" for n in seeds_for(table, EFFECT)]
    if "best" in table and (table.best != "").any():
        out["best rate (validation)"] = table.best.replace("", "-").to_numpy()
    if "held_diff" in table:
        out = pd.concat([out, _held_columns(table)], axis=1)
    if compare is not None:
        other = compare.assign(effect=_effects(compare)).set_index("claim")
        other = other.reindex(table.claim)
        out[f"{name}: effect"] = other.effect.fillna("-").to_numpy()
        out[f"{name}: seeds"] = other.seeds.fillna(0).astype(int).to_numpy()
        out[f"{name}: verdict"] = other.verdict.fillna("not run").to_numpy()
    return ablation.to_markdown(out)


def _held_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The held interval (`*`: its standard error floored), its Holm p and verdicts, the
    problem bootstrap, and what changed against the registered verdicts."""
    held = _interval(table.held_diff, table.held_ci_low, table.held_ci_high, table.seeds)
    floored = table.held_floored.fillna(False).astype(bool)
    out = pd.DataFrame(index=table.index)
    out["held: effect [95% interval]"] = [h + (" *" if f else "") for h, f in zip(held, floored)]
    out["held: Holm p"] = table.held_p_holm.to_numpy()
    out["held: verdict (Holm)"] = [
        f"{v} ({vh})" for v, vh in zip(table.held_verdict, table.held_verdict_holm)
    ]
    if "boot_diff" in table:
        n = table.boot_problems.fillna(0)
        out["bootstrap over problems x clusters"] = _interval(
            table.boot_diff, table.boot_ci_low, table.boot_ci_high, n
        )
    out["changed"] = [_change(r) for r in table.itertuples()]
    return out


def _change(row) -> str:
    """`was -> now` for the interval verdict and the Holm verdict, when the held ones differ."""
    pairs = (
        ("", row.verdict, row.held_verdict),
        ("Holm ", row.verdict_holm, row.held_verdict_holm),
    )
    return "; ".join(f"{name}{a} -> {b}" for name, a, b in pairs if a != b) or "-"


def problems_loader(module):
    """part -> its per-problem rows (problems.csv.gz; empty when the part has none)."""
    cache = {}

    def problems_of(part: str) -> pd.DataFrame:
        if part not in cache:
            out_dir = os.path.join(_REPO, module.get_config(part).out_dir)
            path = os.path.join(out_dir, "problems.csv.gz")
            cache[part] = pd.read_csv(path) if os.path.exists(path) else pd.DataFrame()
        return cache[part]

    return problems_of


def main(argv):
    del argv
    module, papers = load_module(_GRIDS.value), load_module(PAPER_NUMBERS)
    rows_of = results_loader(module)
    table = claims_table(module.CLAIMS, rows_of, problems_of=problems_loader(module))
    table.insert(1, "registration", registrations(module, module.CLAIMS, rows_of))
    compare, name = None, ""
    if getattr(module, "COMPARE", None):  # a second family's effects, as extra columns
        other = load_module(module.COMPARE)
        compare, name = claims_table(other.CLAIMS, results_loader(other)), other.NAME
    text = "\n".join(
        [
            f"# Claims over {_GRIDS.value}'s grids (final held-out pass@1, paired by seed)\n",
            getattr(module, "VERDICT_RULE", RULE),
            *([module.SEED_RULE] if hasattr(module, "SEED_RULE") else []),
            *([module.RERUN_RULE] if hasattr(module, "RERUN_RULE") else []),
            columns_text(module),
            holm_family(table),
            render(table, compare, name, [papers.number(c) for c in table.claim]),
            "",
        ]
    )
    out = os.path.join(_REPO, module.CLAIMS_OUT)
    with open(out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
