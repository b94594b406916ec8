"""Train a grid: validate every run's config, adopt finished runs (this grid's, reused
grids', the committed results.csv's), hand the rest to an executor, then write the tables;
seeds by a power pilot or --seeds, runs by --only."""

import collections
import json
import os
import re
import time
from typing import NamedTuple

from ebpo_jax.ablation.executor import Executor, Job, LocalPool, Progress
from ebpo_jax.ablation.power import PowerAnalysis
from ebpo_jax.ablation.tables import choose_seeds, write_results

WARM_STARTS = "warm_starts"  # <out_dir>/warm_starts/<sha256>.npz: committed warm starts


def configs_of(grid, runs, runs_dir) -> dict:
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
    from ebpo_jax.runtime.workdir import WorkdirError, check_workdir

    for r in todo:
        try:
            check_workdir(configs[r.run_id].workdir, restart=False)
        except WorkdirError:
            log(f"  {r.run_id}: stopped before its first checkpoint, starts over")
            configs[r.run_id].restart = True


def dispatch_order(todo: list) -> list:
    """`todo` seed-major, and within a seed each warm start's first run before any second."""
    # Seed-major: one seed of every setting first (an early full picture), and the later
    # seeds reuse the first seed's compiled programs from the persistent cache. Round-robin
    # over warm starts: runs started together then never share one, so none waits on
    # another's SFT or difficulty estimate (both once per warm start).
    nth, seen = {}, collections.Counter()
    for r in todo:
        key = (r.value("seed", 0), r.value("sft.seed"))
        nth[r.run_id], seen[key] = seen[key], seen[key] + 1
    place = {r.run_id: i for i, r in enumerate(todo)}
    return sorted(todo, key=lambda r: (r.value("seed", 0), nth[r.run_id], place[r.run_id]))


def _train_grid(grid, runs, out, executor: Executor, log) -> tuple[list[str], dict]:
    """Train the unfinished `runs` of `grid` (seed-major) after adopting the same runs of
    the grids in its `reuse` list; returns the ids trained and {run id: why} of those that
    failed. Refuses a grid whose claims file is not committed."""
    from tqdm.auto import tqdm

    from ebpo_jax.ablation import reuse

    runs_dir, cache_dir = os.path.join(out, "runs"), os.path.join(out, "jax_cache")
    stamp = claims_stamp(grid)
    configs = configs_of(grid, runs, runs_dir)
    reuse.adopt(configs, runs_dir, grid.get("reuse", ()), log=log)
    done = _finished(runs, configs, out)
    todo = dispatch_order([r for r in runs if r.run_id not in done])
    log(f"grid {grid.name}: {len(runs)} runs, {len(done)} finished, {len(todo)} to train -> {out}")
    _start_over_uncheckpointed(todo, configs, log)
    os.makedirs(out, exist_ok=True)
    bar = tqdm(total=len(runs), initial=len(done), unit="run", desc=grid.name, disable=False)
    progress = Progress(bar, len(runs), len(done), log)
    jobs = [Job(r.run_id, configs[r.run_id].to_json()) for r in todo]
    try:
        return executor.train(jobs, cache_dir, stamp, progress), progress.failures
    finally:
        bar.close()


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


NO_POWER_ANALYSIS = PowerAnalysis()


class Selection(NamedTuple):
    """Which of a grid's runs one call trains (ablate.py's --seeds, --only, --dry_run and
    --plots_only)."""

    seeds: int = 0  # > 0: seeds 0..seeds-1 of every setting; 0: the grid's own (or the pilot's)
    only: str = ""  # a regex: train only the run ids it matches ("" = every run)
    dry_run: bool = False  # list each run's state, train nothing
    plots_only: bool = False  # train nothing: the tables and plots of the runs there are


EVERY_RUN = Selection()


def _power_pilot(grid, out, analysis: PowerAnalysis, *, alpha, executor, dry_run, log):
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
    trained, failed = _train_grid(pilot, pilot_runs, out, executor, log)
    if failed:
        raise RuntimeError(f"power pilot: {len(failed)} runs failed ({', '.join(failed)})")
    evals, _ = record.collect(out, pilot_runs)
    report = choose_seeds(evals, pilot_runs, analysis, alpha=alpha, log=log)
    with open(os.path.join(out, "power.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    return ablation.with_seeds(grid, range(report["seeds"])), report, trained


def _list_runs(grid, runs, out: str, log) -> dict:
    """--dry_run: each run's state (done or todo); trains nothing."""
    done = _finished(runs, configs_of(grid, runs, os.path.join(out, "runs")), out)
    for r in runs:
        log(f"  {'done' if r.run_id in done else 'todo'}  {r.run_id}")
    return {"runs": [r.run_id for r in runs], "trained": []}


def run_grid(
    grid,
    *,
    executor: Executor | None = None,
    select: Selection = EVERY_RUN,
    analysis: PowerAnalysis = NO_POWER_ANALYSIS,
    alpha: float = 0.05,
    log=print,
) -> dict:
    """Train the grid's unfinished runs that `select` picks (seeds by power analysis when
    analysis.effect > 0) on `executor` (default: LocalPool(1), in this process), then write
    the tables and plots; returns paths, the run ids, those trained and {run id: why} of
    those that failed."""
    from ebpo_jax import ablation

    executor = executor or LocalPool(1)
    out = os.path.abspath(grid.out_dir)
    power_report, trained, failed = None, [], {}
    if select.seeds:
        if analysis.effect > 0 or select.seeds < 1:
            raise ValueError(f"--seeds={select.seeds}: give N >= 1, and not with --power_effect")
        grid = ablation.with_seeds(grid, range(select.seeds))
    if analysis.effect > 0 and not select.plots_only:
        grid, power_report, trained = _power_pilot(
            grid, out, analysis, alpha=alpha, executor=executor, dry_run=select.dry_run, log=log
        )
    runs = ablation.expand(grid)
    if select.dry_run:
        return _list_runs(grid, runs, out, log)
    t0 = time.time()
    if not select.plots_only:
        done, failed = _train_grid(grid, _matching(runs, select.only), out, executor, log)
        trained += done
    paths = write_results(grid, runs, out, alpha=alpha, log=log)
    log(f"{len(trained)} runs trained in {time.time() - t0:.0f} s; results: {paths['results']}")
    if failed:
        log(f"{len(failed)} runs FAILED (the tables leave them out): {', '.join(failed)}")
    result = {"runs": [r.run_id for r in runs], "trained": trained, "failed": failed}
    return {**paths, **result, "power": power_report}
