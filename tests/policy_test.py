"""The policy view: the same questions answered for full fine-tuning and LoRA, and the
runners' checkpoint entries (the stale pipeline owns its in-flight rollout)."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from ebpo_jax import config as config_lib
from ebpo_jax import models
from ebpo_jax.models import lora
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.trainer import pipeline, runners
from ebpo_jax.trainer.policy import Policy

CFG = models.get_config("tiny_qwen3")
SPEC = lora.LoraSpec(4, 8.0, tuple(lora.TARGETS))


@functools.cache
def _states():
    """Abstract params and step-0 states (shapes only: the view's answers are placements)."""
    params = models.abstract_params(CFG)
    full, lo = Policy(CFG, with_ref=True), Policy(CFG, lora=SPEC)
    init = lambda view: jax.eval_shape(lambda p: view.init(p, optax.adamw(1e-3), seed=0), params)
    return params, (full, init(full)), (lo, init(lo))


def _shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


def _model_section(rank):
    c = config_lib.default_config()
    c.model.preset = "tiny_qwen3"
    c.model.lora.rank = rank
    return c.model


def test_full_fine_tuning_trains_the_params_against_a_frozen_copy():
    params, (view, state), _ = _states()
    assert not view.is_lora and state.base is None
    assert view.trained(state) is state.params and view.frozen(state) is state.ref_params
    assert _shapes(state.ref_params) == _shapes(params)
    assert view.forward_params(state.params, state.ref_params) is state.params
    assert view.sampled(state) is state.params
    assert view.abstract_sampled(state) is state.params
    assert set(state.saved()) == set(state._fields) - {"base"}
    assert view.checkpoint_extra(_model_section(0), "src") == {}
    view.check_checkpoint({}, {})
    lora_extra = Policy(CFG, lora=SPEC).checkpoint_extra(_model_section(4), "src")
    with pytest.raises(config_lib.ConfigError, match="holds LoRA adapters"):
        view.check_checkpoint(lora_extra, {})


def test_lora_trains_adapters_on_a_frozen_base_that_is_the_reference():
    params, _, (view, state) = _states()
    assert view.is_lora and state.ref_params is None
    assert view.frozen(state) is state.base  # the KL reference: the base, adapters off
    assert view.trained(state) is state.params  # the adapters
    fwd = view.forward_params(state.params, state.base)
    want = lora.attach(state.base, state.params, SPEC)
    assert jax.tree.structure(fwd) == jax.tree.structure(want)
    # The sampler runs base + A B merged in the compute dtype: full-model weights.
    merged = jax.eval_shape(view.sampled, state)
    assert _shapes(merged) == _shapes(view.abstract_sampled(state)) == _shapes(params)
    tree = state.saved()
    assert "base" not in tree and "ref_params" not in tree
    model = _model_section(4)
    extra = view.checkpoint_extra(model, "src")
    view.check_checkpoint(extra, extra)
    with pytest.raises(config_lib.ConfigError, match="source"):
        view.check_checkpoint(extra, view.checkpoint_extra(model, "other"))
    with pytest.raises(config_lib.ConfigError, match="does not match"):
        view.check_checkpoint({}, extra)  # a full checkpoint under LoRA


def _rollout(tag: float) -> Rollout:
    z = jnp.zeros((1, 1), jnp.int32)
    return Rollout(*([jnp.full((1,), tag)] * 13), action_mask=z)


class _Pieces:
    """Stand-in for step.Pieces: records the calls, rollouts tagged by their batch."""

    sh = update = view = None
    policy = place = staticmethod(lambda x: x)

    def __init__(self):
        self.calls = []

    def rollout_from(self, state, batch, stream):
        self.calls.append(("sample", float(batch), stream))
        return _rollout(float(batch))

    def finish(self, ro):
        return ro

    def run_update(self, state, ro):
        self.calls.append(("update", float(ro.rewards[0])))
        return state + 1, {"m": jnp.zeros(())}


def test_pipeline_owns_its_inflight_rollout_and_checkpoint_entry():
    pieces, batches = _Pieces(), iter(range(10))
    next_batches = lambda: jnp.full((1,), float(next(batches)))
    run = pipeline.Pipeline(pieces, total_steps=2)
    state, m, times = run(jnp.int32(0), 0, next_batches)
    # Step 0: rollout 0 first (key stream 1), then rollout 1 (stream 2) beside update 0.
    assert pieces.calls == [("sample", 0.0, 1), ("sample", 1.0, 2), ("update", 0.0)]
    assert m["m"].shape == (1,) and "perf/overlap_s" in times
    entries = run.checkpoint_entries()
    assert float(entries[pipeline.INFLIGHT]["rewards"][0]) == 1.0
    # A resume hands the saved rollout back; the last step samples nothing more.
    resumed, pieces.calls = pipeline.Pipeline(pieces, total_steps=2), []
    resumed.restored({"params": 0, **entries})
    resumed(state, 1, next_batches)
    assert pieces.calls == [("update", 1.0)] and resumed.checkpoint_entries() == {}
    with pytest.raises(config_lib.ConfigError, match="resume with rollout.max_staleness=1"):
        runners.HostRunner(pieces).restore_targets(entries, "ckpt")
    assert runners.HostRunner(pieces).restore_targets({"params": 0}, "ckpt") == {}
