"""experiments/eval.py --workdir: a run's checkpoint on its own task's held-out sets, per set
pass@k with intervals, for every task family; the same draws as the training-time eval."""

import os

import numpy as np
import pytest

from configs import micro
from ebpo_jax.ablation.grid import load_config_file
from ebpo_jax.runtime.checkpoint import Checkpointer
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task, mean_pass
from ebpo_jax.trainer import run_eval

SMALL_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2}


def _saved_run(c, workdir, steps=(2, 4)):
    """A run folder: config.json and checkpoints of the initial params at `steps`."""
    c.workdir, c.mesh.devices = str(workdir), 1
    os.makedirs(workdir, exist_ok=True)
    (workdir / "config.json").write_text(c.to_json(indent=2))
    task = build_task(resolve(c, 1).task, log=lambda *_: None)
    with Checkpointer(str(workdir / "checkpoints"), save_every=1) as ckpt:
        for s in steps:
            ckpt.save(s, {"params": task.params}, {})
    return task


def _micro():
    c = micro.get_config()
    c.unlock()
    return c


def _reasoning():
    c = load_config_file("configs/reasoning.py")
    c.unlock()
    c.model.overrides.update(SMALL_MODEL)
    c.sft.steps, c.task.test_per_cell, c.eval_samples = 0, 2, 2
    return c


def _check(c, tmp_path, step=None):
    task = _saved_run(c, tmp_path)
    try:
        want = task.evaluate(task.params)  # what training logs as eval/pass@1
    finally:
        task.close()
    results, out = run_eval.evaluate_run(os.path.relpath(tmp_path), step=step)  # as typed
    assert out == str(tmp_path / f"eval_step{step or 4}.json") and os.path.exists(out)
    assert set(results) == set(want)
    k = c.eval_samples
    for name, r in results.items():
        assert r[f"mean@{k}"]["value"] == pytest.approx(want[name], abs=1e-9)
        assert r["pass@1"]["value"] == pytest.approx(want[name], abs=1e-9)
        assert r[f"pass@{k}"]["value"] >= r["pass@1"]["value"]
        assert r["pass@1"]["lo"] <= r["pass@1"]["value"] <= r["pass@1"]["hi"]
    return mean_pass(want)


def test_arithmetic_run_latest_and_given_step(tmp_path):
    _check(_micro(), tmp_path, step=2)
    with pytest.raises(ConfigError, match=r"--step=3: .* holds steps \[2, 4\]"):
        run_eval.evaluate_run(str(tmp_path), step=3)
    with pytest.raises(ConfigError, match="config.json does not exist"):
        run_eval.evaluate_run(str(tmp_path / "nope"))


@pytest.mark.slow  # builds the reasoning task and compiles its sampler: ~20 s
def test_reasoning_run(tmp_path):
    assert np.isfinite(_check(_reasoning(), tmp_path))


@pytest.mark.slow  # an HF tokenizer, math-verify workers: ~30 s
def test_math_run(tmp_path, files):  # noqa: F811  (the fixture imported below)
    c = _math_config(files, tmp_path / "w")
    c.mesh.shape = (1,)
    assert np.isfinite(_check(c, tmp_path / "w"))


from train_math_test import _config as _math_config
from train_math_test import files  # noqa: F401  (the math records fixture)
