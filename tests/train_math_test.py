"""train() on math records from the config: tiny random policy, HF tokenizer, math_reward, resume."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import save_tiny_tokenizer

from ebpo_jax import models, rewards
from ebpo_jax.config import ConfigError, default_config, validate
from ebpo_jax.runtime.checkpoint import Checkpointer, load_params
from ebpo_jax.runtime.metrics import METRIC_NAMES, read_metrics
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task as _build_task
from ebpo_jax.trainer import loop

NUMBERS = [str(i) for i in range(19)]
# A one-layer policy: seconds to compile on a CPU.
MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 32,
}


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _problems(pairs, topic_of):
    return [
        {
            "problem": f"what is {a} plus {b}",
            "answer": str(a + b),
            "subject": topic_of(a, b),
            "level": 1,
            "unique_id": f"p{a}_{b}",
        }
        for a, b in pairs
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tokenizer folder, 16-record train file with two topics, 4-record eval file)."""
    root = tmp_path_factory.mktemp("math")
    tok = save_tiny_tokenizer(root / "tok", extra_words=NUMBERS)
    train = [(a, b) for a in range(1, 9) for b in (1, 2)]
    topic = lambda a, b: "small" if a <= 4 else "large"
    data = _write_jsonl(root / "train.jsonl", _problems(train, topic))
    evals = _write_jsonl(root / "eval.jsonl", _problems([(2, 5), (3, 6), (7, 7), (9, 9)], topic))
    return tok, data, evals


def build_task(c, log):
    return _build_task(resolve(c).task, log=log)


def _config(files, workdir, **overrides):
    tok, data, evals = files
    c = default_config()
    c.workdir = str(workdir)
    c.total_steps, c.checkpoint_every, c.eval_every = 4, 2, 2
    c.prompts_per_step, c.group_size = 4, 4
    c.eb_clusters = "topic"
    c.eval_samples, c.eval_batch_size = 2, 4
    c.optimizer.learning_rate = 1e-2
    c.sampler.max_new_tokens = 6
    c.mesh.shape = (-1,)  # the loop insists the mesh covers every (fake) device
    c.model.tokenizer_path = tok
    c.model.overrides.update(MODEL)
    c.data.path, c.data.schema, c.data.eval_path = data, "math500", evals
    c.data.template, c.data.max_prompt_len = "plain", 12
    c.data.order, c.data.reward, c.data.reward_workers = "topic", "math", 1
    c.update_from_flattened_dict(overrides)
    return c


def _quiet(*_):
    pass


def _rows(workdir):
    return [
        {k: v for k, v in r.items() if not k.startswith(("perf/", "phase/")) or "total" in k}
        for r in read_metrics(str(workdir))
    ]


def test_train_on_math_records(files, tmp_path):
    """train() on 16 math records with math_reward and topic priors, stopped after 2 of 4 steps."""
    logs = []
    s = loop.train(_config(files, tmp_path), log=logs.append, stop_after=2)
    assert s["step"] == 2 and s["stopped_early"] and s["resumed_from"] is None
    assert not rewards._POOLS, "train() must stop its reward workers"
    assert any("data: 16 prompts" in line for line in logs)
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert not set(METRIC_NAMES) - {"eval/pass@1"} - set(row)
        # Rewards are 0/1 (math_reward), so a step's mean over P*G = 16 samples is k/16.
        assert row["reward/mean"] * 16 == pytest.approx(round(row["reward/mean"] * 16), abs=1e-4)
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [0, 2]
    assert all(0 <= r["eval/pass@1"] <= 1 for r in rows if "eval/pass@1" in r)
    assert s["pass@1_start"] == rows[0]["eval/pass@1"]

    # The checkpoint holds the data position: two batches of a fresh source read.
    with Checkpointer(os.path.join(tmp_path, "checkpoints")) as ckpt:
        state, extra = ckpt.restore()
    task = build_task(_config(files, tmp_path), log=_quiet)
    assert task.num_clusters == 2 and task.source.topic_names == ("large", "small")
    (topic,) = set(task.source.next_batches(2).topic_ids.ravel().tolist())  # topic order
    assert extra["data"] == task.source.state()
    # One EB prior per topic: both steps' P x G rewards went to this topic's accumulator.
    counts = np.asarray(state["eb_state"]["reward"]["count"])
    assert counts.tolist() == [2 * 4 * 4 if k == topic else 0 for k in range(2)]
    params0 = models.init_params(task.model_config, jax.random.key(0))
    pairs = list(zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params0), strict=True))
    assert all(np.shape(a) == np.shape(b) for a, b in pairs)
    assert max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in pairs) > 0


@pytest.mark.slow  # three short runs, each compiling its own sampler, update and eval
def test_resumed_math_run_equals_uninterrupted(files, tmp_path):
    loop.train(_config(files, tmp_path / "full"), log=_quiet)
    c = _config(files, tmp_path / "resumed")
    loop.train(c, log=_quiet, stop_after=3)
    s = loop.train(c, log=_quiet)
    assert s["step"] == 4 and s["resumed_from"] == 3 and not rewards._POOLS
    assert _rows(tmp_path / "full") == _rows(tmp_path / "resumed")
    a, b = (load_params(str(tmp_path / n)) for n in ("full", "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    with Checkpointer(os.path.join(tmp_path / "resumed", "checkpoints")) as ckpt:
        _, extra = ckpt.restore()
    source = build_task(c, log=_quiet).source
    source.next_batches(4)
    assert extra["data"] == source.state()


@pytest.mark.slow  # two short runs
def test_math_run_without_eval_path_writes_no_eval(files, tmp_path):
    c = _config(files, tmp_path, **{"data.eval_path": ""})
    assert loop.train(c, log=_quiet, stop_after=1)["step"] == 1
    s = loop.train(c, log=_quiet)
    assert s["step"] == 4 and s["resumed_from"] == 1
    assert np.isnan(s["pass@1_start"]) and np.isnan(s["pass@1_end"])
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not any("eval/pass@1" in r for r in rows)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("data.path", "/nonexistent/dapo.parquet", "data.path='/nonexistent/dapo.parquet'"),
        ("data.eval_path", "math500:/nope.jsonl", "data.eval_path entry '/nope.jsonl'"),
        ("data.order", "bogus", "data.order='bogus' unknown"),
        ("data.reward", "nope", "data.reward: unknown reward 'nope'"),
        ("eb_clusters", "cell", "eb_clusters='cell' needs the synthetic tasks"),
        ("sft.steps", 5, "sft.steps=5"),
        ("model.tokenizer_path", "", "needs a tokenizer: set model.hf_path"),
        ("model.hf_path", "/nonexistent", "model.hf_path='/nonexistent' is not an HF checkpoint"),
    ],
)
def test_bad_math_config_is_a_one_line_error(files, tmp_path, field, value, message):
    c = _config(files, tmp_path / "run", **{field: value})
    with pytest.raises(ConfigError, match=message) as e:
        validate(c, jax.device_count())
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=message):
        loop.train(c, log=_quiet)
    assert not os.path.exists(tmp_path / "run")  # nothing written, nothing compiled


def test_math_only_fields_need_data_path(files, tmp_path):
    c = _config(files, tmp_path, **{"data.path": ""})
    with pytest.raises(ConfigError, match="need data.path"):
        validate(c)
    c = _config(files, tmp_path, steps_per_jit=2, total_steps=4, eval_every=2)
    with pytest.raises(ConfigError, match="steps_per_jit=2: data.path is scored by a host"):
        validate(c)


def test_hf_checkpoint_task_loads_weights_and_refuses_shape_overrides(files, tmp_path):
    """model.hf_path: weights and tokenizer from the folder; only non-shape overrides apply."""
    from ebpo_jax.data import load_tokenizer

    tok = load_tokenizer(files[0])
    mc = models.get_config("tiny", vocab_size=len(tok), **MODEL)
    params = models.init_params(mc, jax.random.key(7))
    ckpt = str(tmp_path / "ckpt")
    models.to_hf(mc, params, ckpt)
    tok.save_pretrained(ckpt)
    c = _config(files, tmp_path / "run", **{"model.tokenizer_path": "", "model.hf_path": ckpt})
    c.model.overrides = {"remat": "full"}
    task = build_task(c, log=_quiet)
    assert task.model_config == mc.replace(remat="full")
    jax.tree.map(np.testing.assert_array_equal, task.params, params)
    assert task.stop_ids == (tok.eos_token_id,) and task.evaluate is not None
    c.model.overrides = {"num_layers": 2}
    with pytest.raises(ConfigError, match="model.overrides.num_layers=2 differs"):
        build_task(c, log=_quiet)
    c.model.overrides, c.data.max_prompt_len = {}, 30
    with pytest.raises(ConfigError, match="need 36 positions, the model has 32"):
        build_task(c, log=_quiet)


def test_splash_widths_are_checked_before_any_compile(files, tmp_path):
    """The kernel's blocks: prompt width and row width <= 512 or multiples of 512."""
    c = _config(files, tmp_path / "run")
    c.model.overrides.update({"attention": "splash", "max_position_embeddings": 2048})
    c.data.max_prompt_len, c.sampler.max_new_tokens = 1024, 100
    with pytest.raises(ConfigError, match="max_new_tokens = 1124: attention 'splash' needs"):
        build_task(c, log=_quiet)
    c.data.max_prompt_len = 600
    with pytest.raises(ConfigError, match="data.max_prompt_len = 600: attention 'splash'"):
        build_task(c, log=_quiet)


def test_reward_workers_stop_when_training_raises(files, tmp_path, monkeypatch):
    def failing_run(*_):
        rewards.default_pool(1)  # as the first eval's scoring would start it
        raise RuntimeError("step failed")

    monkeypatch.setattr(loop, "_run", failing_run)
    with pytest.raises(RuntimeError, match="step failed"):
        loop.train(_config(files, tmp_path), log=_quiet)
    assert not rewards._POOLS
