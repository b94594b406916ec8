"""The paper's curriculum on the toy task (issue 49, item 4): difficulty from the warm start's
own pass rate (estimate_difficulty's toy mode, task.difficulty_file), the easy-to-hard and
hard-to-easy orders by that file, the held-out quartiles, and the pre-registered grid part."""

import json
import os
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from conftest import load_experiment

from ebpo_jax.ablation import expand, power, runner
from ebpo_jax.schema import ConfigError

N = 8  # samples per problem
ORDERS = ["naive", "difficulty", "reverse_difficulty"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A 30-step SFT warm start of the micro task (exported), its difficulty file (toy mode),
    and the config starting from the exported file (no SFT again for another order)."""
    from helpers import micro_config

    tmp = tmp_path_factory.mktemp("toy")
    cfg = micro_config(tmp / "run", **{"sft.steps": 30, "sft.learning_rate": 3e-3,
                                       "sft.cache_dir": str(tmp / "sft"),
                                       "sft.export_dir": str(tmp / "warm"),
                                       "task.train_per_cell": 12, "task.test_per_cell": 8})  # fmt: skip
    out = str(tmp / "difficulty.jsonl")
    rows = load_experiment("estimate_difficulty").run_toy(cfg, out, N)
    cfg.sft.export_dir, cfg.sft.params_file = "", str(tmp / "warm" / f"{rows[0]['warm_start']}.npz")
    return cfg, out, rows


def _problems(cfg):
    """(spec, family, train, test, (model config, params, digest)) of a toy config."""
    from ebpo_jax import spec as spec_lib
    from ebpo_jax.tasks.families import arithmetic as generated

    spec = spec_lib.resolve(cfg, 1).task
    fam = generated.generated(spec.family)
    _, train, test = generated.load_problems(spec, fam.module, fam.tokenizer)
    return spec, fam, train, test, generated.warm_start(spec, fam, train, log=lambda *_: None)


@pytest.mark.slow  # the shared warm start: a 30-step SFT and a sampler compile
def test_toy_difficulty_equals_a_brute_force_pass_count(toy):
    """Each row's difficulty is 1 - (correct / N) counted by hand from the same draws: the
    response up to its first EOS must spell the answer."""
    from ebpo_jax import sampler, tasks
    from ebpo_jax.evaluation import policy as policy_eval
    from ebpo_jax.tasks import difficulty

    cfg, _, rows = toy
    spec, fam, train, test, (model_config, params, digest) = _problems(cfg)
    every = train + test
    data = tasks.encode_problems(every, fam.tokenizer)
    eos = fam.tokenizer.eos_id
    draws = sampler.SamplerSpec(max_new_tokens=spec.max_new_tokens, num_samples=N,
                                eos_ids=eos, sampling=sampler.Sampling(1.0))  # fmt: skip
    est = difficulty.estimate_spec(spec.eval, N)
    chunks = policy_eval.Chunks(est.run.eval_batch_size, est.run.seed)
    tokens, lengths = policy_eval.sample_chunks(
        model_config, params, data.prompt_tokens, data.prompt_lengths, draws, chunks
    )
    correct = np.zeros(len(every), int)
    for i, (row, n) in enumerate(zip(tokens, lengths)):
        content = [int(t) for t in row[:n]]
        if eos in content:
            want = fam.tokenizer.encode(every[i // N].answer)
            correct[i // N] += content[: content.index(eos)] == want
    assert [r["id"] for r in rows] == [p.id for p in every]
    assert [r["set"] for r in rows] == ["train"] * len(train) + ["heldout"] * len(test)
    assert [r["correct"] for r in rows] == correct.tolist()
    assert [r["difficulty"] for r in rows] == pytest.approx((1 - correct / N).tolist())
    assert {r["warm_start"] for r in rows} == {digest} and {r["samples"] for r in rows} == {N}
    assert 0 < correct.sum() < N * len(every)  # a policy with something to order


@pytest.mark.slow  # the shared warm start: a 30-step SFT and a sampler compile
def test_orders_by_the_file_and_bands_by_its_quartiles(toy, tmp_path):
    """task.difficulty_file orders training easy to hard (hard to easy reversed) by the
    file's values, bands the held-out problems, and refuses another warm start's file."""
    from ebpo_jax import spec as spec_lib
    from ebpo_jax.tasks.protocol import build_task

    cfg, path, rows = toy
    want = {r["id"]: r["difficulty"] for r in rows}
    for order, sign in (("difficulty", 1), ("reverse_difficulty", -1)):
        c = cfg.copy_and_resolve_references()
        c.task.difficulty_file, c.task.order = path, order
        task = build_task(spec_lib.resolve(c, 1).task, log=lambda *_: None)
        problems = task.source.problems
        got = [want[problems[i].id] for i in task.source.epoch_order(0)]
        assert (sign * np.diff(got) >= 0).all() and len(got) == len(problems)
        assert sorted(got) == sorted(want[p.id] for p in problems)
    heldout = task.evaluate.sets[0]
    diff = np.array([want[pid] for pid, _, _ in heldout.problems])
    bands = np.array(heldout.bands)
    assert sorted(set(bands)) == ["q1", "q2", "q3", "q4"]
    assert all((bands == b).sum() == len(bands) // 4 for b in set(bands))
    assert diff[bands == "q1"].max() <= diff[bands == "q2"].min() <= diff[bands == "q4"].min()
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({**r, "warm_start": "f" * 64}) + "\n" for r in rows))
    c.task.difficulty_file = str(other)
    with pytest.raises(ConfigError, match="other.jsonl.*estimated from warm start f{64}"):
        build_task(spec_lib.resolve(c, 1).task, log=lambda *_: None)
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    with pytest.raises(ConfigError, match="other.jsonl.*train problem train/addition/1/0"):
        build_task(spec_lib.resolve(c, 1).task, log=lambda *_: None)


def test_band_views_stay_out_of_the_mean_and_reach_the_claims():
    """A band is a view of a set (not in eval/pass@1), collected as pass@1/<band> and read
    by a claim's `band`."""
    from ebpo_jax.ablation.results import band_columns
    from ebpo_jax.evaluation.evaluator import EvalSet, band_means
    from ebpo_jax.tasks import difficulty
    from ebpo_jax.tasks.protocol import mean_pass

    diff, levels = [0.0, 1.0, 0.5, 1.0, 0.25, 1.0, 0.75, 1.0], [1, 3, 1, 2, 1, 1, 2, 3]
    bands = difficulty.quartiles(diff, levels)  # ties at 1.0: by level, then position
    assert bands == ("q1", "q4", "q2", "q3", "q1", "q3", "q2", "q4")
    s = EvalSet("heldout", None, None, None, bands=bands)
    rate = np.array([1.0, 0.0, 0.5, 0.25, 0.75, 0.0, 0.5, 0.25])
    per = {"heldout": rate.mean(), **band_means(s, rate)}
    assert per["heldout/q1"] == 0.875 and per["heldout/q4"] == 0.125
    assert mean_pass(per) == rate.mean() == np.mean([per[f"heldout/q{i}"] for i in range(1, 5)])
    row = {f"eval/{k}/pass@1": v for k, v in per.items()} | {"eval/validation/pass@1": 0.3}
    assert band_columns(row) == {f"pass@1/q{i}": per[f"heldout/q{i}"] for i in range(1, 5)}
    claims = load_experiment("claims")
    finals = pd.DataFrame({"run_id": ["a", "b"], "step": [112, 112], "seed": [0, 0],
                           "order": ["difficulty", "naive"], "pass@1": [0.5, 0.4],
                           "pass@1/q4": [0.2, 0.05]})  # fmt: skip
    claim = {"claim": "x", "direction": 0, "band": "q4",
             "plus": [("p", {"order": "difficulty"})], "minus": [("p", {"order": "naive"})]}  # fmt: skip
    rows_of = lambda _: finals
    assert claims._difference(claim, rows_of).tolist() == pytest.approx([0.15])
    assert claims._difference({**claim, "band": ""}, rows_of).tolist() == pytest.approx([0.1])


def test_bootstrap_over_a_band_per_warm_start_matches_a_loop():
    """Each warm start's band holds other problems (nan elsewhere): a draw's effect is the
    mean over drawn warm starts of the mean over the drawn problems in that warm start's band."""
    from ebpo_jax.ablation import twolevel

    rng = np.random.default_rng(0)
    d_kj = rng.normal(0.02, 0.1, (6, 8))
    cluster_k = np.repeat([0, 1, 2], 2)
    band = np.array([[1, 1, 0, 0, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0, 0, 1], [1, 0, 0, 1, 0, 1, 1, 0]])
    d_kj[~band[cluster_k].astype(bool)] = np.nan
    a_cj = np.stack([d_kj[cluster_k == c].mean(0) for c in range(3)])
    n_c, n_j = rng.multinomial(3, [1 / 3] * 3, 40), rng.multinomial(8, [1 / 8] * 8, 40)
    effects, diff = twolevel._ragged(a_cj, n_c, n_j)
    assert len(effects) == 40  # every draw holds problems of some drawn warm start's band
    for e, nc, nj in zip(effects, n_c, n_j):
        means = [np.average(a_cj[c][band[c] == 1], weights=nj[band[c] == 1]) if
                 nj[band[c] == 1].sum() else np.nan for c in range(3)]  # fmt: skip
        ok = [c for c in range(3) if nc[c] and np.isfinite(means[c])]
        assert e == pytest.approx(np.average([means[c] for c in ok], weights=nc[ok]))
    assert diff == pytest.approx(np.mean([a_cj[c][band[c] == 1].mean() for c in range(3)]))
    out = twolevel.bootstrap(d_kj, cluster_k, draws=2000)
    assert out["diff"] == pytest.approx(diff) and out["ci_low"] < diff < out["ci_high"]


def _module():
    return load_experiment("claims").load_module("configs/ablations/paper_curriculum_claims.py")


def test_curriculum_part_is_fresh_powered_and_names_its_runs():
    """54 runs (9 new warm starts x 2 seeds x 3 orders) over exactly one epoch, every claim
    term matching runs of its part, the rerun ids among them, and its own claims file."""
    module = _module()
    axes = load_experiment("claims").load_module("configs/ablations/paper_axes.py")
    grid = module.get_config("curriculum")
    runs = expand(grid)
    assert len(runs) == 54 and grid.claims_file == "configs/ablations/paper_curriculum_claims.py"
    warm = {r.value("sft.seed") for r in runs}
    earlier = {w for part in ("g_axis", "tuning") for w in axes.WARM_STARTS[part]} | set(range(5))
    assert warm == set(range(300, 309)) and not warm & earlier
    assert power.warm_starts_needed(0.015, 0.0107, 0.0108, 2) == len(warm)
    over = [dict(r.overrides) for r in runs]
    assert {(o["task.difficulty_file"], o["task.test_per_cell"]) for o in over} == {("auto", 80)}
    steps, prompts = over[0]["total_steps"], over[0]["prompts_per_step"]
    assert steps * prompts <= 9 * 400 < (steps + 1) * prompts and over[0]["eval_every"] * 4 == steps
    assert set(module.RERUNS["curriculum"]) <= {r.run_id for r in runs}
    vals = [{"step": s, **{a: str(v) for a, v in r.values}} for r in runs for s in (84, 112)]
    for claim in module.CLAIMS:
        for part, where in claim["plus"] + claim["minus"]:
            assert part == "curriculum"
            assert any(all(v.get(k) == x if k == "step" else v.get(k) == str(x)
                           for k, x in where.items()) for v in vals), (claim["claim"], where)  # fmt: skip
    assert [c["direction"] for c in module.CLAIMS].count(1) == 2


def test_dry_run_lists_the_runs_and_training_needs_committed_claims(tmp_path):
    """--dry_run lists every run as todo; training refuses while the claims file has
    uncommitted changes, before anything trains."""
    grid = _module().get_config("curriculum")
    grid.out_dir = str(tmp_path / "out")
    grid.fixed.mesh = {"devices": 1}  # the tests' 8 CPU devices; ablate.py runs on one
    lines = []
    out = runner.run_grid(grid, select=runner.Selection(dry_run=True), log=lines.append)
    assert len(out["runs"]) == 54 and out["trained"] == []
    assert sum(line.strip().startswith("todo  epoch__sft.seed-3") for line in lines) == 54
    claims = tmp_path / "claims" / "paper_curriculum_claims.py"
    claims.parent.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", grid.claims_file), claims)
    git = ["git", "-C", str(claims.parent), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "claims"], check=True)
    grid.claims_file = str(claims)
    assert runner.claims_stamp(grid)["claims_sha256"]
    claims.write_text(claims.read_text() + "# a claim added after the fact\n")
    with pytest.raises(ValueError, match="paper_curriculum_claims.py: not committed"):
        runner.run_grid(grid, log=lambda *_: None)
    assert not os.path.exists(os.path.join(grid.out_dir, "runs"))


@pytest.mark.slow
def test_micro_curriculum_grid_estimates_once_and_reads_its_quartiles(tmp_path):
    """Three orders from two warm starts with task.difficulty_file=auto: one difficulty file
    per warm start beside it, quartile columns whose mean is pass@1 at every evaluation, a
    band column per problem, and the part's claims (steps and bands) computed from them."""
    from ebpo_jax.ablation import grid as grid_lib

    grid = grid_lib.load_config_file("configs/ablations/micro.py")
    grid.out_dir = str(tmp_path / "grid")
    grid.commit_warm_starts = True
    grid.blocks = [
        {
            "name": "epoch",
            "axes": {"sft.seed": [0, 1], "seed": [0], "method": ["ebpo"], "order": ORDERS},
            "fixed": {"mesh.devices": 1, "group_size": 2, "prompts_per_step": 4,
                      "total_steps": 4, "eval_every": 2, "sft": {"steps": 30},
                      "task": {"difficulty_file": "auto", "difficulty_samples": 4}},
        }
    ]  # fmt: skip
    out = runner.run_grid(grid, log=lambda *_: None)
    results = pd.read_csv(out["results"])
    warm = os.path.join(grid.out_dir, "warm_starts")
    hashes = set(results.warm_start_sha256)
    files = sorted(os.listdir(warm))
    assert len(hashes) == 2 and len(files) == 4  # per warm start: its params, its difficulty
    assert {f.split(".")[0] for f in files} == hashes
    quarters = results[[f"pass@1/q{i}" for i in range(1, 5)]].mean(axis=1)
    assert np.allclose(quarters, results["pass@1"])  # 16 held-out problems: 4 per quartile
    problems = pd.read_csv(out["problems"])
    assert (problems.groupby(["run_id", "band"]).size() == 4).all()
    module, claims = _module(), load_experiment("claims")
    tests = [
        module._vs("end", "difficulty", "naive"),
        module._vs("step 2", "difficulty", "naive", step=2),
        module._vs("q4", "difficulty", "naive", band="q4"),
    ]
    rows_of = lambda _: results
    table = claims.claims_table(tests, rows_of, problems_of=lambda _: problems)
    assert (table.seeds == 2).all() and (table.warm_starts == 2).all()
    final = results[results.step == 4].set_index(["sft.seed", "order"])
    for order, col, row in (("end", "pass@1", 0), ("q4", "pass@1/q4", 2)):
        d = final.xs("difficulty", level=1)[col] - final.xs("naive", level=1)[col]
        assert table["diff"][row] == pytest.approx(d.mean())
    q4 = problems[problems.band == "q4"].problem_id.nunique()  # each warm start has its own q4
    assert table.boot_problems[2] == q4 and np.isnan(table.boot_diff[1])  # no step-2 problems
    assert table.boot_diff[2] == pytest.approx(table["diff"][2])  # its own band's problems
