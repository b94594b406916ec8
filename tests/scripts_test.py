"""Every script in benchmarks/ and experiments/ runs: one smoke run each at its smallest sizes.

Scripts with absl flags run in their own process (two of them defining one flag name would
clash in this one); the rest are imported and their main() called here. The figures they
print mean nothing at these sizes. Scripts with their own test files are listed in
SCRIPT_TESTS, and a new script without a test fails test_every_script_has_a_smoke_test.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Script -> the test file that runs it in the default suite (this file: "scripts_test").
SCRIPT_TESTS = {
    "benchmarks/advantage_bench.py": "scripts_test",
    "benchmarks/batch_invariant_bench.py": "scripts_test",
    "benchmarks/executor_bench.py": "ray_executor_test",
    "benchmarks/async_bench.py": "scripts_test",
    "benchmarks/lora_bench.py": "scripts_test",
    "benchmarks/packed_bench.py": "scripts_test",
    "benchmarks/rollout_bench.py": "scripts_test",
    "benchmarks/sampler_bench.py": "scripts_test",
    "benchmarks/storage_bench.py": "storage_test",
    "benchmarks/train_bench.py": "scripts_test",
    "benchmarks/on_policy_bench.py": "exact_on_policy_test",
    "experiments/ablate.py": "ablate_test",
    "experiments/launch.py": "ray_executor_test",
    "experiments/aot_compile.py": "aot_test",
    "experiments/claims.py": "claims_test",
    "experiments/cluster_topics.py": "scripts_test",
    "experiments/context_balance.py": "context_parallel_test",
    "experiments/convert_hf.py": "hf_test",
    "experiments/estimate_check.py": "estimate_check_test",
    "experiments/estimate_difficulty.py": "scripts_test",
    "experiments/eval.py": "first_hour_test",  # --help; its --workdir path: run_eval_test
    "experiments/gpu_check.py": "scripts_test",
    "experiments/paper_table.py": "paper_test",
    "experiments/plot_run.py": "plot_run_test",
    "experiments/reasoning_run.py": "scripts_test",
    "experiments/theory_mse.py": "theory_mse_test",
    "experiments/train.py": "train_cli_test",
}


def test_every_script_has_a_smoke_test():
    scripts = {
        f"{folder}/{name}"
        for folder in ("benchmarks", "experiments")
        for name in os.listdir(os.path.join(ROOT, folder))
        if name.endswith(".py")
    }
    assert scripts == set(SCRIPT_TESTS)
    for script, test in SCRIPT_TESTS.items():
        with open(os.path.join(ROOT, "tests", f"{test}.py")) as f:
            assert os.path.basename(script)[:-3] in f.read(), f"{test}.py does not name {script}"


def _load(path: str):
    """benchmarks/x.py or experiments/x.py as a module, once per process."""
    name = "script_" + os.path.basename(path)[:-3]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _run(*args: str) -> str:
    """stdout of `python args` from the repository root; fails with its stderr."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    run = subprocess.run(
        [sys.executable, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_advantage_bench(capsys):
    _load("benchmarks/advantage_bench.py").main(["--repeats=1", "--P=8", "--G=4"])
    assert "ebpo/grpo" in capsys.readouterr().out


def test_batch_invariant_bench(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # it imports advantage_bench
    _load("benchmarks/batch_invariant_bench.py").main(["--rows=2", "--len=8", "--repeats=1"])
    assert "on / off time" in capsys.readouterr().out


def test_train_bench_default_sizes_resolve_and_a_tiny_run(capsys):
    bench = _load("benchmarks/train_bench.py")
    mc, *_ = bench.jax_setup(bench.parse([]))  # was: ConfigError on the model's positions
    assert mc.max_position_embeddings == 16 + 48
    tiny = "--hidden=64 --layers=1 --vocab=64 --prompts=2 --group=2 --prompt_len=4"
    bench.main([*tiny.split(), "--new_tokens=4", "--runs=1", "--matmul_n=64"])
    assert "ratio jax/torch" in capsys.readouterr().out


def test_lora_bench(capsys):
    tiny = "--hidden=32 --mlp=64 --layers=1 --vocab=64 --rank=2 --prompts=2 --group=2"
    _load("benchmarks/lora_bench.py").main(
        [*tiny.split(), "--prompt_len=4", "--new_tokens=2", "--runs=1"]
    )
    assert "LoRA / full" in capsys.readouterr().out


def test_packed_bench(capsys):
    _load("benchmarks/packed_bench.py").main(["--smoke"])
    assert "packed" in capsys.readouterr().out


def test_rollout_bench(capsys):
    _load("benchmarks/rollout_bench.py").main(["--smoke"])
    out = capsys.readouterr().out
    assert "paged attention" in out and "old attention" in out


@pytest.mark.slow
def test_rollout_bench_old_engine_still_runs():
    """Parts tail and tiny run the previous engine out of git against today's models: its
    greedy tokens equal the paged engine's (a models API change once broke it silently)."""
    import jax

    from ebpo_jax import models, sampler

    bench = _load("benchmarks/rollout_bench.py")
    found = subprocess.run(["git", "cat-file", "-e", bench.OLD_REF], cwd=ROOT, check=False)
    if found.returncode:
        pytest.skip(f"no git history with {bench.OLD_REF} here")
    old = bench.old_engine(bench.OLD_REF)
    config = models.get_config("tiny")
    params = models.init_params(config, jax.random.key(0))
    tokens = np.array([[5, 6, 7, 8], [9, 10, 11, 0]], np.int32)
    lengths = np.array([4, 3], np.int32)
    key = jax.random.key(1)
    gen_old, _ = old._generate_with_stats(
        config, params, tokens, lengths, max_new_tokens=5, rng=key, num_samples=2, slots=2
    )
    spec = sampler.SamplerSpec(5, num_samples=2, slots=2)
    gen_new = sampler.generate(config, params, tokens, lengths, spec, rng=key)
    np.testing.assert_array_equal(gen_old.tokens, gen_new.tokens)


def test_sampler_bench(capsys):
    _load("benchmarks/sampler_bench.py").main(["--smoke"])
    assert "token agreement with HF" in capsys.readouterr().out


def test_async_bench_configs_resolve(tmp_path, monkeypatch):
    """Its runs train twice for minutes; here its two configs resolve on 8 devices."""
    from ebpo_jax.spec import resolve

    monkeypatch.setattr(os, "environ", dict(os.environ))  # it sets XLA flags on import
    bench = _load("benchmarks/async_bench.py")
    for staleness in (0, 1):
        spec = resolve(bench.config(str(tmp_path), staleness, 3), 8)
        assert spec.mesh.mesh.devices == 4


def test_gpu_check_cpu_checks(capsys):
    """Its CPU-side checks (a GPU session runs the whole script): sampler == forward, and the
    GPU-only ones skip."""
    check = _load("experiments/gpu_check.py")
    check.check("sampler == forward")(check.sampler_equals_forward)
    check.check("cuDNN vs XLA")(check.cudnn_update_vs_xla)
    out = capsys.readouterr().out
    assert "OK    sampler == forward" in out and "SKIP  cuDNN vs XLA" in out


def test_cluster_topics(tmp_path):
    """The script's plumbing with a stand-in embedding (the MiniLM model is an extra)."""
    data = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"problem {i}", "answer": str(i)} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "topics.jsonl"
    code = (
        "import functools, runpy, sys; import numpy as np; import ebpo_jax.data as d\n"
        "embed = lambda texts: np.array([[len(t), t.count('1')] for t in texts], float)\n"
        "d.cluster_texts = functools.partial(d.cluster_texts, embed=embed)\n"
        f"sys.argv = ['cluster_topics.py', '--data={data}', '--k=2', '--out={out}']\n"
        "runpy.run_path('experiments/cluster_topics.py', run_name='__main__')\n"
    )
    _run("-c", code)
    topics = [json.loads(line)["topic"] for line in out.read_text().splitlines()]
    assert len(topics) == 6 and set(topics) <= {"0", "1"}


def test_estimate_difficulty(tmp_path):
    from evaluation_test import _tiny_policy_folder

    model = _tiny_policy_folder(tmp_path / "policy")
    data = tmp_path / "bench.jsonl"
    data.write_text(json.dumps({"problem": "what is one plus two", "answer": "3"}) + "\n")
    out = tmp_path / "diff.jsonl"
    flags = [f"--model={model}", f"--data={data}", "--schema=aime2024", f"--out={out}"]
    flags += ["--n=1", "--max_new_tokens=2", "--max_prompt_len=24", "--template=plain"]
    _run("experiments/estimate_difficulty.py", *flags)
    assert json.loads(out.read_text())["pass_rate"] in (0.0, 1.0)


def test_reasoning_run():
    flags = ["--config.sft.steps=0", "--config.task.test_per_cell=1", "--config.eval_samples=1"]
    flags += ["--config.sampler.max_new_tokens=4", "--config.task.train_per_cell=8"]
    stats = json.loads(_run("experiments/reasoning_run.py", *flags))
    assert 0.0 <= stats["pass@1"] <= 1.0 and np.isfinite(stats["sampled_length_mean"])
