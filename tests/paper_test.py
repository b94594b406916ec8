"""configs/paper.py: every headline cell resolves to its recipe; experiments/paper_table.py."""

import os

import pytest

from ebpo_jax.config import ConfigError, load_sibling, validate
from ebpo_jax.spec import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
paper = load_sibling(os.path.join(ROOT, "configs", "x.py"), "paper.py")
pod = load_sibling(os.path.join(ROOT, "configs", "x.py"), "qwen3_8b.py")


def test_the_table_has_every_cell_with_a_paper_number():
    assert len(paper.CELLS) == len(set(paper.CELLS)) == 15 + 9
    for model, method, g in paper.CELLS:
        assert method == "clip_cov" or method in paper.PASS1[(model, g)]


@pytest.mark.parametrize("cell", paper.CELLS, ids=str)
def test_each_cell_is_its_pod_recipe_with_the_methods_bundle(cell):
    model, method, g = cell
    c = paper.get_config(paper.cell_name(*cell) + ",aot")
    validate(c, 32)
    spec = resolve(c, 32)
    base = resolve(pod.recipe(paper.MODELS[model], "aot"), 32)
    assert spec.task.model == base.task.model  # the pod config's model, not a copy
    assert spec.rollout.group_size == g and spec.rollout.prompts == 512
    assert spec.rollout.prompts_per_call * g == 2048  # one call's rows as at G=4
    assert spec.update.loss.num_microbatches * 32 == 128 * g  # a row per chip
    est = {"dr_grpo": "dr_grpo", "ebpo": "ebpo"}.get(method, "grpo")
    assert spec.run.estimator == est
    assert spec.update.loss.name == ("clip_cov" if method == "clip_cov" else "ppo")
    dapo = method == "dapo"
    assert spec.rollout.dapo.dynamic_sampling == dapo
    assert spec.rollout.batch_prompts == 512 * (3 if dapo else 1)
    assert spec.update.loss.clip_high == (0.28 if dapo else 0.2)
    assert spec.update.dapo.overlong_buffer == (1638 if dapo else 0)
    agg = "seq-mean-token-sum-norm" if method == "dr_grpo" else "token-mean"
    assert spec.update.loss.agg == agg
    assert bool(spec.update.estimator_options.per_batch) == (method == "ebpo")  # authors' code
    assert spec.task.task.order == ("topic" if method == "ebpo" else "naive")


def test_bad_cells_are_one_line_errors():
    for bad in ("qwen3_8b,ppo,g4", "qwen3_8b,grpo,g5", "qwen3_8b,qwen3_14b"):
        with pytest.raises(ConfigError, match="configs/paper.py:") as e:
            paper.get_config(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'paper' is an EBPO variant"):
        paper.get_config("qwen3_8b,grpo,g4,paper")
    assert paper.parse("") == ("qwen3_8b", "ebpo", 4, [])


def _report(decode_gib: float, memo: str = "compiled"):
    """A v5p report of an update (4 GiB of train state) and a decode of `decode_gib`."""
    from ebpo_jax.pods.aot_report import ProgramReport

    G = 2**30
    return [
        ProgramReport("train update", "fsdp=32", 4 * G, 4 * G, 4 * G, 9 * G, 0, 95 * G, 1, 1),
        ProgramReport("sampler decode", "data=4 x tp=8", G, G, 0, decode_gib * G - 2 * G, 0,
                      95 * G, 1, 1, memo=memo),
    ]  # fmt: skip


def test_paper_table_reads_a_cells_programs_with_the_train_state_resident():
    from conftest import load_experiment

    table = load_experiment("paper_table")
    assert table._compiled(None) == ("pending", "-", "-")
    # The decode's 50 GiB peak plus the update's 4 GiB of arguments, resident while it runs.
    assert table._compiled(_report(50.0, "reused from x.json")) == (
        "1 compiled, 1 reused",
        "54.0 / 95 (sampler decode)",
        "yes",
    )
    assert table._compiled(_report(92.0)) == (
        "all compiled",
        "96.0 / 95 (sampler decode)",
        "**NO**",
    )


@pytest.mark.slow  # ~30 s loaded: libtpu's v5p-64 topology for the estimate
def test_paper_table_prints_a_cells_estimate_and_its_report(capsys, tmp_path):
    from conftest import load_experiment

    from ebpo_jax.pods import aot_report

    aot_report.write_json(str(tmp_path / "qwen3_8b_grpo_g4.json"), _report(50.0))
    table = load_experiment("paper_table")
    cells = ["--cell=qwen3_8b,dapo,g4", "--cell=qwen3_8b,grpo,g4"]
    table.flags.FLAGS(["paper_table", *cells, f"--reports={tmp_path}"])
    table.main([])
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| `qwen3_8b,dapo,g4` | 52.63 | pending | - | - |")
    assert out[2].endswith("| 2 |")
    assert out[3].startswith("| `qwen3_8b,grpo,g4` | 58.72 | all compiled | 54.0 / 95 (sampler")
    assert out[3].endswith("| 1 |")


@pytest.mark.parametrize("preset", ["qwen3_8b", "llama3_1_8b", "qwen3_14b", "qwen3_30b_a3b"])
def test_the_int8_variant_samples_int8_on_its_layout(preset):
    c = pod.recipe(preset, "aot,int8")
    validate(c, 32)
    s = resolve(c, 32).rollout.sampler
    assert (s.kv_dtype, s.param_dtype) == ("int8", "int8")
    mesh, dp, pages = pod.INT8_LAYOUT.get(preset, pod.SAMPLER_LAYOUT[preset])
    assert (c.sampler.mesh, c.sampler.dp_attention) == (mesh, dp)
    assert c.sampler.kv_pages == (32 if dp else 8) * pages  # pages per row shard
    assert s.expert_parallel == (preset == "qwen3_30b_a3b")  # its experts over the data shards
