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
Executors: `--executor=local` (this machine, `--workers` processes) or `--executor=ray
[--ray_address=auto|ray://host:10001] [--ray_cpus=N --ray_gpus=N | --slice=v5p-64]`: each run
a Ray task, retried up to `--retries` times from its checkpoint when its task dies
(ebpo_jax/ablation/ray_executor.py; docs/pods.md, "Grids on a cluster").
"""

import sys

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
_EXECUTOR = flags.DEFINE_enum(
    "executor", "local", ["local", "ray"], "Where runs train: this machine's pool, or Ray."
)
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "", "Ray cluster: '' starts one here, 'auto' joins it, or ray://host:10001."
)
_RAY_CPUS = flags.DEFINE_float("ray_cpus", 1.0, "CPUs per run's task (--executor=ray).")
_RAY_GPUS = flags.DEFINE_float("ray_gpus", 0.0, "GPUs per run's task (--executor=ray).")
_SLICE = flags.DEFINE_string(
    "slice", "", "TPU slice type per run, e.g. v5p-64: one task per host (--executor=ray)."
)
_SLICES = flags.DEFINE_integer("slices", 1, "TPU slices used at once (--executor=ray --slice).")
_RETRIES = flags.DEFINE_integer("retries", 3, "Retries of a run whose task died (Ray).")
_RERUN = flags.DEFINE_string("rerun", "", "Retrain this run id and compare with results.csv.")
_RERUN_ATOL = flags.DEFINE_float("rerun_atol", 0.0, "Tolerance of --rerun (0 = bitwise).")


def main(argv):
    del argv
    if _CONFIG.value is None:
        sys.exit("give a grid: --config=configs/ablations/<grid>.py (see configs/ablations/)")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    from ebpo_jax.ablation import rerun, runner
    from ebpo_jax.ablation.executor import GridStopped, LocalPool

    if _RERUN.value:
        report = rerun.rerun(_CONFIG.value, _RERUN.value, atol=_RERUN_ATOL.value)
        sys.exit(0 if report["match"] or "inside" in report["verdict"] else 1)
    analysis = runner.PowerAnalysis(
        _POWER_EFFECT.value, _POWER.value, _PILOT.value, _MAX_SEEDS.value
    )
    executor = _executor(LocalPool)
    try:
        runner.run_grid(
            _CONFIG.value,
            executor=executor,
            select=runner.Selection(_SEEDS.value, _ONLY.value, _DRY_RUN.value, _PLOTS_ONLY.value),
            analysis=analysis,
            alpha=_ALPHA.value,
        )
    except GridStopped as e:
        sys.exit(f"stopped: {e}")
    finally:
        executor.close()


def _executor(local):
    """The executor the flags ask for."""
    if _EXECUTOR.value == "local":
        names = ("ray_address", "ray_cpus", "ray_gpus", "slice", "slices", "retries")
        given = [n for n in names if flags.FLAGS[n].present]
        if given:
            sys.exit(f"--{given[0]} needs --executor=ray")
        return local(_WORKERS.value)
    from ebpo_jax.ablation import ray_executor

    resources = ray_executor.RayResources(_RAY_CPUS.value, _RAY_GPUS.value, _SLICE.value)
    return ray_executor.RayExecutor(_RAY_ADDRESS.value, resources, _RETRIES.value, _SLICES.value)


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
