"""Multi-turn training end to end (guess family, micro-sized): metrics, samples with turns
marked, and a resumed run equal to an uninterrupted one."""

import json
import os

import jax
import numpy as np
import pytest

from configs import micro
from ebpo_jax.runtime.checkpoint import load_params
from ebpo_jax.trainer import loop


def _config(workdir):
    c = micro.get_config()
    c.unlock()
    c.workdir = str(workdir)
    c.task.family, c.task.topics, c.task.max_difficulty = "guess", "", 1
    c.task.train_per_cell, c.task.test_per_cell = 10, 2
    c.total_steps, c.checkpoint_every, c.eval_every = 4, 2, 2
    c.sampler.max_new_tokens = 12
    c.rollout.max_turns, c.rollout.turn_tokens, c.rollout.env_workers = 3, 4, 1
    c.model.overrides.max_position_embeddings = 32
    c.log_samples_every = 1
    c.mesh.shape = (-1,)
    return c


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "phase/"))} for r in rows]


@pytest.mark.slow  # three short multi-turn runs, each compiling its sampler and update
def test_multiturn_resume_equals_uninterrupted(tmp_path):
    loop.train(_config(tmp_path / "full"), log=lambda *_: None)
    first = loop.train(_config(tmp_path / "resumed"), log=lambda *_: None, stop_after=3)
    assert first["step"] == 3 and first["stopped_early"]
    resumed = loop.train(_config(tmp_path / "resumed"), log=lambda *_: None)
    assert resumed["step"] == 4 and resumed["resumed_from"] == 3
    full = _rows(tmp_path / "full")
    assert full == _rows(tmp_path / "resumed")
    assert all(r["episode/turns_mean"] >= 1 for r in full[1:])
    assert any(0 < r["episode/observation_token_share"] < 1 for r in full[1:])
    assert all(r["episode/forward_token_ratio"] <= 1.0 for r in full[1:])  # KV kept
    a, b = (load_params(str(tmp_path / n)) for n in ("full", "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    lines = (tmp_path / "full" / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(x) for x in lines]
    assert any("[[obs: " in s["completion"] for s in samples)
