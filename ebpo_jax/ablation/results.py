"""Collect finished runs' metrics into tables: one row per (run, eval step), per-step curves,
and final pass@1 per setting with a 95% t-interval over seeds."""

import json
import os
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from ebpo_jax.ablation import power
from ebpo_jax.ablation.grid import Run
from ebpo_jax.ablation.provenance import FIELDS as PROVENANCE_FIELDS
from ebpo_jax.runtime.metrics import PER_PROBLEM_FILE, read_metrics

VALIDATION_KEY = "eval/validation/pass@1"  # the validation split's (trainer.task.VALIDATION)
# A held-out band's pass@1 (e.g. a difficulty quartile, tasks/difficulty.py) -> "pass@1/<band>".
BAND_KEY = re.compile(r"^eval/heldout/([^/]+)/pass@1$")
# Training curves averaged over the steps since the previous eval in results.csv.
CURVES = (
    "reward/mean",
    "actor/grad_norm",
    "actor/entropy",
    "actor/kl",
    "adv/zero_frac",
    "adv/all_same_group_frac",
    "eb/shrinkage_mean",
    "response_length/mean",
)


def _run_columns(run: Run) -> dict:
    cols = {"block": run.block, "run_id": run.run_id}
    cols.update({axis: value for axis, value in run.values})
    over = dict(run.overrides)
    cols.setdefault("group_size", over.get("group_size"))
    cols["prompts_per_step"] = over.get("prompts_per_step")
    return cols


def run_provenance(run_dir: str) -> dict:
    """The provenance fields a finished run recorded in its summary.json (empty if none)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        recorded = json.load(f).get("provenance", {})
    return {k: recorded.get(k, "") for k in PROVENANCE_FIELDS}


def finished(run_dir: str) -> bool:
    """Whether the run ended: ablate writes its summary.json after its last step."""
    return os.path.exists(os.path.join(run_dir, "summary.json"))


def collect(runs_dir: str, runs: Sequence[Run]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(eval rows, step rows) of every finished run under `runs_dir/<run_id>`; eval rows end
    with the run's provenance (versions, machine, CPU, XLA flags) when it recorded one.

    A run still training (or killed) is left out: its last eval is not its final one."""
    evals, steps = [], []
    for run in runs:
        if not finished(os.path.join(runs_dir, run.run_id)):
            continue
        records = read_metrics(os.path.join(runs_dir, run.run_id))
        prov = run_provenance(os.path.join(runs_dir, run.run_id))
        cols, since, tokens = _run_columns(run), [], 0.0
        for rec in records:
            tokens = rec.get("perf/generated_tokens_total") or tokens
            if "reward/mean" in rec:
                since.append(rec)
                curves = {k: rec.get(k) for k in CURVES}
                steps.append({**cols, "step": rec["step"], **curves, "generated_tokens": tokens})
            if rec.get("eval/pass@1") is not None:
                row = {**cols, "step": rec["step"], "generated_tokens": tokens}
                row["pass@1"] = rec["eval/pass@1"]
                if rec.get(VALIDATION_KEY) is not None:  # chooses hyperparameters only
                    row["val_pass@1"] = rec[VALIDATION_KEY]
                row.update(band_columns(rec))
                for k in CURVES:
                    vals = [r[k] for r in since if r.get(k) is not None]
                    row[k] = float(np.mean(vals)) if vals else np.nan
                evals.append({**row, **prov})
                since = []
    return pd.DataFrame(evals), pd.DataFrame(steps)


def band_columns(rec: dict) -> dict:
    """{"pass@1/<band>": value} of a metrics row's held-out bands."""
    bands = ((BAND_KEY.match(k), v) for k, v in rec.items())
    return {f"pass@1/{m.group(1)}": v for m, v in bands if m and v is not None}


def collect_problems(runs_dir: str, runs: Sequence[Run]) -> pd.DataFrame:
    """Each run's final evaluation per problem (the trainer's eval_problems.csv.gz) with the
    run's columns: set, problem_id, topic, difficulty, samples, correct (and band)."""
    frames = []
    for run in runs:
        path = os.path.join(runs_dir, run.run_id, PER_PROBLEM_FILE)
        if os.path.exists(path):
            frames.append(pd.read_csv(path).assign(**_run_columns(run)))
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    last = [*_PROBLEM_COLUMNS, *(["band"] if "band" in out else [])]  # band: where a set has one
    return out[[c for c in out.columns if c not in last] + last]


def paired_by_problem(problems: pd.DataFrame, by: Sequence[str], column: str, a, b):
    """Per setting `by`: each problem's pass rate of `column`=a minus `column`=b (samples
    correct / samples, summed over the seeds both sides have), its mean over the problems
    with a 95% t-interval and paired p-value across problems, and the problems and seeds."""
    rows = problems[problems["set"] != "validation"] if "set" in problems else problems
    rows = rows if "seed" in rows else rows.assign(seed=0)  # a grid without a seed axis
    out = []
    for key, grp in rows.groupby(list(by), sort=False):
        sides = [grp[grp[column].astype(str) == str(v)] for v in (a, b)]
        seeds = set(sides[0].seed) & set(sides[1].seed)
        if not seeds:
            continue
        rate = [
            s[s.seed.isin(seeds)].groupby("problem_id")[["correct", "samples"]].sum() for s in sides
        ]
        both = pd.concat([r.correct / r.samples for r in rate], axis=1, join="inner").dropna()
        test = power.paired_test(both.iloc[:, 0], both.iloc[:, 1])
        test["problems"] = test.pop("seeds")
        out.append({**_key_dict(by, key), **test, "seeds": len(seeds)})
    return pd.DataFrame(out)


_PROBLEM_COLUMNS = ("set", "problem_id", "topic", "difficulty", "samples", "correct")
_LAST_WINDOW = (
    ("entropy", "actor/entropy"),
    ("zero_adv", "adv/zero_frac"),
    ("grad_norm", "actor/grad_norm"),
    ("length", "response_length/mean"),
)


def _key_dict(by: Sequence[str], key) -> dict:
    """A groupby key (a scalar for one column) as {column: value}."""
    return dict(zip(by, key if isinstance(key, tuple) else (key,)))


def interval95(x) -> tuple[float, float, float]:
    """(mean, low, high): a Student-t 95% interval over seeds (NaN width for one seed)."""
    x = np.asarray(x, np.float64)
    m = float(x.mean())
    if x.size < 2:
        return m, np.nan, np.nan
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return m, m - half, m + half


def final_rows(evals: pd.DataFrame) -> pd.DataFrame:
    """Each run's last eval row, in the grid's run order."""
    idx = evals.groupby("run_id", sort=False)["step"].idxmax()
    return evals.loc[idx].sort_index().reset_index(drop=True)


def summarize(evals: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Final pass@1 per setting `by`: seeds, mean, 95% interval, gain over the start, tokens,
    and the last eval window's entropy, zero-advantage share, grad norm and response length
    (seed means)."""
    final = final_rows(evals)
    start = evals[evals.step == 0].set_index("run_id")["pass@1"]
    out = []
    for key, grp in final.groupby(list(by), sort=False):
        m, lo, hi = interval95(grp["pass@1"])
        gain = grp["pass@1"].to_numpy() - start.reindex(grp.run_id).to_numpy()
        out.append(
            {
                **_key_dict(by, key),
                "seeds": len(grp),
                "pass@1": m,
                "ci_low": lo,
                "ci_high": hi,
                "gain": float(np.nanmean(gain)),
                "generated_tokens": float(grp["generated_tokens"].mean()),
                **{name: float(grp[k].mean()) for name, k in _LAST_WINDOW if k in grp},
            }
        )
    return pd.DataFrame(out)


def paired_difference(evals: pd.DataFrame, by: Sequence[str], column: str, a, b) -> pd.DataFrame:
    """Final pass@1 of `column`=a minus `column`=b, paired by seed, per setting `by`: mean,
    95% t-interval, paired t-test p-value, std of the differences and number of pairs."""
    final = final_rows(evals)
    out = []
    for key, grp in final.groupby(list(by), sort=False):
        pa = grp[grp[column] == a].set_index("seed")["pass@1"]
        pb = grp[grp[column] == b].set_index("seed")["pass@1"]
        both = pd.concat([pa, pb], axis=1, join="inner").dropna()
        if both.empty:
            continue
        test = power.paired_test(both.iloc[:, 0], both.iloc[:, 1])
        out.append({**_key_dict(by, key), **test})
    return pd.DataFrame(out)


def claims(
    table: pd.DataFrame, direction: Sequence[int], alpha: float = 0.05, whole: bool = False
) -> pd.DataFrame:
    """`table` (paired_difference rows) with the pre-stated verdicts. `direction` is the
    paper's sign per row (+1: a > b; 0: no claim, left out of the Holm family). `verdict`
    reads the row's 95% interval; `verdict_holm` the Holm-adjusted p-value across the claims
    (`whole`: every directed row counts in the family, one without a p-value never rejected)."""
    out = table.copy()
    out["direction"] = [int(d) for d in direction]
    claim = out.direction != 0
    family = int(claim.sum()) if whole else None
    out["p_holm"] = power.holm(np.where(claim, out["p"].to_numpy(np.float64), np.nan), family)
    out["verdict"] = [
        power.verdict(lo, hi, d) if d else "n/a"
        for lo, hi, d in zip(out.ci_low, out.ci_high, out.direction)
    ]
    out["verdict_holm"] = [
        power.holm_verdict(m, p, d, alpha) if d else "n/a"
        for m, p, d in zip(out["diff"], out.p_holm, out.direction)
    ]
    return out


def contrast(claim: str, part: str, a, b, direction: int = 1, column: str = "method", **where):
    """A claim of experiments/claims.py: `a` minus `b` (values of `column`) in grid `part`,
    on the rows where every `where` column has its value, paired by seed."""
    return {
        "claim": claim,
        "direction": direction,
        "plus": [(part, {column: a, **where})],
        "minus": [(part, {column: b, **where})],
    }


def to_markdown(df: pd.DataFrame, digits: int = 3) -> str:
    """A GitHub markdown table of `df`: floats to `digits` places, tiny ones (learning
    rates) in 2 significant digits, large ones (token counts) as integers."""

    def fmt(v) -> str:
        if not isinstance(v, float) or not np.isfinite(v):
            return str(v)
        if v != 0 and abs(v) < 10**-digits:
            return f"{v:.2g}"
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.{digits}f}"

    rows = [[fmt(v) for v in row] for row in df.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
