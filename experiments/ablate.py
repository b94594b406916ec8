"""Run an ablation grid: `python experiments/ablate.py --config=configs/ablations/<grid>.py`.

Each run trains in `<out_dir>/runs/<run_id>`; a run with a `summary.json` is finished and
skipped, an interrupted one resumes from its checkpoint. runs/ is scratch: a run without a
folder there that the committed results.csv holds to its last step is finished too, and
keeps its recorded rows (ebpo_jax/ablation/record.py), so more seeds on a fresh clone train
only the new runs. Then `<out_dir>/results.csv` (one row per run and eval step, with the
run's jax/jaxlib versions, machine, CPU and XLA flags),
`steps.csv.gz` (per-step training curves), `summary.md` (final pass@1 per setting, 95%
intervals over seeds, and each paired comparison with its p-value, Holm correction and
verdict) and PNG plots under `<out_dir>/plots/`.
`--config=...py:paper` selects a grid's paper-scale variant (pod configs).

Seeds by power analysis: `--power_effect=0.02 --power=0.8 --pilot_seeds=4 --max_seeds=20`
first trains seeds 0..3 of every run, estimates the std of each claim's paired difference
(EBPO variants minus the reference method, per setting), prints how many paired seeds a
two-sided paired t-test at `--alpha` needs to detect `--power_effect` with that power, and
trains that many (the largest over the claims, capped at --max_seeds); `power.json` records it.
`--seeds=N` trains seeds 0..N-1 instead, e.g. the count a cross-grid claim needs
(`experiments/claims.py`'s `seeds for` column), and `--only=REGEX` trains only the matching
run ids (the cells that claim reads); the tables list every run with rows.
Shared runs: a grid's `reuse` (a list of other grids' out_dirs) adopts their finished runs
whose training config equals a run's but for `workdir` (ebpo_jax/ablation/reuse.py).
Reproducibility: `--rerun=RUN_ID` retrains one run of the committed results.csv in
`<out_dir>/rerun/` (from the recorded warm start's weights when `<out_dir>/warm_starts/`
holds them) and reports whether its rows match (|a - b| <= --rerun_atol) and a verdict:
`bitwise` on the recorded CPU family, inside or outside the cell's seed band on another;
in `<out_dir>/rerun/<run_id>.json` (`<run_id>__on-<family>.json` from another family).
Every run records the SHA-256 of its warm start and of its grid's `claims_file`, which
must be committed before the grid trains (ebpo_jax/ablation/registration.py); each run's
final evaluation per problem goes to `problems.csv.gz`.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import NamedTuple

from absl import flags

from ebpo_jax import cli

_CONFIG = cli.define_config("config", None, "Ablation grid config.")
_WORKERS = flags.DEFINE_integer("workers", 1, "Runs trained at once, one process each (CPU).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the runs and their state; train nothing.")
_PLOTS_ONLY = flags.DEFINE_bool("plots_only", False, "Only collect results and plot.")
_POWER_EFFECT = flags.DEFINE_float(
    "power_effect", 0.0, "Pass@1 difference to detect; > 0 chooses the seeds by a pilot."
)
_POWER = flags.DEFINE_float("power", 0.8, "Target power of the paired t-test.")
_ALPHA = flags.DEFINE_float("alpha", 0.05, "Two-sided level of the paired tests and Holm.")
_PILOT = flags.DEFINE_integer("pilot_seeds", 4, "Seeds of the pilot that estimates the std.")
_MAX_SEEDS = flags.DEFINE_integer("max_seeds", 20, "Cap on the seeds the power analysis picks.")
_SEEDS = flags.DEFINE_integer(
    "seeds", 0, "Train seeds 0..N-1 of every run instead of the grid's (0: the grid's)."
)
_ONLY = flags.DEFINE_string(
    "only", "", "Train only the runs whose id matches this regex; the tables keep every run."
)
_RERUN = flags.DEFINE_string("rerun", "", "Retrain this run id and compare with results.csv.")
_RERUN_ATOL = flags.DEFINE_float("rerun_atol", 0.0, "Tolerance of --rerun (0 = bitwise).")

REFERENCE = "grpo"  # the method every other one is compared with, paired by seed
WARM_STARTS = "warm_starts"  # <out_dir>/warm_starts/<sha256>.npz: committed warm starts
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


def _quiet(*_):
    pass


def _setup_jax(cache_dir: str) -> None:
    """Share compiled programs across runs: seeds and repeats hit the persistent cache."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


_PARENT_PID = None  # set in pool workers


class GridStopped(Exception):
    """A signal stopped the run in progress at a checkpoint: the grid stops with it."""


def _orphaned() -> bool:
    """A pool worker whose grid process has died (its queued runs must not start)."""
    return _PARENT_PID is not None and os.getppid() != _PARENT_PID


def train_run(config_json: str, cache_dir: str, stamp: dict | None = None) -> dict:
    """Train one run from its config (JSON); write summary.json (with provenance, the warm
    start's SHA-256 and `stamp`, e.g. the claims file's SHA-256) when done."""
    if _orphaned():
        os._exit(0)
    import ml_collections

    from ebpo_jax.ablation.provenance import code_version, provenance
    from ebpo_jax.config import finalize

    _setup_jax(cache_dir)
    from ebpo_jax.trainer.loop import train

    code_version()  # the source as imported, before a run that may outlast the checkout

    config = finalize(ml_collections.ConfigDict(json.loads(config_json)))
    summary = train(config, log=_quiet)
    if _orphaned():  # the death signal stopped this run at a checkpoint; take no other
        os._exit(0)
    if not summary["stopped_early"]:
        warm = {"warm_start_sha256": summary.get("base_sha256") or ""}
        summary["provenance"] = {**provenance(), **warm, **(stamp or {})}
        with open(os.path.join(config.workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _worker_init():
    global _PARENT_PID
    _PARENT_PID = os.getppid()
    os.environ["TQDM_DISABLE"] = "1"
    # When the grid process dies, SIGTERM stops the run in progress at a checkpoint (the
    # trainer's preemption path), then the worker exits instead of taking queued runs.
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _configs(grid, runs, runs_dir) -> dict:
    """Each run's training config, every one validated before anything trains."""
    import jax

    from ebpo_jax import ablation
    from ebpo_jax import config as config_lib
    from ebpo_jax.ablation import grid as grid_lib

    base = grid_lib.load_config_file(grid.base_config)
    configs = {}
    for run in runs:
        cfg = ablation.run_config(base, run, os.path.join(runs_dir, run.run_id))
        if grid.get("commit_warm_starts", False):  # content-addressed, next to results.csv
            cfg.sft.export_dir = os.path.join(os.path.dirname(runs_dir), WARM_STARTS)
        try:
            config_lib.validate(cfg, jax.device_count())
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"grid {grid.name}, run {run.run_id}: {e}") from None
        configs[run.run_id] = cfg
    return configs


def _train_all(todo, configs, cache_dir, workers, bar, stamp=None) -> list[str]:
    """Train `todo` in order (one process) or on a pool of `workers` processes."""
    trained = []
    if workers <= 1:
        os.environ["TQDM_DISABLE"] = "1"  # the per-run step bars; the grid bar stays
        try:
            for r in todo:
                bar.set_postfix_str(r.run_id)
                summary = train_run(configs[r.run_id].to_json(), cache_dir, stamp)
                if summary["stopped_early"]:  # the trainer took the signal meant for the grid
                    raise GridStopped(
                        f"a signal stopped run {r.run_id} at step {summary['step']} with a "
                        "checkpoint; the same command resumes the grid"
                    )
                trained.append(r.run_id)
                bar.update()
        finally:
            os.environ.pop("TQDM_DISABLE", None)
        return trained
    import concurrent.futures as cf
    import multiprocessing as mp

    # One XLA thread per worker (they share the cores); the spawned workers inherit it,
    # this process (jax already loaded) does not use it, and it is restored after.
    flags_before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = (flags_before or "") + " --xla_cpu_multi_thread_eigen=false"
    ctx = mp.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futs = {
                pool.submit(train_run, configs[r.run_id].to_json(), cache_dir, stamp): r
                for r in todo
            }
            for fut in cf.as_completed(futs):
                fut.result()  # a failed run stops the grid with its error
                trained.append(futs[fut].run_id)
                bar.update()
    finally:
        if flags_before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags_before
    return trained


def _finished(runs, configs, out) -> set[str]:
    """Run ids with a summary.json under runs/, or with no folder there that the committed
    results.csv holds to their last step."""
    from ebpo_jax.ablation import record, results

    runs_dir = os.path.join(out, "runs")
    done = {r.run_id for r in runs if results.finished(os.path.join(runs_dir, r.run_id))}
    gone = {
        r.run_id: configs[r.run_id].total_steps
        for r in runs
        if not os.path.isdir(os.path.join(runs_dir, r.run_id))
    }
    return done | record.finished(out, gone)


def claims_stamp(grid) -> dict:
    """{"claims_sha256": ...} of the grid's `claims_file`, which must be committed (the
    pre-registration); {} for a grid without one."""
    from ebpo_jax.ablation import grid as grid_lib
    from ebpo_jax.ablation import registration

    if not grid.get("claims_file"):
        return {}
    path = os.path.join(grid_lib.REPO, grid.claims_file)
    if not os.path.exists(path):
        raise ValueError(f"grid {grid.name}: claims_file {grid.claims_file!r} does not exist")
    registration.committed(path)
    return {"claims_sha256": registration.file_sha256(path)}


def _start_over_uncheckpointed(todo, configs, log) -> None:
    """Mark for a restart each run stopped before its first checkpoint: it has metrics but
    nothing to resume from, and the grid owns its folder, so it starts over (its metrics
    rewritten) where the trainer alone would refuse the folder."""
    from ebpo_jax.workdir import WorkdirError, check_workdir

    for r in todo:
        try:
            check_workdir(configs[r.run_id].workdir, restart=False)
        except WorkdirError:
            log(f"  {r.run_id}: stopped before its first checkpoint, starts over")
            configs[r.run_id].restart = True


def _train_grid(grid, runs, out, workers, log) -> list[str]:
    """Train the unfinished `runs` of `grid` (seed-major) after adopting the same runs of
    the grids in its `reuse` list; returns the ids trained. Refuses a grid whose claims
    file is not committed."""
    from tqdm.auto import tqdm

    from ebpo_jax.ablation import reuse

    runs_dir, cache_dir = os.path.join(out, "runs"), os.path.join(out, "jax_cache")
    stamp = claims_stamp(grid)
    configs = _configs(grid, runs, runs_dir)
    reuse.adopt(configs, runs_dir, grid.get("reuse", ()), log=log)
    done = _finished(runs, configs, out)
    todo = [r for r in runs if r.run_id not in done]
    # Seed-major: one seed of every setting first (an early full picture), and the later
    # seeds reuse the first seed's compiled programs from the persistent cache.
    order = {r.run_id: i for i, r in enumerate(runs)}
    todo.sort(key=lambda r: (r.value("seed", 0), order[r.run_id]))
    log(f"grid {grid.name}: {len(runs)} runs, {len(done)} finished, {len(todo)} to train -> {out}")
    _start_over_uncheckpointed(todo, configs, log)
    os.makedirs(out, exist_ok=True)
    bar = tqdm(total=len(runs), initial=len(done), unit="run", desc=grid.name, disable=False)
    try:
        return _train_all(todo, configs, cache_dir, workers, bar, stamp)
    finally:
        bar.close()


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


def choose_seeds(evals, runs, *, effect, power, alpha, pilot, max_seeds, log=print) -> dict:
    """Seeds for `power` to detect `effect` on every claim, from the pilot's difference stds."""
    import pandas as pd

    from ebpo_jax import ablation
    from ebpo_jax.ablation import power as power_lib

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
    recorded CPU family, inside or outside the cell's seed band on another.
    """
    from ebpo_jax import ablation

    out = os.path.abspath(grid.out_dir)
    recorded_all, old = _recorded_rows(out, run_id)
    run = _find_run(grid, out, run_id)
    rerun_dir = os.path.join(out, "rerun")
    workdir = os.path.join(rerun_dir, run_id)
    shutil.rmtree(workdir, ignore_errors=True)
    config = _configs(grid, [run], rerun_dir)[run_id]
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
    log(
        f"rerun {run_id}: {verdict} (max |diff| {report.get('max_abs_diff')}, atol {atol}); "
        f"{report['verdict']}"
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
        warm_start_file=warm_file,
        **_against_band(recorded_all, old, new, run),
    )
    report["verdict"] = reproduce.verdict(
        report["match"], recorded.get("cpu", ""), prov.get("cpu", ""),
        report["final_pass@1"]["rerun"], report["seed_band"], atol,
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
        "import sys; sys.path.insert(0, sys.argv[1]); import ablate; "
        "ablate.train_run(open(sys.argv[2]).read(), sys.argv[3])"
    )
    os.makedirs(workdir, exist_ok=True)
    cfg_path = os.path.join(workdir, "rerun_config.json")
    with open(cfg_path, "w") as f:
        f.write(config.to_json())
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        [sys.executable, "-c", code, here, cfg_path, cache_dir],
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
    return {
        "warm_start_pass@1": {"recorded": at(old, 0), "rerun": at(new, 0)},
        "final_pass@1": {"recorded": at(old), "rerun": at(new)},
        "seed_band": reproduce.seed_band(final_rows(recorded_all), cell),
    }


def _matching(runs, only: str):
    """The runs whose id matches the regex `only` (every run when it is empty)."""
    if not only:
        return runs
    try:
        pattern = re.compile(only)
    except re.error as e:
        raise ValueError(f"--only={only!r}: not a regex ({e})") from None
    chosen = [r for r in runs if pattern.search(r.run_id)]
    if not chosen:
        raise ValueError(f"--only={only!r}: matches none of the grid's {len(runs)} run ids")
    return chosen


class PowerAnalysis(NamedTuple):
    """Seeds by power analysis: a pilot of `pilot_seeds`, then enough seeds (at most
    `max_seeds`) to detect `effect` with `power` (effect 0: off)."""

    effect: float = 0.0
    power: float = 0.8
    pilot_seeds: int = 4
    max_seeds: int = 20


NO_POWER_ANALYSIS = PowerAnalysis()


def _power_pilot(grid, out, analysis: PowerAnalysis, *, alpha, workers, dry_run, log):
    """(the grid at the seeds the pilot chose, the power report, the runs trained); with
    dry_run, the pilot grid itself and no report."""
    from ebpo_jax import ablation
    from ebpo_jax.ablation import record

    n = analysis.pilot_seeds
    if n < 2:
        raise ValueError(f"--pilot_seeds={n}: a std needs >= 2 paired seeds")
    pilot = ablation.with_seeds(grid, range(n))
    pilot_runs = ablation.expand(pilot)
    if dry_run:
        log(f"power analysis: a pilot of {n} seeds first ({len(pilot_runs)} runs)")
        return pilot, None, []
    trained = _train_grid(pilot, pilot_runs, out, workers, log)
    evals, _ = record.collect(out, pilot_runs)
    report = choose_seeds(
        evals, pilot_runs, effect=analysis.effect, power=analysis.power, alpha=alpha,
        pilot=analysis.pilot_seeds, max_seeds=analysis.max_seeds, log=log,
    )  # fmt: skip
    with open(os.path.join(out, "power.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    return ablation.with_seeds(grid, range(report["seeds"])), report, trained


def run_grid(
    grid,
    *,
    workers: int = 1,
    dry_run: bool = False,
    plots_only: bool = False,
    analysis: PowerAnalysis = NO_POWER_ANALYSIS,
    alpha: float = 0.05,
    seeds: int = 0,
    only: str = "",
    log=print,
) -> dict:
    """Train the grid's unfinished runs (seeds by power analysis when analysis.effect > 0, or
    0..seeds-1; only the ids matching `only`), then write the tables and plots; returns
    paths, the run ids and those trained."""
    from ebpo_jax import ablation

    out = os.path.abspath(grid.out_dir)
    power_report, trained = None, []
    if seeds:
        if analysis.effect > 0 or seeds < 1:
            raise ValueError(f"--seeds={seeds}: give N >= 1, and not with --power_effect")
        grid = ablation.with_seeds(grid, range(seeds))
    if analysis.effect > 0 and not plots_only:
        grid, power_report, trained = _power_pilot(
            grid, out, analysis, alpha=alpha, workers=workers, dry_run=dry_run, log=log
        )
    runs = ablation.expand(grid)
    if dry_run:
        done = _finished(runs, _configs(grid, runs, os.path.join(out, "runs")), out)
        for r in runs:
            log(f"  {'done' if r.run_id in done else 'todo'}  {r.run_id}")
        return {"runs": [r.run_id for r in runs], "trained": []}
    t0 = time.time()
    if not plots_only:
        trained += _train_grid(grid, _matching(runs, only), out, workers, log)
    paths = write_results(grid, runs, out, alpha=alpha, log=log)
    log(f"{len(trained)} runs trained in {time.time() - t0:.0f} s; results: {paths['results']}")
    return {**paths, "runs": [r.run_id for r in runs], "trained": trained, "power": power_report}


def main(argv):
    del argv
    if _CONFIG.value is None:
        sys.exit("give a grid: --config=configs/ablations/<grid>.py (see configs/ablations/)")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    if _RERUN.value:
        report = rerun(_CONFIG.value, _RERUN.value, atol=_RERUN_ATOL.value)
        sys.exit(0 if report["match"] or "inside" in report["verdict"] else 1)
    analysis = PowerAnalysis(_POWER_EFFECT.value, _POWER.value, _PILOT.value, _MAX_SEEDS.value)
    try:
        run_grid(
            _CONFIG.value,
            workers=_WORKERS.value,
            dry_run=_DRY_RUN.value,
            plots_only=_PLOTS_ONLY.value,
            analysis=analysis,
            alpha=_ALPHA.value,
            seeds=_SEEDS.value,
            only=_ONLY.value,
        )
    except GridStopped as e:
        sys.exit(f"stopped: {e}")


if __name__ == "__main__":
    from ebpo_jax.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
