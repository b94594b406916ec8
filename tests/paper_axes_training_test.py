"""The paper-axes grids' training side before they run (issue 49, items 4 and 5): the registered
runs, their splits, the curriculum's orders over one epoch and a run resumed mid-epoch, each
checked against a reference written here from the registration's text."""

import functools
import json
import os

import jax
import numpy as np
import pytest
from conftest import load_experiment

from ebpo_jax import spec as spec_lib
from ebpo_jax.ablation import expand
from ebpo_jax.ablation import grid as grid_lib
from ebpo_jax.tasks import reasoning
from ebpo_jax.tasks.families import arithmetic as generated

AUTO = "auto"
CELLS = 9  # 3 topics x 3 levels of the reasoning family
EPOCH, PROMPTS = 112, 32  # paper_axes.EPOCH_STEPS, BUDGET // 4
LRS = {1e-5, 2.3e-5, 5.5e-5, 1.3e-4, 3e-4}
TUNED = {"grpo", "dr_grpo", "rloo", "rpp", "clip_cov"}


@functools.cache
def _specs(part: str) -> dict:
    """{run id: (Run, TaskSpec)} of every run of the registered part."""
    grid = grid_lib.load_config_file("configs/ablations/paper_axes.py", part)
    base = grid_lib.load_config_file(grid.base_config)
    out = {}
    for run in expand(grid):
        cfg = grid_lib.run_config(base, run, "/tmp/unused")
        out[run.run_id] = (run, cfg, spec_lib.resolve(cfg, 1))
    return out


@functools.cache
def _splits(task) -> tuple:
    """(train, held-out, validation) prompts of a task section."""

    class Spec:
        pass

    Spec.task = task
    _, train, test = generated.load_problems(Spec, reasoning)
    val = generated.validation_problems(Spec, reasoning)
    return train, test, val


@pytest.mark.parametrize("part,val", [("curriculum", 0), ("tuning", 20)])
def test_every_run_of_a_part_has_one_disjoint_split_of_the_registered_size(part, val):
    """Train, held-out and validation prompts are disjoint as text, 400 / 80 / `val` per
    cell, and the same in every run (every warm start, RL seed, order, method and lr)."""
    tasks = {s.task.task for _, _, s in _specs(part).values()}  # by order in the curriculum
    texts = {tuple(tuple(p.prompt for p in s) for s in _splits(t)) for t in tasks}
    assert len(texts) == 1
    train, test, valid = _splits(tasks.pop())
    by_text = [{p.prompt for p in s} for s in (train, test, valid)]
    assert [len(s) for s in by_text] == [400 * CELLS, 80 * CELLS, val * CELLS]  # distinct too
    assert not (by_text[0] & by_text[1] or by_text[0] & by_text[2] or by_text[1] & by_text[2])
    for split, n in ((train, 400), (test, 80), (valid, val)):
        cells = {}
        for p in split:
            cells[p.topic, p.difficulty] = cells.get((p.topic, p.difficulty), 0) + 1
        assert set(cells.values()) <= {n} and len(cells) == (CELLS if n else 0)


def test_tuning_runs_are_the_registered_ones():
    """Each tuning run against a table written from the registration: 7 methods x 5 rates x 3
    warm starts x 2 seeds at G=4 and 128 responses per step (no DAPO refill in the budget),
    validation 20 per cell, EBPO and DAPO evaluated every 10 steps, the rest every 50."""
    specs = _specs("tuning")
    assert len(specs) == 7 * 5 * 3 * 2
    want = {
        (m, lr, w, s)
        for m in TUNED | {"ebpo", "dapo"}
        for lr in LRS
        for w in (200, 201, 202)
        for s in (0, 1)
    }
    got = set()
    for run, cfg, spec in specs.values():
        m = run.value("method")
        got.add((m, run.value("lr"), run.value("sft.seed"), run.value("seed")))
        r = spec.rollout
        assert (r.group_size, r.prompts, spec.task.sft.seed) == (4, 32, run.value("sft.seed"))
        assert spec.optim.optimizer.learning_rate == run.value("lr") and spec.run.seed in (0, 1)
        assert spec.eval.run.eval_every == (10 if m in ("ebpo", "dapo") else 50)
        assert (spec.run.total_steps, spec.eval.run.eval_samples) == (200, 4)
        assert (spec.task.task.val_per_cell, spec.task.task.test_per_cell) == (20, 80)
        assert (cfg.estimator, r.dapo.dynamic_sampling) == (
            {"dr_grpo": "dr_grpo", "rloo": "rloo", "rpp": "reinforce_pp_baseline",
             "ebpo": "ebpo"}.get(m, "grpo"), m == "dapo")  # fmt: skip
        assert cfg.loss.name == ("clip_cov" if m == "clip_cov" else "ppo")
        assert cfg.loss.clip_high == (0.28 if m == "dapo" else cfg.loss.clip_low)
        assert spec.task.task.difficulty_file == "" and spec.task.task.order == "naive"
    assert got == want


def test_curriculum_runs_are_the_registered_ones():
    """54 runs: EBPO at G=4 x 32 prompts for one epoch, evaluated at each quarter, every order
    of every warm start estimating its difficulty (16 samples) into the same auto file."""
    from ebpo_jax.tasks import difficulty

    specs = _specs("curriculum")
    assert len(specs) == 54

    files = {}
    for run, cfg, spec in specs.values():
        r = spec.rollout
        assert (r.group_size, r.prompts, spec.task.batch_prompts) == (4, PROMPTS, PROMPTS)
        assert (spec.run.total_steps, spec.eval.run.eval_every) == (EPOCH, EPOCH // 4)
        assert (cfg.estimator, cfg.eb_clusters, r.dapo.dynamic_sampling) == ("ebpo", "none", False)
        t = spec.task.task
        assert (t.order, t.difficulty_file, t.difficulty_samples) == (run.value("order"), AUTO, 16)
        key = difficulty.auto_path(spec.task, f"<{run.value('sft.seed')}>")
        files.setdefault(run.value("sft.seed"), set()).add(key)
    assert sorted(files) == list(range(300, 309)) and all(len(f) == 1 for f in files.values())


def _epoch(order: str, seed: int, diff) -> list[int]:
    """The training problems one epoch of the curriculum draws, batch by batch."""
    from ebpo_jax import tasks

    train, _, _ = _splits(next(iter(_specs("curriculum").values()))[2].task.task)
    source = tasks.PromptSource(
        train, reasoning.make_tokenizer(), PROMPTS, seed=seed, order=order, difficulty=diff
    )
    drawn = [source.next_indices().tolist() for _ in range(EPOCH)]
    assert source.state()["epoch"] == 0  # one epoch: no restart
    return [i for batch in drawn for i in batch]


def test_one_epoch_in_each_order_against_a_reference():
    """3584 distinct problems of the 3600 in each order: easy to hard and hard to easy by the
    file's difficulty (17 values over 16 samples, so ties are large), naive = the seeded
    shuffle; ties follow that shuffle, so the RL seed reorders a tie and nothing else."""
    rng = np.random.default_rng(7)
    diff = rng.integers(0, 17, 400 * CELLS) / 16  # a difficulty file's values
    naive = {s: np.random.default_rng([s, 0]).permutation(len(diff)) for s in (0, 1)}
    for seed in (0, 1):
        got = {o: _epoch(o, seed, diff) for o in ("naive", "difficulty", "reverse_difficulty")}
        assert got["naive"] == naive[seed][: EPOCH * PROMPTS].tolist()
        rank = np.empty(len(diff), int)
        rank[naive[seed]] = np.arange(len(diff))
        for order, sign in (("difficulty", 1), ("reverse_difficulty", -1)):
            ref = sorted(range(len(diff)), key=lambda i: (sign * diff[i], rank[i]))
            assert got[order] == ref[: EPOCH * PROMPTS] and len(set(got[order])) == 3584
        left = set(range(len(diff))) - set(got["difficulty"])
        assert {diff[i] for i in left} == {diff.max()}  # the 16 never drawn: the hardest
    assert _epoch("difficulty", 0, diff) != _epoch("difficulty", 1, diff)
    first = lambda s: _epoch("difficulty", s, diff)[: (diff == 0).sum()]
    assert set(first(0)) == set(first(1)) == set(np.flatnonzero(diff == 0))


def _rows(workdir) -> list[dict]:
    """metrics.jsonl without its timings."""
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    timing = lambda k: k.startswith(("perf/", "phase/")) and not k.endswith("tokens_total")
    keep = lambda k: not timing(k) or k == "perf/step_tokens"
    return [{k: v for k, v in r.items() if keep(k)} for r in rows]


@pytest.mark.slow  # three micro calls: a 30-step SFT, a difficulty estimate, 6 steps
def test_curriculum_run_killed_mid_epoch_resumes_its_order_bitwise(tmp_path, monkeypatch):
    """A difficulty-ordered run stopped after 2 of 6 steps resumes at the same place in its
    order: it draws the uninterrupted run's problems (easy to hard, none repeated or skipped),
    its rows and params are bitwise equal, and its difficulty file is estimated once, before
    the first step, read again on resume, and equal to estimate_difficulty.py's by hand."""
    from helpers import micro_config

    from ebpo_jax import tasks
    from ebpo_jax.runtime.checkpoint import load_params
    from ebpo_jax.trainer import loop

    drawn, estimates = [], []
    real_draw, real_estimate = tasks.PromptSource.next_indices, generated.estimate_difficulty
    monkeypatch.setattr(
        tasks.PromptSource, "next_indices", lambda s: drawn.append(real_draw(s)) or drawn[-1]
    )
    monkeypatch.setattr(
        generated,
        "estimate_difficulty",
        lambda spec, *a, **k: estimates.append(1) or real_estimate(spec, *a, **k),
    )

    def train(name, **kw):
        cfg = micro_config(tmp_path / name, **{
            "sft.steps": 30, "sft.learning_rate": 3e-3, "sft.cache_dir": str(tmp_path / "sft"),
            "sft.export_dir": str(tmp_path / name / "warm"), "task.order": "difficulty",
            "task.difficulty_file": "auto", "task.difficulty_samples": 4,
            "total_steps": 6, "group_size": 2})  # fmt: skip
        before = len(drawn)
        out = loop.train(cfg, log=lambda *_: None, **kw)
        return out, [i for b in drawn[before:] for i in b.tolist()], cfg

    _, full, cfg = train("full")
    first, head, _ = train("resumed", stop_after=2)
    resumed, tail, _ = train("resumed")
    assert first["step"] == 2 and resumed["resumed_from"] == 2 and len(estimates) == 2
    assert head + tail == full and len(set(full)) == len(full) == 6 * 4
    files = [sorted((tmp_path / n / "warm").glob("*.jsonl")) for n in ("full", "resumed")]
    assert [len(f) for f in files] == [1, 1]
    assert files[0][0].read_bytes() == files[1][0].read_bytes()
    rows = [json.loads(x) for x in files[0][0].read_text().splitlines()]
    diff = {r["id"]: r["difficulty"] for r in rows if r["set"] == "train"}
    train_problems = generated.load_problems(spec_lib.resolve(cfg, 1).task)[1]
    got = [diff[train_problems[i].id] for i in full]
    assert got == sorted(got) and len(set(got)) > 1  # easy to hard, over more than one value
    assert _rows(tmp_path / "full") == _rows(tmp_path / "resumed")
    a, b = (load_params(str(tmp_path / n)) for n in ("full", "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    by_hand = tmp_path / "by_hand.jsonl"  # estimate_difficulty.py's toy mode, documented as equal
    cfg.sft.export_dir = ""
    load_experiment("estimate_difficulty").run_toy(cfg, str(by_hand), 4)
    assert by_hand.read_bytes() == files[0][0].read_bytes()


def test_two_runs_exporting_one_warm_start_at_once_both_succeed(tmp_path, monkeypatch):
    """Two orders of a curriculum warm start finish SFT together and export the same file:
    a second writer between the first's write and rename must not break either (the
    grid's first two workers start two runs of one warm start)."""
    from ebpo_jax.tasks import sft

    params = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float32)}
    real, calls = np.savez_compressed, []

    def racing(file, *arrays):
        real(file, *arrays)
        calls.append(file)
        if len(calls) == 1:  # the other process writes and renames its copy now
            assert sft.export(params, str(tmp_path)) == want

    want = str(tmp_path / f"{sft.params_digest(params)}.npz")
    monkeypatch.setattr(np, "savez_compressed", racing)
    assert sft.export(params, str(tmp_path)) == want
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == [os.path.basename(want)]
    assert sft.params_digest(sft.load_file(want, params)) == sft.params_digest(params)


def test_a_rerun_reads_the_difficulty_file_its_grid_wrote():
    """The grid's run writes `<out>/warm_starts/<sha>.difficulty-<tag>.jsonl` beside the
    exported warm start; `--rerun` starts from `<out>/warm_starts/<sha>.npz` without an
    export folder and must find that same file, whatever the order or RL seed."""
    import dataclasses

    from ebpo_jax.tasks import difficulty

    sha, warm = "ab" * 32, "/out/paper_curriculum/warm_starts"
    paths = set()
    for _, _, spec in _specs("curriculum").values():
        t = spec.task
        grid = dataclasses.replace(t, sft=dataclasses.replace(t.sft, export_dir=warm))
        rerun = dataclasses.replace(t.sft, export_dir="", params_file=f"{warm}/{sha}.npz")
        paths |= {difficulty.auto_path(s, sha) for s in (grid, dataclasses.replace(t, sft=rerun))}
    assert len(paths) == 1 and paths.pop().startswith(f"{warm}/{sha}.difficulty-")


def test_quartiles_of_a_tied_difficulty_file_against_a_reference():
    """720 held-out problems whose difficulty takes 17 values: 180 per band, ordered by
    difficulty, a tie across a band edge split by the generator's level, then position."""
    from ebpo_jax.tasks import difficulty

    rng = np.random.default_rng(3)
    diff = rng.choice(np.arange(17) / 16, 80 * CELLS, p=np.r_[0.1, [0.02] * 15, 0.6])
    levels = rng.integers(1, 4, diff.size)
    bands = np.array(difficulty.quartiles(diff, levels))
    ref = sorted(range(diff.size), key=lambda i: (diff[i], levels[i], i))
    for k, band in enumerate(difficulty.QUARTILES):
        assert sorted(np.flatnonzero(bands == band)) == sorted(ref[180 * k : 180 * (k + 1)])
    top = bands[diff == 1.0]
    assert len(set(top)) > 1  # the pass-rate-0 tie straddles a band edge here


def test_runs_of_one_warm_start_started_together_estimate_its_difficulty_once(tmp_path):
    """The grid's two workers start two orders of one warm start at once: one estimates
    (about half an hour per warm start at the registered size), the other waits and reads."""
    import hashlib
    import tempfile
    import threading
    import time

    from ebpo_jax.tasks import difficulty

    path, calls, lines = str(tmp_path / "warm.difficulty-x.jsonl"), [], []

    def estimate():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return [{"set": "train", "id": "a", "samples": 16, "difficulty": 0.5}]

    runs = [threading.Thread(target=difficulty.ensure, args=(path, estimate, lines.append))]
    runs.append(threading.Thread(target=difficulty.ensure, args=(path, estimate, lines.append)))
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert len(calls) == 1 and difficulty.read(path)[0]["difficulty"] == 0.5
    assert any("another run is estimating" in line for line in lines)
    difficulty.ensure(path, lambda: pytest.fail("estimated again"), lines.append)
    name = hashlib.sha256(path.encode()).hexdigest()[:16]
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"ebpo-difficulty-{name}.lock"))


def test_the_orders_of_a_warm_start_share_one_sft():
    """SFT never reads task.order: the three orders of a curriculum warm start load one SFT
    cache file (they trained three, so pairing by warm start rested on SFT repeating
    bitwise)."""
    from ebpo_jax.tasks import sft
    from ebpo_jax.tasks.protocol import model_config_from, tokenizer_vocab

    vocab = tokenizer_vocab(reasoning.make_tokenizer())
    paths = {}
    for run, _, spec in _specs("curriculum").values():
        mc = model_config_from(spec.task.model, vocab)
        path = sft.cache_path(spec.task, mc, 400 * CELLS, sft.data_key(reasoning))
        paths.setdefault(run.value("sft.seed"), set()).add(path)
    assert len(paths) == 9 and all(len(p) == 1 for p in paths.values())
    assert len(set.union(*paths.values())) == 9


def test_difficulty_draws_never_repeat_an_evaluations_draws_on_a_problem(monkeypatch):
    """At the registered shape (3600 + 720 problems x 16 samples, 128 prompts per call) the
    estimate samples at seed 0 with the chunk keys the RL-seed-0 runs' evaluation uses, but
    on other problems: no held-out problem gets one (key, row) draw in both, at either RL
    seed. The sampler is replaced by a recorder, so only the keys and prompts are real."""
    from ebpo_jax.evaluation import policy as policy_eval
    from ebpo_jax.evaluation.evaluator import make_evaluator
    from ebpo_jax.sampler.spec import Generation
    from ebpo_jax.tasks import difficulty
    from ebpo_jax.tasks.protocol import model_config_from, tokenizer_vocab

    calls = []

    def record(model_config, params, tokens_BT, lengths_B, spec, *, rng, mesh=None):
        rows = len(lengths_B) * spec.num_samples
        prompts = [t[:n].tobytes() for t, n in zip(tokens_BT, lengths_B)]
        calls[-1].append(
            (np.asarray(jax.random.key_data(rng)).tobytes(), prompts, spec.num_samples)
        )
        z = np.zeros((rows, spec.max_new_tokens), np.int32)
        return Generation(z, z.astype(np.float32), np.zeros(rows, np.int32))

    monkeypatch.setattr(policy_eval.sampler, "generate", record)
    runs = {run.value("seed"): spec for run, _, spec in _specs("curriculum").values()}
    task = runs[0].task
    fam = generated.generated(task.family)
    _, train, test = generated.load_problems(task, fam.module, fam.tokenizer)
    mc = model_config_from(task.model, tokenizer_vocab(fam.tokenizer))
    warm = generated.WarmStart(mc, None, "x" * 64)

    def draws() -> set:
        """(prompt tokens, key, row) of every sample the last evaluation drew."""
        out = set()
        for key, prompts, k in calls[-1]:
            for p, prompt in enumerate(prompts):
                out |= {(prompt, key, p * k + s) for s in range(k)}
        return out

    calls.append([])
    split = {difficulty.TRAIN: train, difficulty.HELDOUT: test}
    generated.estimate_difficulty(task, fam, warm, split)
    est = draws()
    assert len(calls[-1]) == 34 and {k for _, _, k in calls[-1]} == {16}
    for seed in (0, 1):
        calls.append([])
        s = generated.eval_set(test, fam.tokenizer, fam.reward_fn)
        make_evaluator(runs[seed].eval, mc, [s], fam.tokenizer.eos_id)(None)
        held = draws()
        shared_keys = {key for _, key, _ in held} & {key for _, key, _ in est}
        assert bool(shared_keys) == (seed == 0)  # seed 0: the estimate's first 6 chunk keys
        assert len(held) == 6 * 128 * 4 and not est & held  # 720 + 48 padding prompts


@pytest.mark.slow  # two 4-step micro runs
def test_evaluating_every_step_leaves_training_bitwise_alone(tmp_path):
    """The tuning part evaluates EBPO and DAPO every 10 steps and the other methods every 50,
    then compares them at step 200: evaluating must not touch the training stream (rng,
    data position, params)."""
    from helpers import micro_config

    from ebpo_jax.runtime.checkpoint import load_params
    from ebpo_jax.trainer import loop

    for name, every in (("dense", 1), ("sparse", 4)):
        cfg = micro_config(tmp_path / name, eval_every=every, checkpoint_every=4)
        loop.train(cfg, log=lambda *_: None)
    train_rows = lambda n: [
        {k: v for k, v in r.items() if not k.startswith(("eval/", "perf/step_time", "phase/"))}
        for r in _rows(tmp_path / n)
    ]
    assert train_rows("dense")[1:] == train_rows("sparse")[1:]
    a, b = (load_params(str(tmp_path / n)) for n in ("dense", "sparse"))
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_tuning_run_trains_on_no_validation_problem(tmp_path):
    """A registered tuning run's task (its SFT skipped): the training stream is the 3600
    training problems, the evaluation holds the 720 held-out and the 180 validation ones,
    and no validation prompt is among those it trains on."""
    from ebpo_jax.tasks.protocol import build_task

    _, cfg, _ = next(iter(_specs("tuning").values()))
    cfg = cfg.copy_and_resolve_references()
    cfg.sft.steps, cfg.workdir, cfg.sft.cache_dir = 0, str(tmp_path), str(tmp_path)
    task = build_task(spec_lib.resolve(cfg, 1).task, log=lambda *_: None)
    sets = {s.name: s for s in task.evaluate.sets}
    assert {n: len(s.prompt_lengths) for n, s in sets.items()} == {
        "heldout": 80 * CELLS,
        "validation": 20 * CELLS,
    }
    text = lambda toks, n: task.tokenizer.decode([int(t) for t in toks[:n]])
    valid = {
        text(t, n)
        for t, n in zip(sets["validation"].prompt_tokens, sets["validation"].prompt_lengths)
    }
    trained = {p.prompt for p in task.source.problems}
    assert len(trained) == 400 * CELLS and len(valid) == 20 * CELLS
    assert valid == {p.prompt for p in _splits(spec_lib.resolve(cfg, 1).task.task)[2]}
    assert not trained & valid
