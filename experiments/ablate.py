"""Run an ablation grid: `python experiments/ablate.py --config=configs/ablations/<grid>.py`.

Each run trains in `<out_dir>/runs/<run_id>`; a run with a `summary.json` is finished and
skipped, an interrupted one resumes from its checkpoint. Then `<out_dir>/results.csv` (one
row per run and eval step), `steps.csv` (per-step training curves), `summary.md` (final
pass@1 per setting, 95% intervals over seeds) and PNG plots under `<out_dir>/plots/`.
`--config=...py:paper` selects a grid's paper-scale variant (pod configs).
"""

import json
import os
import sys
import time

from absl import flags

from ebpo_jax import cli

_CONFIG = cli.define_config("config", None, "Ablation grid config.")
_WORKERS = flags.DEFINE_integer("workers", 1, "Runs trained at once, one process each (CPU).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the runs and their state; train nothing.")
_PLOTS_ONLY = flags.DEFINE_bool("plots_only", False, "Only collect results and plot.")


def _quiet(*_):
    pass


def _setup_jax(cache_dir: str) -> None:
    """Share compiled programs across runs: seeds and repeats hit the persistent cache."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


_PARENT_PID = None  # set in pool workers


def _orphaned() -> bool:
    """A pool worker whose grid process has died (its queued runs must not start)."""
    return _PARENT_PID is not None and os.getppid() != _PARENT_PID


def train_run(config_json: str, cache_dir: str) -> dict:
    """Train one run from its config (JSON); write summary.json when it finished."""
    if _orphaned():
        os._exit(0)
    import ml_collections

    from ebpo_jax.config import finalize

    _setup_jax(cache_dir)
    from ebpo_jax.trainer.loop import train

    config = finalize(ml_collections.ConfigDict(json.loads(config_json)))
    summary = train(config, log=_quiet)
    if _orphaned():  # the death signal stopped this run at a checkpoint; take no other
        os._exit(0)
    if not summary["stopped_early"]:
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


def run_grid(
    grid, *, workers: int = 1, dry_run: bool = False, plots_only: bool = False, log=print
) -> dict:
    """Train the grid's unfinished runs, then write the tables and plots; returns paths."""
    import jax
    import pandas as pd
    from tqdm.auto import tqdm

    from ebpo_jax import ablation
    from ebpo_jax import config as config_lib
    from ebpo_jax.ablation import grid as grid_lib
    from ebpo_jax.ablation import plots

    runs = ablation.expand(grid)
    base = grid_lib.load_config_file(grid.base_config)
    out = os.path.abspath(grid.out_dir)
    runs_dir, cache_dir = os.path.join(out, "runs"), os.path.join(out, "jax_cache")
    configs = {}
    for run in runs:  # every run's config is checked before anything trains
        cfg = ablation.run_config(base, run, os.path.join(runs_dir, run.run_id))
        try:
            config_lib.validate(cfg, jax.device_count())
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"grid {grid.name}, run {run.run_id}: {e}") from None
        configs[run.run_id] = cfg
    done = {
        r.run_id for r in runs if os.path.exists(os.path.join(runs_dir, r.run_id, "summary.json"))
    }
    todo = [] if plots_only else [r for r in runs if r.run_id not in done]
    # Seed-major: one seed of every setting first (an early full picture), and the later
    # seeds reuse the first seed's compiled programs from the persistent cache.
    order = {r.run_id: i for i, r in enumerate(runs)}
    todo.sort(key=lambda r: (r.value("seed", 0), order[r.run_id]))
    log(f"grid {grid.name}: {len(runs)} runs, {len(done)} finished, {len(todo)} to train -> {out}")
    if dry_run:
        for r in runs:
            log(f"  {'done' if r.run_id in done else 'todo'}  {r.run_id}")
        return {"runs": [r.run_id for r in runs], "trained": []}
    os.makedirs(out, exist_ok=True)
    t0, trained = time.time(), []
    bar = tqdm(total=len(runs), initial=len(done), unit="run", desc=grid.name, disable=False)
    if workers <= 1:
        os.environ["TQDM_DISABLE"] = "1"  # the per-run step bars; the grid bar stays
        try:
            for r in todo:
                bar.set_postfix_str(r.run_id)
                train_run(configs[r.run_id].to_json(), cache_dir)
                trained.append(r.run_id)
                bar.update()
        finally:
            os.environ.pop("TQDM_DISABLE", None)
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        # One XLA thread per worker (they share the cores); the spawned workers inherit it,
        # this process (jax already loaded) does not use it, and it is restored after.
        flags = os.environ.get("XLA_FLAGS")
        os.environ["XLA_FLAGS"] = (flags or "") + " --xla_cpu_multi_thread_eigen=false"
        ctx = mp.get_context("spawn")
        try:
            with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
                futs = {
                    pool.submit(train_run, configs[r.run_id].to_json(), cache_dir): r for r in todo
                }
                for fut in cf.as_completed(futs):
                    fut.result()  # a failed run stops the grid with its error
                    trained.append(futs[fut].run_id)
                    bar.update()
        finally:
            if flags is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = flags
    bar.close()
    evals, steps = ablation.collect(runs_dir, runs)
    paths = {"results": os.path.join(out, "results.csv"), "steps": os.path.join(out, "steps.csv")}
    evals.to_csv(paths["results"], index=False)
    steps.to_csv(paths["steps"], index=False)
    plot_dir = os.path.join(out, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    paths["plots"] = []
    lines = [f"# {grid.name}: final held-out pass@1 (mean over seeds, 95% t-interval)\n"]
    for block in dict.fromkeys(r.block for r in runs):
        ev = evals[evals.block == block] if not evals.empty else evals
        if ev.empty:
            continue
        axes = [a for a, _ in next(r for r in runs if r.block == block).values if a != "seed"]
        table = ablation.summarize(ev, axes)
        lines += [f"## {block}\n", ablation.to_markdown(table), ""]
        if "method" in axes and "seed" in ev and "grpo" in set(ev.method):  # paired by seed
            others = [a for a in axes if a != "method"]
            diffs = [
                ablation.paired_difference(ev, others or ["block"], "method", m, "grpo").assign(
                    method=f"{m} - grpo"
                )
                for m in dict.fromkeys(ev.method)
                if m != "grpo"
            ]
            table = pd.concat(diffs)[
                ["method", *(others or []), "seeds", "diff", "ci_low", "ci_high"]
            ]
            lines += [
                f"Paired by seed, final pass@1 minus GRPO's ({block}):\n",
                ablation.to_markdown(table),
                "",
            ]
        paths["plots"] += plots.plot_block(evals, steps, block, plot_dir)
    paths["summary"] = os.path.join(out, "summary.md")
    with open(paths["summary"], "w") as f:
        f.write("\n".join(lines))
    log("\n".join(lines))
    log(f"{len(trained)} runs trained in {time.time() - t0:.0f} s; results: {paths['results']}")
    return {**paths, "runs": [r.run_id for r in runs], "trained": trained}


def main(argv):
    del argv
    if _CONFIG.value is None:
        sys.exit("give a grid: --config=configs/ablations/<grid>.py (see configs/ablations/)")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    run_grid(
        _CONFIG.value, workers=_WORKERS.value, dry_run=_DRY_RUN.value, plots_only=_PLOTS_ONLY.value
    )


if __name__ == "__main__":
    from ebpo_jax.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
