"""Evaluation metrics against brute-force enumeration and hand-computed values."""

import itertools
import os

import numpy as np
import pytest

from ebpo_jax import evaluation as ev


def brute_pass_at_k(row, k):
    """Share of all k-subsets of the n samples that contain a correct one."""
    subsets = list(itertools.combinations(range(len(row)), k))
    return np.mean([any(row[i] for i in s) for s in subsets])


def test_pass_at_k_matches_brute_force():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 8):
        correct = rng.random((12, n)) < rng.random((12, 1))
        correct[0] = False
        correct[-1] = True
        for k in range(1, n + 1):
            got = ev.pass_at_k_per_problem(correct, k)
            want = [brute_pass_at_k(row, k) for row in correct]
            np.testing.assert_allclose(got, want, atol=1e-12)


def test_pass_at_k_large_n_is_stable():
    correct = np.zeros((1, 200), bool)
    correct[0, :3] = True
    # C(197, 10) / C(200, 10) by exact integer arithmetic.
    from math import comb

    want = 1 - comb(197, 10) / comb(200, 10)
    np.testing.assert_allclose(ev.pass_at_k_per_problem(correct, 10), [want], rtol=1e-12)


def test_pass_at_1_equals_mean():
    correct = np.random.default_rng(1).random((30, 6)) < 0.4
    np.testing.assert_allclose(
        ev.pass_at_k_per_problem(correct, 1), ev.mean_at_k_per_problem(correct)
    )


def test_maj_at_k():
    answers = [
        ["1", "2", "2", None],
        ["3", "3", "4", "4"],
        [None, None, None, None],
        ["5", "6", "6", "6"],
    ]
    correct = np.array([[1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
    np.testing.assert_array_equal(ev.maj_at_k_per_problem(correct, answers, 4), [0, 0, 0, 0])
    np.testing.assert_array_equal(ev.maj_at_k_per_problem(correct, answers, 1), [1, 0, 0, 1])
    # Problem 1 with k=4: a 2-2 tie goes to the answer seen first ("3", wrong).
    answers[1] = ["4", "3", "3", "4"]
    correct[1] = [1, 0, 0, 1]
    np.testing.assert_array_equal(ev.maj_at_k_per_problem(correct, answers, 4), [0, 1, 0, 0])
    with pytest.raises(ValueError, match="both correct and wrong"):
        ev.maj_at_k_per_problem(np.array([[1, 0]]), [["7", "7"]], 2)


def test_bootstrap_contains_point_estimate():
    rng = np.random.default_rng(2)
    for seed in range(5):
        correct = rng.random((40, 8)) < rng.random((40, 1))
        for k in (1, 4, 8):
            v = ev.pass_at_k_per_problem(correct, k)
            lo, hi = ev.bootstrap_interval(v, seed=seed)
            assert lo <= v.mean() <= hi
            assert hi - lo < 0.5
    assert ev.bootstrap_interval(np.ones(10)) == (1.0, 1.0)


def test_bootstrap_coverage_shrinks_with_more_problems():
    rng = np.random.default_rng(3)
    small = ev.bootstrap_interval(rng.random(20) < 0.5)
    large = ev.bootstrap_interval(rng.random(2000) < 0.5)
    assert large[1] - large[0] < (small[1] - small[0]) / 5


def test_summarize_and_table():
    correct = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    answers = [["a", "b", "a", "b"], ["x", "y", "x", None], ["c", "c", "c", "c"]]
    out = ev.summarize(correct, answers, num_resamples=200)
    assert set(out) == {"mean@4", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4"}
    assert out["mean@4"]["value"] == pytest.approx(6 / 12)
    assert out["pass@4"]["value"] == pytest.approx(2 / 3)
    assert out["maj@4"]["value"] == pytest.approx(2 / 3)
    for m in out.values():
        assert m["lo"] <= m["value"] <= m["hi"]
    table = ev.format_table({"math500": out, "aime24": {"mean@4": out["mean@4"]}})
    assert "math500" in table and "50.00" in table and table.count("\n") == 2


def test_bad_input():
    with pytest.raises(ValueError, match="k must be in"):
        ev.pass_at_k_per_problem(np.ones((2, 3)), 4)
    with pytest.raises(ValueError, match="non-empty"):
        ev.pass_at_k_per_problem(np.ones((0, 3)), 1)
    with pytest.raises(ValueError, match="answers must be"):
        ev.maj_at_k_per_problem(np.ones((2, 3)), [["a"] * 3], 1)


def _tiny_policy_folder(path):
    """A random tiny Llama HF checkpoint with the word-level test tokenizer, saved to `path`."""
    import jax
    from data_test import save_tiny_tokenizer

    from ebpo_jax import models
    from ebpo_jax.data import load_tokenizer

    save_tiny_tokenizer(path)
    mc = models.get_config(
        "tiny",
        vocab_size=len(load_tokenizer(str(path))),
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    models.to_hf(mc, models.init_params(mc, jax.random.key(0)), str(path))
    return str(path)


@pytest.mark.slow  # compiles the sampler and starts reward workers; runs both scripts
def test_eval_and_difficulty_scripts(tmp_path):
    import json
    import subprocess
    import sys

    model = _tiny_policy_folder(tmp_path / "policy")
    bench = tmp_path / "bench.jsonl"
    rows = [
        {"problem": "what is one plus two", "answer": "3"},
        {"problem": "solve for x", "answer": "5"},
    ]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"--model={model}", "--max_new_tokens=4", "--max_prompt_len=24", "--template=plain"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "eval.json"
    subprocess.run(
        [
            sys.executable,
            "experiments/eval.py",
            *common,
            f"--benchmarks=b1:aime2024:{bench}",
            "--k=4",
            "--workers=1",
            f"--out={out}",
        ],
        cwd=root,
        env=env,
        check=True,
        timeout=600,
    )
    res = json.loads(out.read_text())["b1"]
    assert set(res) == {"mean@4", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4"}
    for m in res.values():
        assert 0 <= m["lo"] <= m["value"] <= m["hi"] <= 1
    diff = tmp_path / "diff.jsonl"
    subprocess.run(
        [
            sys.executable,
            "experiments/estimate_difficulty.py",
            *common,
            f"--data={bench}",
            "--schema=aime2024",
            "--n=2",
            f"--out={diff}",
        ],
        cwd=root,
        env=env,
        check=True,
        timeout=600,
    )
    from ebpo_jax.data import load_records

    recs = load_records(str(diff), "record")
    rates = [json.loads(line)["pass_rate"] for line in diff.read_text().splitlines()]
    assert [r.prompt for r in recs] == [r["problem"] for r in rows]
    assert [r.difficulty for r in recs] == [1 - p for p in rates]


@pytest.mark.slow  # compiles the sampler
def test_sample_responses_and_score(tmp_path):
    from ebpo_jax.data import Record
    from ebpo_jax.evaluation import policy as policy_eval

    mc, params, tok = policy_eval.load_policy(_tiny_policy_folder(tmp_path / "policy"))
    records = [Record("what is one plus two", "3", "a"), Record("solve for x", "5", "b")] * 2
    kw = {"num_samples": 3, "max_new_tokens": 4, "max_prompt_len": 24, "batch_size": 3}
    kw |= {"template": "plain", "seed": 1}
    spec = policy_eval.ResponseSpec(**kw)
    a = policy_eval.sample_responses(mc, params, tok, records, spec)
    b = policy_eval.sample_responses(mc, params, tok, records, spec)
    assert a == b and len(a) == 4 and all(len(r) == 3 for r in a)
    assert a[0] != a[2] or a[1] != a[3]  # each chunk and row has its own randomness
    correct, _, _ = policy_eval.score_responses(records, a)
    assert correct.shape == (4, 3)


def test_evaluate_benchmark_scores_with_its_scoring():
    from ebpo_jax.data import Record
    from ebpo_jax.evaluation import policy as policy_eval

    records = [Record("1+1", "2", "a"), Record("2+2", "4", "b")]
    responses = [["Answer: 2", "Answer: 3"], ["Answer: 4", "Answer: four"]]
    scoring = policy_eval.Scoring(reward="answer_match", workers=1)
    out = policy_eval.evaluate_benchmark(records, responses, scoring=scoring, num_resamples=10)
    assert out["mean@2"]["value"] == 0.5 and out["pass@2"]["value"] == 1.0
