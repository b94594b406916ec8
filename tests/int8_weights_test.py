"""sampler.param_dtype="int8": the quantized weights against a float64 reference, the int8
sampler's log-probs and greedy tokens against float32's, the forward of a mixed MoE, and a
micro run whose mismatch metrics show the gap while it trains."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ebpo_jax import models, sampler
from ebpo_jax.models import quantize
from ebpo_jax.schema import ConfigError
from ebpo_jax.trainer import loop
from tests.helpers import micro_config

CONFIG = models.get_config("tiny")
PROMPTS = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 77, 77, 77], [14, 15, 16, 17, 18, 77]])
LENGTHS = np.array([6, 3, 5], np.int32)
N = 8
_int8 = jax.jit(quantize.int8_weights, static_argnums=1)  # eager qwix is one dispatch per op
# |log p_int8 - log p_float32| of the greedy tokens on this model (weights x4: sharp logits,
# which scale the gap): measured max 0.12, mean 0.030; float32's argmax equal on all 24.
LOGP_TOL = 0.3


def _flat(params):
    is_var = lambda x: isinstance(x, nnx.Variable)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
    return {tuple(str(getattr(k, "key", k)) for k in p): v.get_value() for p, v in flat}


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe_mixed"])
def test_int8_weights_are_within_half_a_scale_of_the_originals(preset):
    config = models.get_config(preset)
    params = models.init_params(config, jax.random.key(1))
    before, after = _flat(params), _flat(_int8(params, jnp.bfloat16))
    quantized = [p for p in before if quantize.contracted_axes(p) is not None]
    want = {("layers", "attn", n) for n in "qkvo"} | (
        {("moe", n) for n in ("gate", "up", "down")} | {("dense_mlp", "down")}
        if config.is_moe
        else {("layers", "mlp", "down")}
    )
    assert want <= set(quantized) and ("lm_head",) not in quantized
    for path, w in before.items():
        q = after[path]
        if path not in quantized:  # embedding, head, router, norms: the compute dtype
            assert q.dtype == jnp.bfloat16 and q.shape == w.shape, path
            continue
        w64 = np.asarray(w, np.float64)
        inputs = quantize.contracted_axes(path)
        # qwix's symmetric int8: absmax maps to 127.5, the edge of the 127 bucket
        scale64 = np.abs(w64).max(axis=inputs, keepdims=True) / 127.5  # per output channel
        assert q.qvalue.dtype == jnp.int8 and q.scale.shape == scale64.shape, path
        np.testing.assert_allclose(np.asarray(q.scale, np.float64), scale64, rtol=1e-6)
        err = np.abs(np.asarray(q.qvalue, np.float64) * scale64 - w64)
        assert np.all(err <= scale64 / 2 * (1 + 1e-5)), path
        assert np.abs(np.asarray(q.qvalue, np.int32)).max() in (127, 128), path


def test_int8_without_qwix_is_a_one_line_error_naming_the_setting(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwix", None)  # import qwix then raises ImportError
    with pytest.raises(ConfigError, match=r"sampler.param_dtype='int8' needs qwix") as e:
        quantize.int8(jnp.ones((4, 4)), (0,))
    assert "\n" not in str(e.value)


def test_int8_forward_of_a_mixed_moe_is_close_to_float32():
    config = models.get_config("tiny_moe_mixed")
    params = models.init_params(config, jax.random.key(2))
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) % config.vocab_size)
    logp = jax.jit(lambda p: jax.nn.log_softmax(models.forward(config, p, tokens), -1))
    gap = float(jnp.max(jnp.abs(logp(params) - logp(_int8(params, config.dtype)))))
    assert 0 < gap < LOGP_TOL, gap  # measured 0.029


@pytest.fixture(scope="module")
def params():
    p = models.init_params(CONFIG, jax.random.key(0))  # x4: far-from-uniform logits
    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p)


def _greedy(params):
    spec = sampler.SamplerSpec(max_new_tokens=N, sampling=sampler.Sampling(temperature=0.0))
    return sampler.generate(CONFIG, params, PROMPTS, LENGTHS, spec, rng=jax.random.key(3))


@jax.jit
def _logp_of(params, seq_BT):
    return jax.nn.log_softmax(models.forward(CONFIG, params, seq_BT), -1)


def _float32_logprobs(params, tokens):
    """(log p_float32 of each token, float32's argmax), each row fed its own tokens."""
    rows = np.repeat(np.arange(len(PROMPTS)), tokens.shape[0] // len(PROMPTS))
    seq = np.zeros((len(rows), PROMPTS.shape[1] + N), np.int32)
    for r, b in enumerate(rows):
        seq[r, : LENGTHS[b]] = PROMPTS[b, : LENGTHS[b]]
        seq[r, LENGTHS[b] : LENGTHS[b] + N] = tokens[r]
    at = LENGTHS[rows][:, None] - 1 + np.arange(N)[None]
    logp = np.take_along_axis(np.asarray(_logp_of(params, jnp.asarray(seq))), at[..., None], 1)
    return np.take_along_axis(logp, tokens[..., None], -1)[..., 0], logp.argmax(-1)


def test_int8_sampler_logprobs_and_greedy_tokens_track_float32(params):
    """The int8 sampler's greedy rows, scored by the float32 model on the same prefixes."""
    gen = _greedy(_int8(params, CONFIG.dtype))
    tokens, logprobs = np.asarray(gen.tokens), np.asarray(gen.logprobs)
    ref, argmax = _float32_logprobs(params, tokens)
    gap = np.abs(logprobs - ref)
    assert 0 < gap.max() < LOGP_TOL and gap.mean() < LOGP_TOL / 6, (gap.max(), gap.mean())
    print("MEASURED", gap.max(), gap.mean(), (tokens == argmax).mean())
    assert (tokens == argmax).mean() >= 0.9  # float32 would pick the same tokens


_MISMATCH = {
    "sampler.param_dtype": "int8",
    "loss.recompute_old_logprobs": True,
    "loss.is_correction": "tis",
    # micro's random model scores 0: the entropy bonus gives the update a gradient
    "loss.entropy_coef": 0.01,
    "total_steps": 2,
    "eval_every": 2,
    "checkpoint_every": 2,
}


def _check_mismatch(workdir):
    """Each step's mismatch/* finite and > 0, and a gradient."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "actor/loss" in r]
    assert len(rows) == 2
    for r in rows:
        gaps = {k: v for k, v in r.items() if k.startswith("mismatch/")}
        assert gaps and all(np.isfinite(v) for v in gaps.values()), gaps
        assert r["mismatch/abs_diff_max"] > 0 and r["mismatch/abs_diff_mean"] > 0
        assert r["actor/grad_norm"] > 0 and np.isfinite(r["actor/loss"])


# slow: 40 s (a 2-step run, compiling rollout, update and eval); its cheaper siblings in the
# default suite: aot_programs_test's int8 case (the same programs traced) and the tests above
@pytest.mark.slow
def test_micro_run_with_int8_sampler_weights_logs_the_mismatch_and_trains(tmp_path):
    out = loop.train(micro_config(tmp_path, **_MISMATCH), log=lambda *_: None)
    assert out["step"] == 2
    _check_mismatch(tmp_path)


@pytest.mark.slow  # a 2-step run on 8 devices, compiling rollout and update
def test_one_step_off_with_int8_weights_moves_them_to_the_sampler_devices(tmp_path):
    """rollout.max_staleness=1: the int8 copy is made on the trainer's 4 devices and moved to
    the sampler's 4 others (each QArray as its weight's layout there)."""
    c = micro_config(tmp_path, **_MISMATCH)
    c.update_from_flattened_dict(
        {"rollout.max_staleness": 1, "mesh.devices": 4, "mesh.shape": (4,)}
        | {"sampler.mesh": "data=4"}
    )
    out = loop.train(c, log=lambda *_: None)
    assert out["step"] == 2
    _check_mismatch(tmp_path)


@pytest.mark.slow  # an MoE sampler call and the trainer's forward, each compiled
def test_routing_replay_of_the_int8_samplers_experts():
    """The int8 sampler records its experts and the float32 trainer replays them: the
    recomputed log-probs differ by int8's rounding alone (not by flipped experts)."""
    from ebpo_jax.trainer.batch import MicroBatch
    from ebpo_jax.trainer.update import completion_logprobs

    config = models.get_config("tiny_moe")
    params = models.init_params(config, jax.random.key(0))
    P, G = 3, 2
    spec = sampler.SamplerSpec(max_new_tokens=N, num_samples=G, record_routing=True)
    gen = sampler.generate(
        config, _int8(params, config.dtype), PROMPTS, LENGTHS, spec, rng=jax.random.key(2)
    )
    routing = jax.tree.map(lambda x: x.reshape(P, G, *x.shape[1:]), gen.routing)
    mb = MicroBatch(jnp.asarray(PROMPTS), LENGTHS, gen.tokens, gen.lengths, routing=routing)
    logp = completion_logprobs(config, params, mb, with_entropy=False)
    mask = np.arange(N)[None] < np.asarray(gen.lengths)[:, None]
    gap = np.abs(np.where(mask, np.asarray(logp) - np.asarray(gen.logprobs), 0))
    assert 0 < gap.max() < LOGP_TOL, gap.max()
