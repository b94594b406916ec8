"""Ablation grids: expansion, config errors, result tables, and a micro grid end to end."""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pandas as pd
import pytest
from conftest import load_experiment
from scipy import stats

from ebpo_jax import ablation
from ebpo_jax.ablation import executor, runner, tables
from ebpo_jax.ablation import grid as grid_lib
from ebpo_jax.ablation import rerun as rerun_lib
from ebpo_jax.ablation.results import interval95
from ebpo_jax.schema import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grid(**block):
    c = ml_collections.ConfigDict()
    c.name, c.base_config, c.out_dir = "g", "configs/micro.py", "/tmp/unused"
    c.fixed = {"total_steps": 2, "optimizer": {"learning_rate": 1e-3}}
    c.blocks = [{"name": "b", **block}]
    return c


def test_expand_equal_budget_and_overrides():
    runs = ablation.expand(
        _grid(
            axes={"method": ["grpo", "ebpo"], "group_size": [2, 8], "seed": [0, 1]},
            rollouts_per_step=16,
        )
    )
    assert len(runs) == 8 and len({r.run_id for r in runs}) == 8
    for r in runs:
        over = dict(r.overrides)
        assert over["prompts_per_step"] * over["group_size"] == 16
        assert over["optimizer.learning_rate"] == 1e-3
        assert over["estimator"] == r.value("method")
    base = grid_lib.load_config_file("configs/micro.py")
    cfg = ablation.run_config(base, runs[-1], "/tmp/x")
    assert (cfg.estimator, cfg.group_size, cfg.prompts_per_step, cfg.seed) == ("ebpo", 8, 2, 1)
    assert cfg.workdir == "/tmp/x" and base.workdir != "/tmp/x"  # the base is not modified


def test_dispatch_is_seed_major_and_round_robin_over_warm_starts():
    axes = {"sft.seed": [7, 8], "seed": [0, 1], "order": ["naive", "difficulty"]}
    got = [
        (r.value("seed"), r.value("sft.seed"), r.value("order"))
        for r in runner.dispatch_order(ablation.expand(_grid(axes=axes)))
    ]
    assert got == [
        (0, 7, "naive"),
        (0, 8, "naive"),
        (0, 7, "difficulty"),
        (0, 8, "difficulty"),
        (1, 7, "naive"),
        (1, 8, "naive"),
        (1, 7, "difficulty"),
        (1, 8, "difficulty"),
    ]  # neighbours never share a warm start
    plain = ablation.expand(_grid(axes={"method": ["grpo", "ebpo"], "seed": [0, 1]}))
    assert [r.run_id for r in runner.dispatch_order(plain)] == [
        r.run_id for r in sorted(plain, key=lambda r: r.value("seed"))
    ]  # no warm-start axis: seed-major in the grid's order


def test_methods_set_their_options():
    runs = ablation.expand(_grid(axes={"method": ["ebpo_per_batch", "dapo", "dr_grpo"]}))
    base = grid_lib.load_config_file("configs/micro.py")
    per_batch, dapo, dr = (ablation.run_config(base, r, "/tmp/x") for r in runs)
    assert per_batch.estimator_options.per_batch is True
    assert dapo.dapo.dynamic_sampling and dapo.loss.clip_high == 0.28
    assert dr.loss.agg == "seq-mean-token-sum-norm"


def test_grid_errors_name_the_fault():
    with pytest.raises(ConfigError, match="method='gpro' unknown"):
        ablation.expand(_grid(axes={"method": ["gpro"]}))
    with pytest.raises(ConfigError, match="rollouts_per_step=10 needs a group_size"):
        ablation.expand(_grid(axes={"group_size": [4]}, rollouts_per_step=10))
    run = ablation.expand(_grid(axes={"optimizer.learnin_rate": [1.0]}))[0]
    with pytest.raises(ConfigError, match="optimizer.learnin_rate"):
        ablation.run_config(grid_lib.load_config_file("configs/micro.py"), run, "/tmp/x")
    with pytest.raises(ConfigError, match="no_such.py"):
        grid_lib.load_config_file("configs/no_such.py")


def test_summarize_matches_brute_force_t_interval():
    rng = np.random.default_rng(0)
    rows = []
    for method in ("a", "b"):
        for seed in range(4):
            rid = f"{method}{seed}"
            rows.append(
                {
                    "block": "x",
                    "run_id": rid,
                    "method": method,
                    "seed": seed,
                    "step": 0,
                    "pass@1": 0.2,
                    "generated_tokens": 0.0,
                }
            )
            rows.append(
                {
                    "block": "x",
                    "run_id": rid,
                    "method": method,
                    "seed": seed,
                    "step": 10,
                    "pass@1": rng.uniform(),
                    "generated_tokens": 100.0,
                }
            )
    evals = pd.DataFrame(rows)
    summ = ablation.summarize(evals, ["method"]).set_index("method")
    for method in ("a", "b"):
        x = evals[(evals.method == method) & (evals.step == 10)]["pass@1"].to_numpy()
        lo, hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
        assert summ.loc[method, "pass@1"] == pytest.approx(x.mean())
        assert (summ.loc[method, "ci_low"], summ.loc[method, "ci_high"]) == pytest.approx((lo, hi))
        assert summ.loc[method, "gain"] == pytest.approx(x.mean() - 0.2)
    diff = ablation.paired_difference(evals, ["block"], "method", "a", "b")
    fa = evals[(evals.method == "a") & (evals.step == 10)]["pass@1"].to_numpy()
    fb = evals[(evals.method == "b") & (evals.step == 10)]["pass@1"].to_numpy()
    assert diff["diff"].iloc[0] == pytest.approx((fa - fb).mean())


def test_ablate_script_only_parses_flags():
    """experiments/ablate.py is flags and main; the grid logic lives in ebpo_jax.ablation."""
    ablate = load_experiment("ablate")
    assert callable(ablate.main) and not hasattr(ablate, "run_grid")


def test_ablate_refuses_ray_flags_without_the_ray_executor():
    script = os.path.join(REPO, "experiments", "ablate.py")
    args = ["--config=configs/ablations/micro.py", "--slice=v5p-64", "--dry_run"]
    out = subprocess.run(
        [sys.executable, script, *args], check=False, capture_output=True, cwd=REPO
    )
    last = out.stderr.decode().splitlines()[-1]
    assert out.returncode != 0 and "--slice needs --executor=ray" in last


def test_micro_grid_end_to_end_and_resume(tmp_path):
    """Two micro runs train, results.csv and plots appear; a second call trains nothing."""
    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(tmp_path / "grid")
    grid.blocks = [
        {
            "name": "main",
            "axes": {"method": ["grpo", "ebpo"], "group_size": [2]},
            "rollouts_per_step": 8,
            "fixed": {"mesh.devices": 1},  # one of the test process's 8 fake devices
        }
    ]
    out = runner.run_grid(grid, log=lambda *_: None)
    assert sorted(out["trained"]) == sorted(out["runs"]) and len(out["runs"]) == 2
    evals = pd.read_csv(out["results"])
    assert len(evals) == 4 and sorted(evals.step.unique()) == [0, 2]  # start + final eval
    assert set(evals.method) == {"grpo", "ebpo"} and (evals.prompts_per_step == 4).all()
    final = evals[evals.step == 2]
    assert (final.generated_tokens > 0).all() and final["actor/entropy"].notna().all()
    assert len(pd.read_csv(out["steps"])) == 4  # 2 runs x 2 steps
    assert out["plots"] and all(os.path.getsize(p) > 1000 for p in out["plots"])
    with open(out["summary"]) as f:
        text = f.read()
    assert "| grpo |" in text and "Paired by problem" in text
    # The final evaluation per problem: its pass rate over problems is the run's pass@1.
    problems = pd.read_csv(out["problems"])
    assert len(problems) == 2 * 16 and (problems.correct <= problems.samples).all()
    assert set(problems.columns) >= {"run_id", "problem_id", "topic", "difficulty", "correct"}
    rate = problems.groupby("run_id").correct.sum() / problems.groupby("run_id").samples.sum()
    np.testing.assert_allclose(rate[final.run_id], final["pass@1"], rtol=1e-12)
    assert final.warm_start_sha256.str.len().eq(64).all()  # the initial policy's digest
    again = runner.run_grid(grid, log=lambda *_: None)
    assert again["trained"] == []
    pd.testing.assert_frame_equal(pd.read_csv(again["results"]), evals)
    # Another grid with the same runs adopts them instead of training, with the same rows.
    other = ml_collections.ConfigDict(grid.to_dict())
    other.out_dir, other.reuse = str(tmp_path / "other"), [grid.out_dir]
    adopted = runner.run_grid(other, log=lambda *_: None)
    assert adopted["trained"] == []
    pd.testing.assert_frame_equal(pd.read_csv(adopted["results"]), evals)
    # A fresh clone has the committed tables but no runs/: recorded runs stay finished.
    steps = pd.read_csv(out["steps"])
    shutil.rmtree(os.path.join(grid.out_dir, "runs"))
    recorded = runner.run_grid(grid, log=lambda *_: None)
    assert recorded["trained"] == []
    pd.testing.assert_frame_equal(pd.read_csv(recorded["results"]), evals)
    pd.testing.assert_frame_equal(pd.read_csv(recorded["steps"]), steps)
    # Runs recorded short of their last step train again, here only those --only matches;
    # the other keeps its recorded rows.
    evals[evals.step == 0].to_csv(out["results"], index=False)
    partial = runner.run_grid(grid, select=runner.Selection(only="grpo"), log=lambda *_: None)
    assert partial["trained"] == [r for r in out["runs"] if "grpo" in r]
    expected = evals[(evals.method == "grpo") | (evals.step == 0)].reset_index(drop=True)
    pd.testing.assert_frame_equal(pd.read_csv(partial["results"]), expected)
    # A run killed before its first checkpoint (metrics, no checkpoint) starts over.
    killed = os.path.join(grid.out_dir, "runs", partial["trained"][0])
    os.remove(os.path.join(killed, "summary.json"))
    shutil.rmtree(os.path.join(killed, "checkpoints"))
    lines = []
    again = runner.run_grid(grid, select=runner.Selection(only="grpo"), log=lines.append)
    assert again["trained"] == partial["trained"]
    assert any("starts over" in line for line in lines)
    pd.testing.assert_frame_equal(pd.read_csv(again["results"]), expected)


def test_reuse_adopts_only_the_same_config(tmp_path):
    from ebpo_jax.ablation import reuse

    src = tmp_path / "a" / "runs" / "r0"
    src.mkdir(parents=True)
    saved = {"seed": 0, "workdir": str(src), "optimizer": {"learning_rate": 1e-3}}
    (src / "config.json").write_text(json.dumps(saved))
    (src / "summary.json").write_text("{}")
    (src / "metrics.jsonl").write_text('{"step": 1}\n')
    runs_dir = tmp_path / "b" / "runs"
    configs = {  # neither the workdir nor `restart` changes what a run computes
        "same": {**saved, "workdir": str(runs_dir / "same"), "restart": True},
        "other_seed": {**saved, "seed": 1},
        "other_lr": {**saved, "optimizer": {"learning_rate": 2e-3}},
    }
    assert reuse.adopt(configs, str(runs_dir), [str(tmp_path / "a")], log=lambda *_: None) == [
        "same"
    ]
    assert (runs_dir / "same" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (runs_dir / "same" / reuse.MARKER).read_text().strip() == str(src)
    assert not (runs_dir / "other_seed").exists() and not (runs_dir / "other_lr").exists()
    # A source without a summary (unfinished) is never adopted.
    (src / "summary.json").unlink()
    assert reuse.adopt({"x": saved}, str(runs_dir), [str(tmp_path / "a")]) == []


def _pilot_evals(diffs_by_setting, base=0.3):
    """Final-eval rows of a pilot: ebpo = grpo + diff per seed, per group size."""
    rows = []
    for g, diffs in diffs_by_setting.items():
        for seed, d in enumerate(diffs):
            for method, value in (("grpo", base + 0.01 * seed), ("ebpo", base + 0.01 * seed + d)):
                rid = f"b__method-{method}__group_size-{g}__seed-{seed}"
                for step, p in ((0, 0.2), (10, value)):
                    rows.append(
                        {
                            "block": "b",
                            "run_id": rid,
                            "method": method,
                            "group_size": g,
                            "seed": seed,
                            "step": step,
                            "pass@1": p,
                            "generated_tokens": 0.0,
                        }
                    )
    return pd.DataFrame(rows)


def test_power_analysis_chooses_seeds_from_the_pilot():
    grid = _grid(axes={"method": ["grpo", "ebpo"], "group_size": [2, 4], "seed": [0, 1, 2]})
    pilot = ablation.with_seeds(grid, range(4))
    runs = ablation.expand(pilot)
    assert len(runs) == 16 and {r.value("seed") for r in runs} == {0, 1, 2, 3}
    assert ablation.with_seeds(_grid(axes={"method": ["grpo"]}), [5]).blocks[0]["axes"]["seed"] == [
        5
    ]
    diffs = {2: [0.03, 0.0, 0.05, 0.02], 4: [0.01, 0.02, 0.0, 0.03]}
    evals = _pilot_evals(diffs)
    from ebpo_jax.ablation import power

    analysis = power.PowerAnalysis(effect=0.02, power=0.8, pilot_seeds=4, max_seeds=100)
    out = tables.choose_seeds(evals, runs, analysis, alpha=0.05, log=lambda *_: None)
    want = max(power.seeds_needed(0.02, np.std(d, ddof=1)) for d in diffs.values())
    assert out["seeds_needed"] == out["seeds"] == want
    assert [c["pilot_sd"] for c in out["claims"]] == pytest.approx(
        [np.std(d, ddof=1) for d in diffs.values()]
    )
    capped = tables.choose_seeds(
        evals, runs, analysis._replace(max_seeds=5), alpha=0.05, log=lambda *_: None
    )
    assert capped["seeds"] == 5 and capped["power_at_seeds"] < 0.8
    table = tables.comparisons(evals, runs)
    assert list(table.method) == ["ebpo - grpo"] * 2 and (table.direction == 1).all()
    np.testing.assert_allclose(table.p_holm, power.holm(table.p))
    for g, d in diffs.items():
        row = table[table.group_size == g].iloc[0]
        assert row["p"] == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue)


def test_compare_rows_exact_and_with_tolerance():
    old = pd.DataFrame({"step": [0, 10], "pass@1": [0.2, 0.3], "reward/mean": [np.nan, 0.25]})
    assert rerun_lib.compare_rows(old, old.copy())["match"]
    new = old.assign(**{"pass@1": [0.2, 0.3 + 1e-6]})
    assert not rerun_lib.compare_rows(old, new)["match"]
    assert rerun_lib.compare_rows(old, new, atol=1e-5)["match"]
    assert not rerun_lib.compare_rows(old, new.assign(**{"reward/mean": [np.nan, np.nan]}))["match"]
    assert not rerun_lib.compare_rows(old, old.iloc[:1])["match"]


@pytest.mark.slow
def test_power_pilot_then_rerun_micro(tmp_path):
    """A 2-seed pilot picks the seed count, the grid trains it, a rerun matches bitwise."""
    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(tmp_path / "grid")
    grid.blocks = [
        {
            "name": "main",
            "axes": {"method": ["grpo", "ebpo"], "group_size": [2]},
            "rollouts_per_step": 8,
            "fixed": {"mesh.devices": 1},
        }
    ]
    analysis = runner.PowerAnalysis(effect=0.5, pilot_seeds=2, max_seeds=3)
    out = runner.run_grid(grid, analysis=analysis, log=lambda *_: None)
    assert out["power"]["seeds"] in (2, 3) and len(out["runs"]) == 2 * out["power"]["seeds"]
    assert os.path.exists(os.path.join(grid.out_dir, "power.json"))
    evals = pd.read_csv(out["results"])
    assert (evals.jaxlib.astype(str).str.len() > 0).all() and evals.machine.notna().all()
    with open(out["summary"]) as f:
        text = f.read()
    assert "ebpo - grpo" in text and "verdict_holm" in text
    report = rerun_lib.rerun(grid, out["runs"][1], log=lambda *_: None)
    assert report["match"], report
    with open(os.path.join(grid.out_dir, "rerun", out["runs"][1] + ".json")) as f:
        assert json.load(f)["match"]


@pytest.mark.parametrize("part", ["pilot", "group_size", "g16", "variants", "curriculum"])
def test_reasoning_grids_expand_to_valid_configs(part):
    from ebpo_jax.config import validate

    spec = importlib.util.spec_from_file_location(
        "reasoning_grid", os.path.join(REPO, "configs", "ablations", "reasoning.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    grid = module.get_config(part)
    base = grid_lib.load_config_file(grid.base_config)
    runs = ablation.expand(grid)
    for run in runs:
        cfg = ablation.run_config(base, run, "/tmp/x")
        validate(cfg)
        assert cfg.task.family == "reasoning" and cfg.total_steps == 200
        assert cfg.prompts_per_step * cfg.group_size == 128
    assert all(os.path.basename(r).startswith("reasoning_") for r in grid.reuse)
    assert grid.out_dir not in grid.reuse
    with pytest.raises(ValueError, match="part must be one of"):
        module.get_config("nope")


def test_provenance_reads_the_cpu_model(tmp_path):
    from ebpo_jax.ablation import provenance

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Fancy CPU @ 3GHz\n")
    assert provenance.cpu_model(str(info)) == "Fancy CPU @ 3GHz"
    prov = provenance.provenance()
    assert set(prov) == set(provenance.PROCESS) and prov["jaxlib"] and prov["machine"]
    assert provenance.cpu_family("AMD EPYC") == "amd" != provenance.cpu_family("Intel(R) Xeon")


def test_provenance_names_the_code(tmp_path):
    from ebpo_jax.ablation import provenance

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    before = provenance.source_sha256(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still not code")
    assert provenance.source_sha256(str(tmp_path)) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert provenance.source_sha256(str(tmp_path)) != before
    code = provenance.code_version()
    assert len(code["code_sha256"]) == 64
    repo = pathlib.Path(provenance.__file__).parents[2]
    if (repo / ".git").exists():  # a checkout: the commit, marked when the package differs
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", code["code"]), code


def test_plot_axes_ignore_provenance():
    from ebpo_jax.ablation import plots

    df = pd.DataFrame(
        {
            "block": "b",
            "method": ["grpo", "ebpo", "grpo", "ebpo"],
            "group_size": [4, 4, 8, 8],
            "seed": [0, 0, 0, 0],
            "xla_flags": ["", "--a", "", "--a"],  # adopted runs may differ here
            "jaxlib": "0.10.2",
        }
    )
    assert plots._axes_of(df) == (["method"], "group_size")


def test_plots_average_warm_starts_and_interval_over_their_means(tmp_path):
    from ebpo_jax.ablation import plots

    rng = np.random.default_rng(0)
    rows = [
        {"block": "g", "run_id": f"{m}{g}{w}{s}", "method": m, "group_size": g, "sft.seed": w,
         "seed": s, "step": 10, "pass@1": rng.uniform(0.1, 0.3), "generated_tokens": 1}
        for m in ("grpo", "ebpo") for g in (2, 4) for w in (100, 101, 102) for s in (0, 1)
    ]  # fmt: skip
    df = pd.DataFrame(rows)
    assert plots._axes_of(df) == (["method"], "group_size")  # one line per method
    levels, over = plots._final_levels(df, ["method", "group_size"])
    cell = df[(df.method == "ebpo") & (df.group_size == 4)]
    means = cell.groupby("sft.seed")["pass@1"].mean().to_numpy()
    half = stats.t.ppf(0.975, 2) * means.std(ddof=1) / np.sqrt(3)
    got = levels.set_index(["method", "group_size"]).loc[("ebpo", 4)]
    assert over == "warm starts"
    np.testing.assert_allclose(
        got[["pass@1", "ci_low", "ci_high"]].to_numpy(float),
        [means.mean(), means.mean() - half, means.mean() + half],
    )
    assert plots._final_levels(df[df["sft.seed"] == 100], ["method"])[1] == "seeds"
    # A cell with one warm start (beside cells with three): its interval is over its runs.
    mixed = df[(df.group_size == 4) | (df["sft.seed"] == 100)]
    levels, over = plots._final_levels(mixed, ["method", "group_size"])
    runs = mixed[(mixed.method == "grpo") & (mixed.group_size == 2)]["pass@1"]
    got = levels.set_index(["method", "group_size"]).loc[("grpo", 2), "ci_high"]
    assert over == "warm starts or seeds" and got == pytest.approx(interval95(runs)[2])
    paths = plots.plot_block(df, pd.DataFrame({"block": []}), "g", str(tmp_path))  # no steps
    assert [os.path.basename(p) for p in paths] == [
        "g_pass1_vs_step.png", "g_pass1_vs_tokens.png", "g_final_vs_G.png"
    ] and all(os.path.exists(p) for p in paths)  # fmt: skip


def test_only_finished_runs_are_collected(tmp_path):
    """A run without its summary.json (still training, or killed) gives no rows: its last
    eval would read as its final pass@1."""
    runs = ablation.expand(
        ml_collections.ConfigDict(
            {"blocks": [{"name": "b", "axes": {"seed": [0, 1]}}], "base": {}, "out_dir": ""}
        )
    )
    for run in runs:
        (tmp_path / run.run_id).mkdir()
        rows = [{"step": 0, "eval/pass@1": 0.1}, {"step": 50, "eval/pass@1": 0.2}]
        (tmp_path / run.run_id / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    (tmp_path / runs[0].run_id / "summary.json").write_text("{}")
    evals, _ = ablation.results.collect(str(tmp_path), runs)
    assert list(evals.run_id.unique()) == [runs[0].run_id] and len(evals) == 2


def test_committed_results_count_as_finished_runs():
    """A fresh clone (no runs/) sees the committed reasoning group-size runs as done; --seeds
    lists more seeds to train."""
    spec = importlib.util.spec_from_file_location(
        "reasoning_grid", os.path.join(REPO, "configs", "ablations", "reasoning.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    grid = module.get_config("group_size")
    grid.out_dir = os.path.join(REPO, grid.out_dir)
    grid.blocks = [  # one of the test process's 8 fake devices
        {**b, "fixed": {**b.get("fixed", {}), "mesh.devices": 1}} for b in grid.blocks
    ]
    lines = []
    out = runner.run_grid(grid, select=runner.Selection(seeds=6, dry_run=True), log=lines.append)
    assert len(out["runs"]) == 6 * (15 + 2)  # 5 methods x 3 G + the dapo block's 2, 6 seeds
    done = {line.split()[1] for line in lines if line.strip().startswith("done")}
    assert {r for r in out["runs"] if int(r.rsplit("-", 1)[1]) < 4} <= done
    with pytest.raises(ValueError, match="--only='nope': matches none of the grid's 102"):
        runner.run_grid(grid, select=runner.Selection(seeds=6, only="nope"), log=lines.append)
    with pytest.raises(ValueError, match=r"--only='\(': not a regex"):
        runner.run_grid(grid, select=runner.Selection(seeds=6, only="("), log=lines.append)
    with pytest.raises(ValueError, match="--seeds=3: .* not with --power_effect"):
        analysis = runner.PowerAnalysis(effect=0.02)
        runner.run_grid(
            grid,
            select=runner.Selection(seeds=3, dry_run=True),
            analysis=analysis,
            log=lines.append,
        )


def test_a_signal_that_stops_a_run_stops_the_grid(monkeypatch):
    """In one process the trainer takes the grid's SIGTERM: its run stops at a checkpoint,
    and the grid must stop there too instead of starting the next run."""
    started = []

    def stopped_run(config_json, cache_dir, stamp):
        started.append(config_json)
        return {"stopped_early": True, "step": 7}

    monkeypatch.setattr(executor, "train_run", stopped_run)
    jobs = [executor.Job(f"run-{i}", json.dumps({"id": i})) for i in range(2)]
    bar = types.SimpleNamespace(set_postfix_str=lambda _: None, update=lambda: None)
    progress = executor.Progress(bar, total=2, done=0, log=lambda *_: None)
    with pytest.raises(executor.GridStopped, match="run-0 at step 7"):
        executor.LocalPool(1).train(jobs, "", {}, progress)
    assert len(started) == 1
