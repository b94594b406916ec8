"""Trainer: loss decreases, scan == loop, accumulation == full batch, EBPO vs GRPO gradients,
sharded == single device, interrupt-and-resume == uninterrupted, config errors."""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from configs import micro
from ebpo_jax import advantages, models, sampler, tasks
from ebpo_jax import config as config_lib
from ebpo_jax.rollout.single_turn import compact
from ebpo_jax.runtime.checkpoint import load_params
from ebpo_jax.sharding import make_mesh
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import model_config_from
from ebpo_jax.trainer import loop
from ebpo_jax.trainer import make_rollout_fn as _make_rollout_fn
from ebpo_jax.trainer import make_train_step as _make_train_step
from ebpo_jax.trainer import make_update_fn as _make_update_fn
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.state import init_train_state
from ebpo_jax.trainer.state import make_optimizer as _make_optimizer
from ebpo_jax.trainer.step import multi_step
from ebpo_jax.trainer.update import completion_logprobs, overlong_penalty, pack_sequences, truncated

EOS = tasks.EOS_ID


def _config(**overrides):
    c = micro.get_config()
    c.unlock()
    c.prompts_per_step, c.group_size = 4, 4
    c.optimizer.learning_rate = 3e-3
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


def _reward(*a):
    return tasks.reward_fn(*a, eos_id=EOS)


# The factories take the run spec's slices; these take a config, as the tests build them.
def make_optimizer(c):
    return _make_optimizer(resolve(c).optim)


def make_rollout_fn(c, mc, reward, eos):
    return _make_rollout_fn(resolve(c).rollout, mc, reward, eos, _clusters(c))


def make_update_fn(c, mc, optimizer, eos):
    return _make_update_fn(resolve(c).update, mc, optimizer, eos)


def make_train_step(c, mc, optimizer, reward, eos, *, mesh=None):
    return _make_train_step(resolve(c), mc, optimizer, reward, eos, _clusters(c), mesh=mesh)


def make_multi_step(step):
    return lambda state, batches: multi_step(step, state, batches)


def _clusters(c):
    return lambda batch: task_arithmetic.cluster_ids(c.eb_clusters, batch)


def load_tasks(c):
    return task_arithmetic.load_problems(resolve(c).task)


def _model_config(c, tok):
    return model_config_from(resolve(c).task.model, tok.vocab_size)


@pytest.fixture(scope="module")
def setup():
    c = _config()
    tok, train, _ = load_tasks(c)
    mc = _model_config(c, tok)
    params = models.init_params(mc, jax.random.key(0))
    source = tasks.PromptSource(train, tok, c.prompts_per_step, seed=0)
    batches = jax.tree.map(jnp.asarray, source.next_batches(2))
    return c, mc, params, batches


def _state(c, params, **kw):
    return init_train_state(jax.tree.map(jnp.copy, params), make_optimizer(c), seed=0, **kw)


@pytest.fixture(scope="module")
def rollout(setup):
    """The default config's rollout of the first batch: the update tests read its tokens and
    log-probs and set their own rewards (no update setting changes how it samples)."""
    c, mc, params, batches = setup
    batch = jax.tree.map(lambda x: x[0], batches)
    return jax.jit(make_rollout_fn(c, mc, _reward, EOS))(params, batch, jax.random.key(1))


def _with_rewards(ro, rewards_PG):
    return ro._replace(rewards=jnp.asarray(rewards_PG, jnp.float32))


MIXED = [[1, 0, 0, 1], [0, 0, 0, 1], [1, 1, 0, 1], [0, 1, 0, 0]]


def test_pack_sequences_places_completion_after_prompt():
    tokens, mask = pack_sequences(
        jnp.array([[5, 6, 0], [7, 0, 0]]),
        jnp.array([2, 1]),
        jnp.array([[8, 9], [3, 0]]),
        jnp.array([2, 1]),
    )
    np.testing.assert_array_equal(tokens, [[5, 6, 8, 9, 9], [7, 3, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])


def test_sampler_logprobs_equal_training_forward(setup, rollout):
    c, mc, params, _ = setup
    ro = rollout
    G, N = c.group_size, ro.tokens.shape[-1]
    mask_BN = jnp.arange(N) < ro.lengths.reshape(-1, 1)
    assert int(mask_BN.sum()) > 0 and G > 1
    # The prompt once per group (as the update step calls it), and once per row.
    for reps in (1, G):
        mb = MicroBatch(
            jnp.repeat(ro.prompt_tokens, reps, 0),
            jnp.repeat(ro.prompt_lengths, reps, 0),
            ro.tokens.reshape(-1, N),
            ro.lengths.reshape(-1),
        )
        logp_BN = completion_logprobs(mc, params, mb, with_entropy=False)
        diff = jnp.where(mask_BN, logp_BN - ro.logprobs.reshape(-1, N), 0.0)
        np.testing.assert_allclose(diff, 0.0, atol=1e-5)


def test_splash_packed_path_equals_grouped_path():
    """The splash kernel gets packed rows; same log-probs and entropy as the grouped path."""
    mc = models.get_config("tiny", num_layers=1)
    params = models.init_params(mc, jax.random.key(0))
    P, G, Tp, N = 2, 2, 64, 64  # the kernel's blocks are multiples of 128 tokens
    rng = np.random.default_rng(1)
    prompt_PT = jnp.asarray(rng.integers(3, mc.vocab_size, (P, Tp)), jnp.int32)
    comp_BN = jnp.asarray(rng.integers(3, mc.vocab_size, (P * G, N)), jnp.int32)
    plen_P, clen_B = jnp.array([64, 9]), jnp.array([64, 5, 30, 1])
    out = {
        name: jax.jit(completion_logprobs, static_argnums=0, static_argnames="with_entropy")(
            mc.replace(attention=name),
            params,
            MicroBatch(prompt_PT, plen_P, comp_BN, clen_B),
            with_entropy=True,
        )
        for name in ("xla", "splash")
    }
    valid = np.arange(N)[None] < np.asarray(clen_B)[:, None]
    for got, want in zip(out["splash"], out["xla"]):
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-4)


@pytest.mark.slow  # the loop tests train this update; here its direction and a frozen reference
def test_update_decreases_loss_on_fixed_batch(setup, rollout):
    _, mc, params, _ = setup
    c = _config(**{"loss.clip_low": 10.0, "loss.clip_high": 10.0, "loss.kl_coef": 0.01})
    ro = _with_rewards(rollout, MIXED)
    update = jax.jit(make_update_fn(c, mc, make_optimizer(c), EOS))
    state, losses, kls = _state(c, params, with_ref=True), [], []
    for _ in range(4):
        state, m = update(state, ro)
        losses.append(float(m["actor/pg_loss"]))
        kls.append(float(m["actor/kl"]))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.05, losses
    assert abs(kls[0]) < 1e-6 < kls[-1], kls  # the frozen reference starts equal, then drifts
    jax.tree.map(np.testing.assert_array_equal, state.ref_params, params)


@pytest.mark.parametrize(
    "agg,micro_n",
    [("token-mean", 4), pytest.param("seq-mean-token-mean", 2, marks=pytest.mark.slow)],
)
def test_microbatch_accumulation_equals_full_batch(setup, rollout, agg, micro_n):
    _, mc, params, _ = setup
    ro = _with_rewards(rollout, MIXED)

    def update(n):  # each count compiles its own update
        cc = _config(**{"loss.num_microbatches": n, "loss.agg": agg})
        return jax.jit(make_update_fn(cc, mc, make_optimizer(cc), EOS))(_state(cc, params), ro)

    (ref, ref_m), (state, m) = update(1), update(micro_n)
    assert float(m["actor/grad_norm"]) > 0
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/clip_frac_low", "actor/entropy"):
        np.testing.assert_allclose(m[name], ref_m[name], rtol=1e-5, atol=1e-6, err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5),
        state.params,
        ref.params,
    )


def test_scan_of_k_steps_equals_k_calls(setup):
    c, mc, params, batches = setup
    opt = make_optimizer(c)
    step = make_train_step(c, mc, opt, _reward, EOS)
    scanned, m_scan = jax.jit(make_multi_step(step))(_state(c, params), batches)
    state, one = _state(c, params), jax.jit(step)
    rows = []
    for k in range(2):
        state, m = one(state, jax.tree.map(lambda x, k=k: x[k], batches))
        rows.append(m)
    assert int(scanned.step) == int(state.step) == 2
    for k, m in enumerate(rows):
        for name, v in m.items():
            np.testing.assert_allclose(m_scan[name][k], v, rtol=1e-5, atol=1e-6, err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        scanned.params,
        state.params,
    )
    np.testing.assert_array_equal(scanned.rng, state.rng)


def _eb_history():
    """An EB state that has seen successes, so mu_glob > 0."""
    hist = jnp.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1]], jnp.float32)
    return advantages.eb_advantage(hist, advantages.init_eb_state())[1]


def test_ebpo_all_fail_group_has_gradient_where_grpo_has_none(setup, rollout):
    _, mc, params, _ = setup
    ro = _with_rewards(rollout, [[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    norms, advs = {}, {}
    for name in ("ebpo", "grpo"):
        c = _config(estimator=name, **{"optimizer.weight_decay": 0.0})  # decay alone moves params
        state = _state(c, params)._replace(eb_state=_eb_history())
        new, m = jax.jit(make_update_fn(c, mc, make_optimizer(c), EOS))(state, ro)
        norms[name] = float(m["actor/grad_norm"])
        advs[name] = advantages.estimate(name, ro.rewards, state.eb_state)[0]
        moved = jax.tree.leaves(
            jax.tree.map(lambda a, b: jnp.any(a != b), new.params, state.params)
        )
        assert any(bool(x) for x in moved) == (name == "ebpo")
    assert norms["grpo"] == 0.0
    assert norms["ebpo"] > 1e-3
    assert np.all(np.asarray(advs["ebpo"])[0] < 0)  # the all-fail group is pushed down


def test_sharded_step_equals_single_device(setup):
    c, mc, params, _batches = setup
    c = _config(**{"mesh.shape": (8,), "mesh.axes": ("data",), "prompts_per_step": 8})
    config_lib.validate(c, 8)
    tok, train, _ = load_tasks(c)
    batch = jax.tree.map(jnp.asarray, tasks.PromptSource(train, tok, 8, seed=3).next_batch())
    opt = make_optimizer(c)
    single_dev = jax.devices()[0]
    state1 = jax.device_put(_state(c, params), single_dev)
    ref, m_ref = jax.jit(make_train_step(c, mc, opt, _reward, EOS))(
        state1, jax.device_put(batch, single_dev)
    )
    mesh = make_mesh(resolve(c, 8).mesh)
    repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    step = jax.jit(make_train_step(c, mc, opt, _reward, EOS, mesh=mesh), out_shardings=(repl, repl))
    out, m = step(jax.device_put(_state(c, params), repl), jax.device_put(batch, rows))
    assert len(out.params["embed"][...].sharding.device_set) == 8
    for name, v in m_ref.items():
        np.testing.assert_allclose(m[name], v, rtol=1e-4, atol=1e-5, err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), out.params, ref.params
    )


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    return [
        {k: v for k, v in r.items() if not k.startswith(("perf/", "phase/")) or "tokens_total" in k}
        for r in rows
    ]


@pytest.mark.slow  # three short training runs, each compiling its own step
def test_interrupt_and_resume_equals_uninterrupted(tmp_path):
    def cfg(name):
        c = _config(workdir=str(tmp_path / name), total_steps=4, checkpoint_every=2, eval_every=2)
        c.mesh.shape = (-1,)  # the loop insists the mesh covers every (fake) device
        c.unlock()
        return c

    loop.train(cfg("full"), log=lambda *_: None)
    first = loop.train(cfg("resumed"), log=lambda *_: None, stop_after=3)
    assert first["step"] == 3 and first["stopped_early"]
    resumed = loop.train(cfg("resumed"), log=lambda *_: None)
    assert resumed["step"] == 4 and resumed["resumed_from"] == 3
    assert _rows(tmp_path / "full") == _rows(tmp_path / "resumed")
    assert [r["step"] for r in _rows(tmp_path / "resumed")] == [0, 1, 2, 3, 4]
    a, b = (load_params(str(tmp_path / n)) for n in ("full", "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("group_size", 0, "group_size must be >= 1"),
        ("prompts_per_step", 6, "not divisible by loss.num_minibatches"),
        ("mesh.shape", (3,), "needs 3 devices"),
        ("estimator", "ebpoo", "not in the advantages registry"),
        ("eval_every", 3, "multiple of steps_per_jit"),
        ("sft.export_dir", "gs://b/warm", "exported to a local folder"),
    ],
)
def test_impossible_values_are_one_line_errors(field, value, message):
    c = _config(
        **{
            "loss.num_minibatches": 4 if field == "prompts_per_step" else 1,
            "steps_per_jit": 2 if field == "eval_every" else 1,
        }
    )
    c.mesh.shape = (-1,)  # covers the 8 devices: the one error is the field's
    node, *rest = field.split(".")
    if rest:
        c[node][rest[0]] = value
    else:
        c[node] = value
    with pytest.raises(config_lib.ConfigError, match=message) as e:
        config_lib.validate(c, 8)
    assert "\n" not in str(e.value)


def test_misspelt_field_is_an_error():
    c = micro.get_config()
    with pytest.raises(AttributeError):
        c.gruop_size = 4  # a locked config refuses new fields
    raw = config_dict.ConfigDict(c.to_dict())
    raw.gruop_size = 4
    with pytest.raises(config_lib.ConfigError, match="unknown config field.*gruop_size"):
        config_lib.validate(raw)


def test_compact_fills_empty_slots_in_order():
    buf = {"x": jnp.array([10, 11, 12, 13])}
    new = {"x": jnp.array([20, 21, 22, 23])}
    merged, filled = compact(
        buf, jnp.array([True, False, True, False]), new, jnp.array([False, True, True, False])
    )
    np.testing.assert_array_equal(merged["x"], [10, 12, 21, 22])
    np.testing.assert_array_equal(filled, [True, True, True, True])


def test_overlong_penalty_and_truncation():
    np.testing.assert_allclose(
        overlong_penalty(jnp.array([2, 6, 7, 8]), 8, 4, 1.0), [0, -0.5, -0.75, -1]
    )
    tokens = jnp.array([[[5, 2, 0], [5, 6, 7], [5, 6, 2]]])
    np.testing.assert_array_equal(
        truncated(tokens, jnp.array([[2, 3, 3]]), EOS), [[False, True, False]]
    )
    # Several stop ids (EOS and an end-of-turn): ending on either is not truncation.
    np.testing.assert_array_equal(
        truncated(tokens, jnp.array([[2, 3, 3]]), (EOS, 7)), [[False, False, False]]
    )


def test_dapo_dynamic_sampling_keeps_mixed_groups_and_counts_all_tokens(setup):
    _, mc, params, _ = setup
    c = _config(**{"dapo.dynamic_sampling": True, "dapo.max_extra_rounds": 2})
    tok, train, _ = load_tasks(c)
    batch = jax.tree.map(jnp.asarray, tasks.PromptSource(train, tok, 12, seed=1).next_batch())

    def coin_reward(tokens_BN, *_):  # a reward with mixed and all-equal groups
        return (tokens_BN[:, 0] % 2).astype(jnp.float32)

    ro = jax.jit(make_rollout_fn(c, mc, coin_reward, EOS))(params, batch, jax.random.key(4))
    valid = np.asarray(ro.group_valid)
    rewards = np.asarray(ro.rewards)
    assert valid.any()
    assert all(rewards[p].min() != rewards[p].max() for p in np.flatnonzero(valid))
    assert int(ro.generated_tokens) >= int(np.asarray(ro.lengths)[valid].sum())


def _chunked(per_call, **kw):
    return _config(**{"sampler.prompts_per_call": per_call, **kw})


def test_prompts_per_call_must_divide_prompts_per_step():
    with pytest.raises(config_lib.ConfigError, match="sampler.prompts_per_call=3 must be 0"):
        config_lib.validate(_chunked(3))
    config_lib.validate(_chunked(2))


def test_rollout_in_prompt_chunks_matches_one_call(setup):
    c, mc, params, batches = setup
    batch, rng = jax.tree.map(lambda x: x[0], batches), jax.random.key(5)
    run = lambda c: jax.jit(make_rollout_fn(c, mc, _reward, EOS))(params, batch, rng)
    # top_k=1: the sampler's randomness is out of the way, so chunking alone must not matter.
    one, two = (run(_chunked(n, **{"sampler.top_k": 1})) for n in (0, 2))
    for name in ("tokens", "logprobs", "lengths", "rewards"):
        np.testing.assert_array_equal(getattr(two, name), getattr(one, name), err_msg=name)
    # Sampled: chunk k of round r is one call on its prompts with fold_in(fold_in(rng, r), k).
    chunked, whole = run(_chunked(2)), run(_chunked(0))
    assert not np.array_equal(chunked.tokens, whole.tokens)  # the keys really differ
    key_r = jax.random.fold_in(rng, 0)  # round 0
    for k in range(2):
        part = jax.tree.map(lambda a, k=k: a[2 * k : 2 * k + 2], batch)
        ref = sampler.generate(
            mc,
            params,
            part.prompt_tokens,
            part.prompt_lengths,
            sampler.SamplerSpec(
                max_new_tokens=c.sampler.max_new_tokens, num_samples=c.group_size, eos_ids=EOS
            ),
            rng=jax.random.fold_in(key_r, k),
        )
        np.testing.assert_array_equal(chunked.tokens[2 * k : 2 * k + 2].reshape(8, -1), ref.tokens)
        np.testing.assert_allclose(
            chunked.logprobs[2 * k : 2 * k + 2].reshape(8, -1), ref.logprobs, rtol=1e-6
        )


def test_recomputed_old_logprobs_match_the_sampler_and_measure_a_perturbed_one(setup, rollout):
    """recompute_old_logprobs: the trainer's forward equals the sampler's log-probs (same
    params), so the update is unchanged; a perturbed sampler shows in mismatch/* and MIS."""
    _, mc, params, _ = setup
    ro = _with_rewards(rollout, MIXED)
    plain = _config()
    rec = _config(**{"loss.recompute_old_logprobs": True, "loss.is_correction": "mis"})
    jitted = {
        id(cc): jax.jit(make_update_fn(cc, mc, make_optimizer(cc), EOS)) for cc in (plain, rec)
    }
    update = lambda cc, r: jitted[id(cc)](_state(cc, params), r)  # each config compiles once
    (s0, m0), (s1, m1) = update(plain, ro), update(rec, ro)
    assert float(m1["mismatch/abs_diff_max"]) < 1e-4 and float(m1["is/masked_frac"]) == 0.0
    np.testing.assert_allclose(m1["actor/pg_loss"], m0["actor/pg_loss"], atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), s1.params, s0.params)
    # A sampler whose log-probs are off by 1 nat on every other token.
    shift = jnp.where(jnp.arange(ro.logprobs.shape[-1]) % 2 == 0, 1.0, 0.0)
    _, m2 = update(rec, ro._replace(logprobs=ro.logprobs + shift))
    assert float(m2["mismatch/abs_diff_max"]) == pytest.approx(1.0, abs=1e-4)
    assert float(m2["mismatch/ratio_out_frac"]) > 0.2  # exp(-1) < 1/2: outside [1/2, 2]
    assert float(m2["is/masked_frac"]) > 0.2 and np.isfinite(float(m2["actor/loss"]))


def test_nonfinite_rewards_are_dropped_and_a_skipped_step_keeps_the_eb_state(setup, rollout):
    c, mc, params, _ = setup
    rewards = np.array(MIXED, np.float32)
    rewards[0, 1] = np.nan
    ro = _with_rewards(rollout, rewards)
    update = jax.jit(make_update_fn(c, mc, make_optimizer(c), EOS))
    new, m = update(_state(c, params), ro)
    assert float(m["reward/nonfinite_count"]) == 1 and np.isfinite(float(m["actor/loss"]))
    assert int(new.eb_state.reward.count.sum()) == rewards.size - 1  # the NaN never merged
    # Old log-probs of NaN make the loss non-finite: the update is skipped, EB state kept.
    bad = ro._replace(rewards=jnp.asarray(MIXED, jnp.float32), logprobs=ro.logprobs * np.nan)
    state = _state(c, params)
    new, m = update(state, bad)
    assert int(m["train/skipped_updates"]) == 1 and int(new.nonfinite_run) == 1
    jax.tree.map(np.testing.assert_array_equal, new.eb_state, state.eb_state)


def test_no_checkpoint_is_saved_inside_a_nonfinite_streak(tmp_path):
    """A run that diverges stops after max_nonfinite_steps; its kept checkpoints all predate
    the streak, so a resume starts from a good state."""
    c = _config(workdir=str(tmp_path), total_steps=8, checkpoint_every=1, eval_every=8)
    c.keep_checkpoints, c.max_nonfinite_steps = 3, 3
    c.optimizer.learning_rate = 1e38  # the first update makes the params overflow
    c.mesh.devices = 1
    with pytest.raises(loop.NonFiniteError, match="3 steps in a row"):
        loop.train(c, log=lambda *_: None)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in rows if r.get("train/nonfinite_run", 0) > 0]
    saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert bad and saved and max(saved) < min(bad), (saved, bad)


@pytest.mark.slow  # packing_test checks packed == padded; this is the update's branch
def test_packed_update_equals_padded_update(setup, rollout):
    """loss.tokens_per_microbatch > 0 (trainer/packing.py) gives the padded update's step."""
    c, mc, params, _ = setup
    ro = _with_rewards(rollout, MIXED)
    out = {}
    for name, budget in (("padded", 0), ("packed", 48)):
        cc = _config(**{"loss.tokens_per_microbatch": budget, "loss.kl_coef": 0.01})
        update = jax.jit(make_update_fn(cc, mc, make_optimizer(cc), EOS))
        out[name] = update(_state(cc, params, with_ref=True), ro)
    (s0, m0), (s1, m1) = out["padded"], out["packed"]
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl", "actor/entropy"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), s1.params, s0.params)


@pytest.mark.parametrize(
    "name",
    ["clip_cov", pytest.param("kl_cov", marks=pytest.mark.slow)],  # ~25 s more
)
def test_covariance_losses_pick_their_share_of_tokens_in_the_update(setup, rollout, name):
    """loss.name=clip_cov / kl_cov in the update: max(floor(r N), 1) of the N loss tokens
    picked (every unclipped token a Clip-Cov candidate here), the same draw on a rerun."""
    _, mc, params, _ = setup
    ro = _with_rewards(rollout, MIXED)
    knobs = {"loss.name": name, "loss.clip_cov_ratio": 0.25, "loss.kl_cov_ratio": 0.25}
    cc = _config(**knobs, **{"loss.clip_cov_lb": -1e9, "loss.clip_cov_ub": 1e9})
    update = jax.jit(make_update_fn(cc, mc, make_optimizer(cc), EOS))
    (s1, m1), (s2, _) = update(_state(cc, params), ro), update(_state(cc, params), ro)
    n = float(ro.lengths.sum())
    np.testing.assert_allclose(m1["actor/cov_frac"], max(np.floor(0.25 * n), 1) / n, rtol=1e-6)
    assert np.isfinite(m1["actor/pg_loss"]) and float(m1["actor/grad_norm"]) > 0
    jax.tree.map(np.testing.assert_array_equal, s1.params, s2.params)


@pytest.mark.slow  # a whole run: the only check of samples.jsonl, kept out of the 12-min suite
def test_sample_completions_are_logged_every_n_steps(tmp_path):
    c = _config(workdir=str(tmp_path), total_steps=2, checkpoint_every=2, eval_every=2)
    c.log_samples_every, c.mesh.devices = 1, 1
    c.estimator = "grpo"  # per-group advantages: checkable from the logged group alone
    loop.train(c, log=lambda *_: None)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert sorted({r["step"] for r in rows}) == [1, 2]
    assert all(r["prompt"] and isinstance(r["completion"], str) for r in rows)
    assert all(r["reward"] in (0.0, 1.0) for r in rows)
    for step in (1, 2):  # the advantage each completion was trained with (G = 4: all logged)
        group = [r for r in rows if r["step"] == step]
        rewards = jnp.array([[r["reward"] for r in group]])
        want = advantages.grpo_advantage(rewards, mask=jnp.ones_like(rewards, bool))
        got = [r["advantage"] for r in group]
        np.testing.assert_allclose(got, np.asarray(want)[0], atol=1e-5)
