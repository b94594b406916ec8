"""Exactly on-policy (issue 47, items 2-3): with model.batch_invariant the sampler's log-probs are
the old ones (no recompute), mismatch/* comes from the first mini-batch's own forward, and the
mode's config rules; the bitwise checks run once the numerics (item 1) have landed."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import micro
from ebpo_jax import config as config_lib
from ebpo_jax import importance, models, tasks
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import arithmetic
from ebpo_jax.tasks.protocol import model_config_from
from ebpo_jax.trainer import make_rollout_fn, make_update_fn
from ebpo_jax.trainer import update as update_lib
from ebpo_jax.trainer.state import init_train_state, make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = tasks.EOS_ID
MIXED = [[1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 0, 1], [0, 1, 0, 0]]
# Each prompt's sampler log-probs moved by its own amount on even positions: a mini-batch's
# mismatch then tells which prompts it holds, and a sum over micro-batches from a maximum.
SHIFT_P = np.array([0.1, 0.2, 0.3, 0.4], np.float32)


def _config(**fields):
    c = micro.get_config()
    c.unlock()
    c.update_from_flattened_dict(fields)
    return c


@pytest.fixture(scope="module")
def setup():
    c = _config()
    spec = resolve(c)
    tok, train, _ = arithmetic.load_problems(spec.task)
    mc = model_config_from(spec.task.model, tok.vocab_size)
    params = models.init_params(mc, jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, tasks.PromptSource(train, tok, 4, seed=0).next_batches(1))
    batch = jax.tree.map(lambda x: x[0], batch)
    reward = lambda *a: tasks.reward_fn(*a, eos_id=EOS)
    clusters = lambda b: arithmetic.cluster_ids(c.eb_clusters, b)
    rollout = jax.jit(make_rollout_fn(spec.rollout, mc, reward, EOS, clusters))
    ro = rollout(params, batch, jax.random.key(1))
    return mc, params, ro._replace(rewards=jnp.asarray(MIXED, jnp.float32))


def _state(c, params):
    optimizer = make_optimizer(resolve(c).optim)
    return init_train_state(jax.tree.map(jnp.copy, params), optimizer, seed=0), optimizer


def _update(c, mc, params, ro):
    state, optimizer = _state(c, params)
    return jax.jit(make_update_fn(resolve(c).update, mc, optimizer, EOS))(state, ro)


def _first_minibatch_mismatch(c, mc, params, ro):
    """mismatch_metrics of the update's first mini-batch, from a forward of its rows alone."""
    spec = resolve(c).update
    key = jax.random.split(jax.random.wrap_key_data(_state(c, params)[0].rng))
    P, G = spec.prompts, spec.group_size
    valid_PG = jnp.ones((P, G), bool)
    trunc_PG = update_lib.truncated(ro.tokens, ro.lengths, EOS)
    data = update_lib.MicroBatch(
        ro.prompt_tokens,
        ro.prompt_lengths,
        ro.tokens,
        ro.lengths,
        logprobs=ro.logprobs,
        loss_mask=update_lib._loss_mask(spec, ro, valid_PG, trunc_PG),
    )
    mb = jax.tree.map(lambda x: x[0], update_lib._minibatches(spec, data, key[1]))
    new = update_lib.completion_logprobs(mc, params, mb, with_entropy=False)
    flat = lambda x: x.reshape(new.shape)
    return importance.mismatch_metrics(flat(mb.logprobs), new, flat(mb.loss_mask))


@pytest.mark.parametrize(
    "fields",
    [
        {"loss.num_minibatches": 2, "loss.num_microbatches": 2},
        pytest.param(
            {"loss.num_minibatches": 2, "loss.tokens_per_microbatch": 24},
            marks=pytest.mark.slow,  # the packed update's own compile
        ),
    ],
    ids=["padded", "packed"],
)
def test_mode_on_keeps_the_samplers_logprobs_and_logs_the_first_minibatchs_mismatch(
    setup, monkeypatch, fields
):
    """No recompute; mismatch/* = the first mini-batch's new log-probs vs the sampler's (its
    maximum over micro-batches, not their sum)."""
    mc, params, ro = setup
    calls = []
    recompute = update_lib._recomputed_logprobs
    monkeypatch.setattr(
        update_lib, "_recomputed_logprobs", lambda *a: calls.append(1) or recompute(*a)
    )
    even_N = jnp.arange(ro.logprobs.shape[-1]) % 2 == 0
    moved = ro._replace(logprobs=ro.logprobs + SHIFT_P[:, None, None] * even_N)
    c = _config(**fields)
    _, m = _update(c, dataclasses.replace(mc, batch_invariant=True), params, moved)
    assert calls == []
    want = _first_minibatch_mismatch(c, mc, params, moved)
    assert np.isclose(float(want["mismatch/abs_diff_max"]), SHIFT_P, atol=1e-5).any()
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), float(v), rtol=1e-4, atol=1e-5, err_msg=k)


def _refusal(**fields):
    """validate's one-line error for micro with the mode on and `fields`."""
    c = _config(**{"model.batch_invariant": True, **fields})
    try:
        config_lib.validate(c)
    except config_lib.ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    "fields,setting",
    [
        ({"loss.recompute_old_logprobs": True}, "loss.recompute_old_logprobs=True is redundant"),
        (
            {"loss.recompute_old_logprobs": True, "loss.is_correction": "tis"},
            "loss.recompute_old_logprobs=True is redundant",
        ),
        ({"loss.is_correction": "mis"}, "loss.is_correction='mis' is redundant"),
        ({"sampler.param_dtype": "bfloat16"}, "sampler.param_dtype='bfloat16' samples with"),
        ({"model.lora.rank": 4}, "model.lora.rank=4: the sampler runs the merged"),
        ({"sampler.kv_dtype": "int8"}, "sampler.kv_dtype='int8' samples from rounded"),
    ],
)
def test_mode_rules_name_the_setting(fields, setting):
    assert setting in _refusal(**fields)


def test_mode_rules_allow_the_packed_and_micro_batched_update():
    assert _refusal() == ""
    assert _refusal(**{"loss.tokens_per_microbatch": 48}) == ""
    assert _refusal(**{"loss.num_microbatches": 2, "sampler.param_dtype": ""}) == ""
    assert "model.moe.routing_replay=True is redundant" in _refusal(
        **{"model.moe.routing_replay": True, "model.preset": "tiny_moe"}
    )


def test_the_pod_estimate_counts_the_recompute_the_mode_saves_by_hand():
    from ebpo_jax.pods import aot_report

    spec = resolve(_config(**{"sampler.max_new_tokens": 4}))
    mc = models.get_config(
        "tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=16,
    )  # fmt: skip
    P, G, N, Tp = 4, 4, 4, 6
    # 2 FLOPs per matmul weight and token: q, o (32 x 32), k, v (32 x 16), the MLP (3 x 32 x
    # 64), the head (32 x 64); attention 4 x heads x head_dim per (query, key) pair.
    layers, head = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64, 32 * 64
    pairs = lambda q, k: 4 * 2 * 16 * q * k
    prompt = 2 * layers * Tp + pairs(Tp, Tp) / 2
    comp = 2 * (layers + head) * N + pairs(N, Tp) + pairs(N, N) / 2
    est = aot_report.exact_on_policy_terms(
        {"step_s_after": 2.0, "update_s_after_packed": 1.5}, spec, mc, prompt_len=Tp,
        devices=2, peak=1e9,
    )  # fmt: skip
    e = est["exact_on_policy"]
    assert e["recompute_s_if_packed"] == pytest.approx(0.5)  # one of 3 forwards (no KL)
    assert e["recompute_s"] == pytest.approx(P * (prompt + G * comp) / 2 / 1e9)
    assert e["step_s_mode_on"] == 2.0
    assert e["step_s_mode_off_recompute"] == pytest.approx(2.0 + e["recompute_s"])
    assert "saves" in aot_report.exact_on_policy_lines({"step_estimate": est})[0]


@pytest.mark.slow  # ~3 min on a loaded 2-core CPU with the numerics merged
def test_mode_on_the_trainer_routes_as_the_sampler_recorded_without_replay():
    """Mixture of experts: the experts the trainer's forward picks for every input token equal
    the ones the sampler recorded (routing replay's record, used here only as the reference),
    and so do the log-probs."""
    from ebpo_jax import sampler
    from ebpo_jax.trainer.batch import MicroBatch

    config = models.get_config(
        "tiny_moe_mixed", vocab_size=64, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, head_dim=8, batch_invariant=True,
    )  # fmt: skip
    params = models.init_params(config, jax.random.key(0))
    P, G, N = 4, 2, 6
    prompts = jax.random.randint(jax.random.key(1), (P, 5), 1, config.vocab_size)
    plen = jnp.array([5, 3, 4, 2])
    spec = sampler.SamplerSpec(max_new_tokens=N, num_samples=G, slots=3, record_routing=True)
    gen = sampler.generate(config, params, prompts, plen, spec, rng=jax.random.key(2))
    rows = models.GroupedRows(prompts, plen, gen.tokens, gen.lengths)
    _, _, (r_p, r_c) = models.forward_grouped(config, params, rows, with_router=True)
    fed_BN = np.arange(N)[None] < np.asarray(gen.lengths)[:, None] - 1  # last token: not fed
    by_token = lambda x_BLTK: np.asarray(x_BLTK).transpose(0, 2, 1, 3)  # [B, T, layers, k]
    got_c = by_token(np.asarray(r_c["experts"]).swapaxes(0, 1))  # from [layers, B, N, k]
    np.testing.assert_array_equal(by_token(gen.routing["comp"])[fed_BN], got_c[fed_BN])
    in_prompt = np.arange(5)[None] < np.repeat(np.asarray(plen), G)[:, None]
    got_p = by_token(np.repeat(np.asarray(r_p["experts"]).swapaxes(0, 1), G, 0))
    np.testing.assert_array_equal(by_token(gen.routing["prompt"])[in_prompt], got_p[in_prompt])
    mb = MicroBatch(prompts, plen, gen.tokens.reshape(P, G, N), gen.lengths.reshape(P, G))
    logp = update_lib.completion_logprobs(config, params, mb, with_entropy=False)
    valid = np.arange(N)[None] < np.asarray(gen.lengths)[:, None]
    np.testing.assert_array_equal(np.asarray(logp)[valid], np.asarray(gen.logprobs)[valid])


# Issue 47's "Done when": the micro run, packed, with the mode on; float32 and bfloat16.
DONE_WHEN = (
    "--config=configs/micro.py",
    "--config.model.batch_invariant=True",
    "--config.sampler.slots=4",
    "--config.loss.tokens_per_microbatch=48",
)


@pytest.mark.slow  # two CLI runs
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_done_when_micro_runs_log_zero_mismatch_at_every_step(tmp_path, dtype):
    flags = [*DONE_WHEN, f"--config.workdir={tmp_path}"]
    flags += ["--config.model.overrides.dtype=bfloat16"] if dtype == "bfloat16" else []
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *flags],
        check=False, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    got = [r.get("mismatch/abs_diff_max") for r in rows if r["step"] > 0]
    assert got == [0.0] * 4, got


@pytest.mark.slow  # compiles each mode's sampler and update: ~40 s of CPU
def test_on_policy_bench_smoke(capsys):
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "on_policy_bench.py")
    spec = importlib.util.spec_from_file_location("on_policy_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = "--hidden 64 --layers 1 --prompts 2 --group 2 --prompt_len 4 --new_tokens 4 --runs 1"
    bench.main(small.split())
    out = capsys.readouterr().out
    assert out.count("on/off") == 2 and "max |dlogp|" in out
