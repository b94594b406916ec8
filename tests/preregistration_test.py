"""Claims that survive a reviewer: pre-registration by hash and git, the two-level interval
across warm starts, equal-token and best-rate claims, content-addressed warm starts, the
cross-family rerun verdict, per-problem pairing and the validation split."""

import functools
import os
import subprocess

import numpy as np
import pandas as pd
import pytest
from conftest import load_experiment
from scipy import stats

from ebpo_jax.ablation import registration, reproduce, runner, twolevel
from ebpo_jax.ablation import rerun as rerun_lib
from ebpo_jax.ablation.results import paired_by_problem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _experiment(name: str):
    return load_experiment(name)


def _git(repo, *args, date="2026-01-01T00:00:00"):
    env = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    subprocess.run(cmd, check=True, capture_output=True, env=env)


# --- two-level interval --------------------------------------------------------------


def test_twolevel_matches_the_balanced_anova_by_hand():
    rng = np.random.default_rng(0)
    d_wn = 0.01 + rng.normal(0, 0.02, (5, 1)) + rng.normal(0, 0.005, (5, 3))
    warm = np.repeat(np.arange(5), 3)
    out = twolevel.interval(d_wn.ravel(), warm)
    big_w, n = d_wn.shape
    grand = d_wn.mean()
    ms_between = n * ((d_wn.mean(1) - grand) ** 2).sum() / (big_w - 1)
    ms_within = ((d_wn - d_wn.mean(1, keepdims=True)) ** 2).sum() / (big_w * (n - 1))
    se = np.sqrt(ms_between / (big_w * n))
    half = stats.t.ppf(0.975, big_w - 1) * se
    assert out["diff"] == pytest.approx(grand)
    assert out["ci_high"] - out["diff"] == pytest.approx(half)
    assert out["p"] == pytest.approx(2 * stats.t.sf(abs(grand) / se, big_w - 1))
    assert out["sigma"] == pytest.approx(np.sqrt(ms_within))
    assert out["tau"] == pytest.approx(np.sqrt(max((ms_between - ms_within) / n, 0)))
    assert out["warm_starts"] == 5 and out["seeds"] == 15


def test_twolevel_covers_95pct_where_pooled_pairs_do_not():
    """Simulated two-level data (warm-start sd 4x the seed sd): the two-level interval
    covers mu ~95% of the time, the paired t over all pairs far less."""
    rng = np.random.default_rng(1)
    reps, big_w, n, mu = 600, 5, 3, 0.01
    d = mu + rng.normal(0, 0.02, (reps, big_w, 1)) + rng.normal(0, 0.005, (reps, big_w, n))
    warm = np.repeat(np.arange(big_w), n)
    intervals = [twolevel.interval(x.ravel(), warm) for x in d]
    hits = [o["ci_low"] <= mu <= o["ci_high"] for o in intervals]
    flat = d.reshape(reps, -1)
    half = stats.t.ppf(0.975, flat.shape[1] - 1) * flat.std(1, ddof=1) / np.sqrt(flat.shape[1])
    pooled = np.abs(flat.mean(1) - mu) <= half
    assert 0.92 <= np.mean(hits) <= 0.98, np.mean(hits)
    assert pooled.mean() < 0.8, pooled.mean()


# --- pre-registration ------------------------------------------------------------------


def test_claims_file_must_be_committed_and_status_reads_hashes(tmp_path):
    path = tmp_path / "claims.py"
    path.write_text("CLAIMS = []\n")
    _git(tmp_path, "init", "-q")
    with pytest.raises(ValueError, match="not committed"):
        registration.committed(str(path))
    _git(tmp_path, "add", "claims.py")
    _git(tmp_path, "commit", "-qm", "claims")
    assert len(registration.committed(str(path))) == 40
    sha = registration.file_sha256(str(path))
    grid = {"name": "g", "claims_file": str(path)}
    assert runner.claims_stamp(_Cfg(grid)) == {"claims_sha256": sha}
    path.write_text("CLAIMS = ['changed']\n")
    with pytest.raises(ValueError, match="not committed"):
        runner.claims_stamp(_Cfg(grid))
    assert registration.status([sha, sha], sha) == registration.PRE
    assert registration.status([sha, "other"], sha) == registration.POST_CHANGED
    assert registration.status([sha, float("nan")], sha) == registration.PARTIAL
    assert registration.status(["", None], sha, lambda: "git says") == "git says"


class _Cfg(dict):
    def get(self, k, default=None):
        return super().get(k, default)

    def __getattr__(self, k):
        return self[k]


def test_git_history_orders_claim_and_results(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "claims.py").write_text("# early claim\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "a", date="2026-01-01T00:00:00")
    (tmp_path / "results.csv").write_text("x\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "b", date="2026-01-02T00:00:00")
    (tmp_path / "claims.py").write_text("# early claim\n# late claim\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "c", date="2026-01-03T00:00:00")
    hist = functools.partial(registration.git_history, str(tmp_path), "claims.py")
    assert hist("early claim", ["results.csv"]) == registration.BEFORE_GIT
    assert hist("late claim", ["results.csv"]) == registration.POST_GIT
    assert hist("never written", ["results.csv"]) == registration.UNKNOWN


# --- claims: warm starts, best rate, equal tokens ---------------------------------------


def _evals(cells: dict, tokens: dict) -> pd.DataFrame:
    """Eval rows at steps 0, 1, 2: cells[(method, lr, w, s)] = (pass@1 at 1, at 2, val)."""
    rows = []
    for (m, lr, w, s), (p1, p2, val) in cells.items():
        for step, p in ((0, 0.1), (1, p1), (2, p2)):
            rows.append({"run_id": f"{m}{lr}{w}{s}", "method": m, "lr": lr, "sft.seed": w,
                         "seed": s, "step": step, "generated_tokens": step * tokens[m],
                         "pass@1": p, "val_pass@1": val})  # fmt: skip
    return pd.DataFrame(rows)


def test_claims_pick_each_methods_best_rate_and_pair_across_warm_starts():
    c = _experiment("claims")
    rng = np.random.default_rng(2)
    cells = {}
    for w in range(3):
        for s in range(2):
            for m, best in (("ebpo", 1e-4), ("grpo", 1e-5)):
                for lr in (1e-5, 1e-4):
                    val = 0.5 if lr == best else 0.1
                    cells[(m, lr, w, s)] = (rng.uniform(), rng.uniform(), val)
    evals = _evals(cells, {"ebpo": 100.0, "grpo": 300.0})
    claim = {"claim": "x", "direction": 1, "plus": [("p", {"method": "ebpo"})],
             "minus": [("p", {"method": "grpo"})], "select": {"axis": "lr", "by": "val_pass@1"}}  # fmt: skip
    row = c.claims_table([claim], lambda p: evals).iloc[0]
    d = np.array([cells[("ebpo", 1e-4, w, s)][1] - cells[("grpo", 1e-5, w, s)][1]
                  for w in range(3) for s in range(2)])  # fmt: skip
    ref = twolevel.interval(d, np.repeat(np.arange(3), 2))
    assert row["diff"] == pytest.approx(ref["diff"]) and row.warm_starts == 3
    assert row.ci_low == pytest.approx(ref["ci_low"]) and row.seeds == 6
    assert row.one_diff == pytest.approx(d[:2].mean()) and row.one_seeds == 2
    # Equal tokens: GRPO's final 600 tokens vs EBPO's 200: GRPO read at 200 = its step-1 eval
    # (tokens 300 at step 1: 2/3 of the way from step 0's 0.1 to step 1's value).
    tok = [cells[("ebpo", 1e-4, w, s)][1] - (0.1 + (cells[("grpo", 1e-5, w, s)][0] - 0.1) * 2 / 3)
           for w in range(3) for s in range(2)]  # fmt: skip
    assert row.tok_diff == pytest.approx(np.mean(tok)) and row.token_ratio == pytest.approx(3.0)
    text = c.render(c.claims_table([claim], lambda p: evals))
    assert "| warm starts | one warm start: effect |" in text and "equal tokens" in text


def test_robust_claims_name_columns_of_their_grids():
    from ebpo_jax.ablation import expand

    c = _experiment("claims")
    module = c.load_module("configs/ablations/robust_claims.py")
    for claim in module.CLAIMS:
        for part, where in claim["plus"] + claim["minus"]:
            runs = expand(module.get_config(part))
            vals = [{"block": r.block, **{a: str(v) for a, v in r.values}} for r in runs]
            assert any(all(v.get(k) == str(x) for k, x in where.items()) for v in vals), claim


# --- warm starts, reruns, problems, validation ---------------------------------------------


def test_warm_start_digest_export_and_refusal(tmp_path):
    import ml_collections

    from ebpo_jax.tasks import sft

    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    digest = sft.params_digest(params)
    assert digest == sft.params_digest({k: v.copy() for k, v in params.items()})
    assert digest != sft.params_digest({**params, "b": np.ones(3, np.float64)})
    path = sft.export(params, str(tmp_path))
    assert os.path.basename(path) == f"{digest}.npz"
    back = sft.load_file(path, params)
    assert sft.params_digest(back) == digest
    os.replace(path, tmp_path / f"{'0' * 64}.npz")
    with pytest.raises(ValueError, match="hash to"):
        sft.load_file(str(tmp_path / f"{'0' * 64}.npz"), params)

    class Spec:
        sft = ml_collections.FrozenConfigDict({"params_sha256": "f" * 64, "export_dir": ""})

    with pytest.raises(ValueError, match="start from the committed sft.params_file"):
        sft.check_digest(Spec, params)


def test_seed_band_and_rerun_verdicts():
    finals = pd.DataFrame({"method": ["ebpo"] * 4 + ["grpo"] * 4, "seed": list(range(4)) * 2,
                           "pass@1": [0.20, 0.21, 0.19, 0.22, 0.1, 0.1, 0.1, 0.1]})  # fmt: skip
    band = reproduce.seed_band(finals, {"method": "ebpo"})
    x = np.array([0.20, 0.21, 0.19, 0.22])
    half = stats.t.ppf(0.975, 3) * x.std(ddof=1) * np.sqrt(1 + 1 / 4)
    assert band["low"] == pytest.approx(x.mean() - half) and band["seeds"] == 4
    v = functools.partial(reproduce.verdict, band=band)
    assert v(True, "AMD EPYC", "AMD EPYC 9B14", final=0.2) == "bitwise"
    assert v(False, "AMD EPYC", "AMD EPYC", final=0.2) == "differs on the same CPU family"
    assert v(False, "Intel(R) Xeon(R)", "AMD EPYC", final=0.205).endswith("inside the seed band")
    assert v(False, "Intel(R) Xeon(R)", "AMD EPYC", final=0.5).endswith("outside the seed band")


def test_paired_by_problem_matches_brute_force():
    rng = np.random.default_rng(3)
    rows = []
    for m in ("ebpo", "grpo"):
        for s in range(3 if m == "ebpo" else 2):  # seed 2 has no pair: left out
            for q in range(6):
                rows.append({"method": m, "seed": s, "block": "b", "set": "heldout",
                             "problem_id": f"q{q}", "samples": 4, "correct": rng.integers(0, 5)})  # fmt: skip
    df = pd.DataFrame(rows)
    out = paired_by_problem(df, ["block"], "method", "ebpo", "grpo").iloc[0]
    rate = lambda m: df[(df.method == m) & (df.seed < 2)].groupby("problem_id").correct.sum() / 8
    d = rate("ebpo") - rate("grpo")
    assert out["diff"] == pytest.approx(d.mean()) and out.problems == 6 and out.seeds == 2
    assert out.p == pytest.approx(stats.ttest_1samp(d, 0).pvalue)


@pytest.mark.parametrize("family", ["reasoning", "arithmetic"])
def test_validation_split_is_disjoint_and_leaves_train_and_test_alone(family):
    import ml_collections

    from ebpo_jax import tasks
    from ebpo_jax.tasks import reasoning
    from ebpo_jax.tasks.families import arithmetic as task_arithmetic
    from ebpo_jax.tasks.protocol import mean_pass

    module = reasoning if family == "reasoning" else tasks
    topics = "chain" if family == "reasoning" else "addition"
    t = {"seed": 0, "topics": topics, "max_difficulty": 2, "train_per_cell": 12,
         "test_per_cell": 5, "val_per_cell": 4}  # fmt: skip

    class Spec:
        task = ml_collections.FrozenConfigDict(t)

    _, train, test = task_arithmetic.load_problems(Spec, module)
    val = task_arithmetic.validation_problems(Spec, module)
    cells = {(p.topic, p.difficulty) for p in train}
    assert len(val) == 4 * len(cells) and all(p.id.startswith("validation/") for p in val)
    assert not {p.prompt for p in val} & {p.prompt for p in train + test}
    alone = dict(t, val_per_cell=0)
    Spec.task = ml_collections.FrozenConfigDict(alone)
    _, again, test_again = task_arithmetic.load_problems(Spec, module)
    assert [p.prompt for p in again] == [p.prompt for p in train] and test_again == test
    assert task_arithmetic.validation_problems(Spec, module) == []
    assert mean_pass({"heldout": 0.2, "validation": 0.9}) == 0.2


def test_one_epoch_curriculum_never_restarts():
    from ebpo_jax.ablation import grid as grid_lib
    from ebpo_jax.tasks import reasoning

    module = _experiment("claims").load_module("configs/ablations/robust.py")
    base = grid_lib.load_config_file("configs/reasoning.py")
    train, _ = reasoning.make_splits(base.task.seed, train_per_cell=base.task.train_per_cell,
                                     test_per_cell=base.task.test_per_cell)  # fmt: skip
    block = module.get_config("curriculum_epoch").blocks[0]
    steps, prompts = block["fixed"]["total_steps"], block["fixed"]["prompts_per_step"]
    assert steps * prompts <= len(train) < (steps + 1) * prompts


@pytest.mark.slow
def test_micro_run_with_a_validation_split_records_both(tmp_path):
    """A micro run with task.val_per_cell: results rows hold val_pass@1, problems.csv.gz holds
    both sets, and each set's per-problem rate is its recorded pass@1."""
    from ebpo_jax.ablation import grid as grid_lib

    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(tmp_path / "grid")
    grid.blocks = [
        {
            "name": "main",
            "axes": {"method": ["grpo"], "group_size": [2]},
            "rollouts_per_step": 8,
            "fixed": {"mesh.devices": 1, "task": {"val_per_cell": 3}},
        }
    ]
    out = runner.run_grid(grid, log=lambda *_: None)
    final = pd.read_csv(out["results"]).iloc[-1]
    problems = pd.read_csv(out["problems"])
    rate = problems.groupby("set").correct.sum() / problems.groupby("set").samples.sum()
    assert set(rate.index) == {"heldout", "validation"}
    assert (problems["set"] == "validation").sum() == 2 * 3  # 2 cells x 3
    assert rate["heldout"] == pytest.approx(final["pass@1"], rel=1e-12)
    assert rate["validation"] == pytest.approx(final["val_pass@1"], rel=1e-12)


@pytest.mark.slow
def test_micro_warm_starts_are_committed_and_reruns_start_from_them(tmp_path):
    """Two warm starts (sft.seed axis) land in warm_starts/ under the hashes the rows record;
    a rerun starts from the committed file and matches bitwise on this machine."""
    from ebpo_jax.ablation import grid as grid_lib

    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(tmp_path / "grid")
    grid.commit_warm_starts = True
    grid.blocks = [
        {
            "name": "main",
            "axes": {"sft.seed": [0, 1], "method": ["grpo"], "group_size": [2]},
            "rollouts_per_step": 8,
            "fixed": {"mesh.devices": 1},
        }
    ]
    out = runner.run_grid(grid, log=lambda *_: None)
    final = pd.read_csv(out["results"]).groupby("run_id").tail(1)
    hashes = sorted(final.warm_start_sha256)
    assert len(set(hashes)) == 2
    files = sorted(os.listdir(os.path.join(grid.out_dir, "warm_starts")))
    assert files == [f"{h}.npz" for h in hashes]
    report = rerun_lib.rerun(grid, out["runs"][1], log=lambda *_: None)
    assert report["warm_start_file"] == f"warm_starts/{final.warm_start_sha256.iloc[1]}.npz"
    assert report["match"] and report["verdict"] == "bitwise", report


def test_paper_axes_grids_are_fresh_powered_and_name_their_columns():
    """The issue-49 grids: every claim term matches runs, warm starts are new (none of an
    earlier grid's, none shared between parts), >= 3 per claim, 4x the held-out problems,
    the rerun ids exist, and the G axis holds prompts per step fixed."""
    from ebpo_jax.ablation import expand, power
    from ebpo_jax.ablation.grid import run_config

    c = _experiment("claims")
    module = c.load_module("configs/ablations/paper_axes_claims.py")
    warm = {}
    for part in ("g_axis", "tuning"):
        runs = expand(module.get_config(part))
        warm[part] = {r.value("sft.seed") for r in runs}
        assert {r.run_id for r in runs} >= set(module.RERUNS[part])
        over = [dict(r.overrides) for r in runs]
        assert all(o["task.test_per_cell"] == 80 for o in over)  # 4 x the 20 of robust.py
        if part == "g_axis":
            assert {(o["group_size"], o["prompts_per_step"]) for o in over} == {
                (g, 16) for g in (2, 4, 8, 16)
            }
        for claim in [k for k in module.CLAIMS if k["plus"][0][0] == part]:
            for _, where in claim["plus"] + claim["minus"]:
                vals = [{"block": r.block, **{a: str(v) for a, v in r.values}} for r in runs]
                assert any(all(v.get(k) == str(x) for k, x in where.items()) for v in vals)
    robust = c.load_module("configs/ablations/robust_claims.py")
    earlier = {r.value("sft.seed") for r in expand(robust.get_config("warm_starts"))}
    assert not warm["g_axis"] & warm["tuning"] and not (warm["g_axis"] | warm["tuning"]) & earlier
    assert min(len(w) for w in warm.values()) >= 3 and len(warm["g_axis"]) == 8
    # The seed rule's count is the power analysis' answer at 2 seeds.
    assert power.warm_starts_needed(0.015, 0.0107, 0.0094, 2) == 8
    base = c.load_module("configs/reasoning.py").get_config()
    tuning = {r.run_id: r for r in expand(module.get_config("tuning"))}
    cfg = run_config(base, tuning[module.RERUNS["tuning"][1]], "/tmp/x")
    assert cfg.eval_every == 10 and cfg.dapo.dynamic_sampling and cfg.task.val_per_cell == 20
    assert module.get_config("tuning").blocks[0]["axes"]["lr"] == [
        1e-5,
        2.3e-5,
        5.5e-5,
        1.3e-4,
        3e-4,
    ]
