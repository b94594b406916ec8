"""Reproducibility: `--rerun=RUN_ID` retrains one run of the committed results.csv and
compares its rows with the recorded ones (bitwise on the recorded CPU family, else against
the cell's seed band)."""

import json
import os
import shutil
import subprocess
import sys
import time

from ebpo_jax.ablation import grid as grid_lib
from ebpo_jax.ablation.runner import WARM_STARTS, configs_of


def _find_run(grid, out, run_id):
    """The Run of `run_id`: in the grid, or in it with the seeds results.csv holds."""
    import pandas as pd

    from ebpo_jax import ablation

    runs = {r.run_id: r for r in ablation.expand(grid)}
    results = os.path.join(out, "results.csv")
    if run_id not in runs and os.path.exists(results):
        seeds = sorted(pd.read_csv(results)["seed"].dropna().astype(int).unique())
        runs.update({r.run_id: r for r in ablation.expand(ablation.with_seeds(grid, seeds))})
    if run_id not in runs:
        raise ValueError(f"--rerun={run_id!r}: no such run in grid {grid.name}")
    return runs[run_id]


def compare_rows(old, new, atol: float = 0.0) -> dict:
    """Whether two runs' eval rows agree: same steps, and every numeric metric within atol
    (NaN matches NaN); returns {"match", "max_abs_diff", "columns": {name: max |a - b|}}."""
    import numpy as np

    from ebpo_jax.ablation.results import CURVES

    cols = [c for c in ("generated_tokens", "pass@1", *CURVES) if c in old and c in new]
    old, new = old.sort_values("step"), new.sort_values("step")
    if list(old.step) != list(new.step):
        return {"match": False, "why": f"eval steps {list(old.step)} != {list(new.step)}"}
    diffs = {}
    for c in cols:
        a, b = old[c].to_numpy(np.float64), new[c].to_numpy(np.float64)
        both_nan = np.isnan(a) & np.isnan(b)
        d = np.where(both_nan, 0.0, np.abs(a - b))
        diffs[c] = float(np.nan_to_num(d, nan=np.inf).max(initial=0.0))
    worst = max(diffs.values(), default=0.0)
    return {"match": bool(worst <= atol), "max_abs_diff": worst, "columns": diffs}


def rerun(grid, run_id: str, *, atol: float = 0.0, log=print) -> dict:
    """Retrain one run of the committed results.csv and compare its rows with the recorded ones.

    The run trains in a fresh process with the XLA_FLAGS and matmul precision the recorded
    run used (its provenance), in `<out_dir>/rerun/<run_id>`, from the recorded warm start's
    committed weights when `<out_dir>/warm_starts/` holds them; versions and machine are
    reported beside the recorded ones, and `verdict` is reproduce.verdict's: bitwise on the
    recorded CPU family, inside or outside the cell's seed band on another (the band of the
    run's warm start; with an `sft.seed` axis `cell_verdict` reads the band over all of the
    cell's warm starts, as the paper grids' rerun rule states).
    """
    from ebpo_jax import ablation

    out = os.path.abspath(grid.out_dir)
    recorded_all, old = _recorded_rows(out, run_id)
    run = _find_run(grid, out, run_id)
    rerun_dir = os.path.join(out, "rerun")
    workdir = os.path.join(rerun_dir, run_id)
    shutil.rmtree(workdir, ignore_errors=True)
    config = configs_of(grid, [run], rerun_dir)[run_id]
    recorded = old.iloc[0].to_dict()
    config.sft.export_dir = ""  # a rerun adds nothing to the committed warm starts
    warm_file = _committed_warm_start(out, recorded.get("warm_start_sha256"))
    if warm_file:  # the recorded weights, whatever CPU family trained them
        config.sft.params_file = warm_file
    t0 = time.time()
    _train_like(config, recorded, workdir, os.path.join(out, "jax_cache"))
    new, _ = ablation.collect(rerun_dir, [run])
    prov = ablation.results.run_provenance(workdir)
    report = _rerun_report(recorded_all, old, new, run, prov, atol=atol, warm_file=warm_file)
    report["wall_time_s"] = time.time() - t0
    log(json.dumps(report, indent=2, default=str))
    with open(_report_path(rerun_dir, run_id, recorded, prov), "w") as f:
        json.dump(report, f, indent=2, default=str)  # the record; the run's folder is not kept
    verdict = "MATCH" if report["match"] else "MISMATCH"
    cell = report.get("cell_verdict")
    log(
        f"rerun {run_id}: {verdict} (max |diff| {report.get('max_abs_diff')}, atol {atol}); "
        f"{report['verdict']}" + (f"; over the cell's warm starts: {cell}" if cell else "")
    )
    return report


def _recorded_rows(out: str, run_id: str):
    """(every row of `out`'s results.csv, the rows of run_id), after one-line checks."""
    import pandas as pd

    results = os.path.join(out, "results.csv")
    if not os.path.exists(results):
        raise ValueError(f"--rerun: no {results} to compare with")
    recorded_all = pd.read_csv(results, keep_default_na=False, na_values=[""])
    old = recorded_all[recorded_all.run_id == run_id]
    if old.empty:
        raise ValueError(f"--rerun={run_id!r}: not in {results}")
    return recorded_all, old


def _rerun_report(recorded_all, old, new, run, prov: dict, *, atol: float, warm_file: str):
    """The rows compared, both provenances, the seed band and reproduce.verdict's verdict."""
    from ebpo_jax.ablation import reproduce

    recorded = old.iloc[0].to_dict()
    report = compare_rows(old, new, atol)
    report.update(
        run_id=run.run_id,
        atol=atol,
        recorded={k: recorded.get(k) for k in prov},
        now=prov,
        # Relative to the grid's out_dir: the record reads the same on every machine.
        warm_start_file=os.path.join(WARM_STARTS, os.path.basename(warm_file)) if warm_file else "",
        **_against_band(recorded_all, old, new, run),
    )
    for band, name in (("seed_band", "verdict"), ("cell_band", "cell_verdict")):
        if band in report:
            report[name] = reproduce.verdict(
                report["match"], recorded.get("cpu", ""), prov.get("cpu", ""),
                report["final_pass@1"]["rerun"], report[band], atol,
            )  # fmt: skip
    return report


def _train_like(config, recorded: dict, workdir: str, cache_dir: str) -> None:
    """Train `config` in a fresh process with the XLA_FLAGS and matmul precision of the
    recorded row (the process-level settings that change the numbers)."""
    env = dict(os.environ)
    if isinstance(recorded.get("xla_flags"), str):
        env["XLA_FLAGS"] = recorded["xla_flags"]
    if isinstance(recorded.get("matmul_precision"), str) and recorded["matmul_precision"]:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = recorded["matmul_precision"]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from ebpo_jax.ablation import executor; "
        "executor.train_run(open(sys.argv[2]).read(), sys.argv[3])"
    )
    os.makedirs(workdir, exist_ok=True)
    cfg_path = os.path.join(workdir, "rerun_config.json")
    with open(cfg_path, "w") as f:
        f.write(config.to_json())
    subprocess.run(
        [sys.executable, "-c", code, grid_lib.REPO, cfg_path, cache_dir],
        env={**env, "TQDM_DISABLE": "1"},
        check=True,
    )


def _report_path(rerun_dir: str, run_id: str, recorded: dict, now: dict) -> str:
    """`<run_id>.json`, or `<run_id>__on-<family>.json` from another CPU family (both kept)."""
    from ebpo_jax.ablation.provenance import cpu_family

    family = cpu_family(now.get("cpu", ""))
    same = cpu_family(recorded.get("cpu", "")) == family
    return os.path.join(rerun_dir, f"{run_id}.json" if same else f"{run_id}__on-{family}.json")


def _committed_warm_start(out: str, sha) -> str:
    """The committed `<out>/warm_starts/<sha>.npz` of a recorded warm start ("" if none)."""
    if not isinstance(sha, str) or not sha:
        return ""
    path = os.path.join(out, WARM_STARTS, f"{sha}.npz")
    return path if os.path.exists(path) else ""


def _against_band(recorded_all, old, new, run) -> dict:
    """The rerun's warm-start and final pass@1 beside the record's, and its cell's seed band."""
    from ebpo_jax.ablation import reproduce
    from ebpo_jax.ablation.results import final_rows

    def at(rows, step=None):
        rows = rows.sort_values("step")
        pick = rows[rows.step == step] if step is not None else rows.tail(1)
        return float(pick["pass@1"].iloc[0]) if len(pick) else float("nan")

    cell = {"block": run.block, **{a: v for a, v in run.values if a != "seed"}}
    finals = final_rows(recorded_all)
    out = {
        "warm_start_pass@1": {"recorded": at(old, 0), "rerun": at(new, 0)},
        "final_pass@1": {"recorded": at(old), "rerun": at(new)},
        "seed_band": reproduce.seed_band(finals, cell),
    }
    if "sft.seed" in cell:  # the paper grids' rerun rule: the cell over all its warm starts
        cell.pop("sft.seed")
        out["cell_band"] = reproduce.seed_band(finals, cell)
    return out
