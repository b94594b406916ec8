"""A grid's committed results.csv and steps.csv.gz as the record of runs whose folders are gone.

`<out_dir>/runs/` is scratch (ignored by git, lost with the machine); the committed tables
hold every finished run's eval and training rows. A run with no folder under runs/ whose
recorded eval rows reach its last step counts as finished: extending a grid with more
seeds on a fresh clone trains only the new runs, and its tables keep the recorded rows.
Rows match runs by run id, which names a run's axes, not the grid's fixed settings or base
config: as with runs/, a grid whose fixed settings change needs a new out_dir.
"""

import os
from collections.abc import Mapping, Sequence

import pandas as pd

from ebpo_jax.ablation import results
from ebpo_jax.ablation.grid import Run

RESULTS, STEPS = "results.csv", "steps.csv.gz"  # per-step curves: gzip keeps them small in git
PROBLEMS = "problems.csv.gz"  # each run's final evaluation per problem
TABLES = (RESULTS, STEPS)
# Deterministic gzip (no timestamp), so an unchanged table rewrites to the same bytes.
GZIP = {"method": "gzip", "mtime": 0}


def write(out: str, evals: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """Write the two tables into `out`; returns their paths ("results", "steps")."""
    paths = {"results": os.path.join(out, RESULTS), "steps": os.path.join(out, STEPS)}
    evals.to_csv(paths["results"], index=False)
    steps.to_csv(paths["steps"], index=False, compression=GZIP)
    return paths


def write_problems(out: str, problems: pd.DataFrame) -> str | None:
    """`out`/problems.csv.gz (deterministic gzip); None when there are no rows."""
    if problems.empty:
        return None
    path = os.path.join(out, PROBLEMS)
    problems.to_csv(path, index=False, compression=GZIP)
    return path


def collect_problems(out: str, runs: Sequence[Run]) -> pd.DataFrame:
    """results.collect_problems over `out`/runs, plus the recorded rows of runs it has none of."""
    new = results.collect_problems(os.path.join(out, "runs"), runs)
    path = os.path.join(out, PROBLEMS)
    if not os.path.exists(path):
        return new
    old = pd.read_csv(path, keep_default_na=False, na_values=[""])
    fresh = set(new.run_id) if not new.empty else set()
    keep = {r.run_id for r in runs} - fresh
    return pd.concat([new, old[old.run_id.isin(keep)]], ignore_index=True)


def read(out: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(eval rows, step rows) of `out`'s committed tables; empty frames where absent."""
    frames = []
    for name in TABLES:
        path = os.path.join(out, name)
        frames.append(
            pd.read_csv(path, keep_default_na=False, na_values=[""])
            if os.path.exists(path)
            else pd.DataFrame()
        )
    return frames[0], frames[1]


def finished(out: str, last_step: Mapping[str, int]) -> set[str]:
    """Run ids (keys of `last_step`: run id -> its total_steps) recorded up to their last step."""
    evals, _ = read(out)
    if evals.empty:
        return set()
    reached = evals.groupby("run_id")["step"].max()
    return {r for r, last in last_step.items() if r in reached.index and reached[r] >= last}


def collect(out: str, runs: Sequence[Run]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """results.collect over `out`/runs, plus the recorded rows of the runs it has none of."""
    evals, steps = results.collect(os.path.join(out, "runs"), runs)
    old_evals, old_steps = read(out)
    fresh = set(evals.run_id) if not evals.empty else set()
    keep = {r.run_id for r in runs} - fresh
    order = {r.run_id: i for i, r in enumerate(runs)}

    def merged(new: pd.DataFrame, old: pd.DataFrame) -> pd.DataFrame:
        if not old.empty:
            new = pd.concat([new, old[old.run_id.isin(keep)]], ignore_index=True)
        if new.empty:
            return new
        rank = new.run_id.map(order)
        return new.iloc[rank.argsort(kind="stable")].reset_index(drop=True)

    return merged(evals, old_evals), merged(steps, old_steps)
