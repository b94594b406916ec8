"""Each setting declared once (issue 45): the sampler's and the loss's specs are built from
their schema sections by one function each and carry every field; every mode rule is a
one-line ConfigError from config.validate, before anything compiles."""

import dataclasses

import jax
import numpy as np
import pytest
from multiturn_test import _Echo

from ebpo_jax import losses, models, sampler, schema
from ebpo_jax.config import ESTIMATOR_OPTIONS, ConfigError, checks, validate
from ebpo_jax.spec import RolloutSpec
from ebpo_jax.tasks import episodes, guess
from ebpo_jax.tasks.envs.pool import EnvPool

# Another valid value for each string setting the walks below change.
_OTHER = {"attention": "xla", "name": "gspo", "agg": "seq-mean-token-sum", "kl_estimator": "k1"}


def _other(name: str, value, i: int):
    """A value of the same type that differs from `value` (numbers: by 3 + i, unique per field)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 3 + i
    return _OTHER.get(name, f"{value}_other")


def _named(spec, prefix: str = "") -> dict:
    """Every value of a (nested) NamedTuple or dataclass spec by its dotted field name."""
    if hasattr(spec, "_asdict"):
        fields = spec._asdict()
    else:
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    out = {}
    for k, v in fields.items():
        nested = hasattr(v, "_asdict") or dataclasses.is_dataclass(v)
        out |= _named(v, f"{prefix}{k}.") if nested else {prefix + k: v}
    return out


# Where a setting lands in its spec when the spec names it otherwise.
_PLACE = {
    **{k: f"sampling.{k}" for k in ("temperature", "top_k", "top_p")},
    "routing_replay": "record_routing",
    "clip_cov_ratio": "cov.clip_ratio",
    "clip_cov_lb": "cov.clip_lb",
    "clip_cov_ub": "cov.clip_ub",
    "kl_cov_ratio": "cov.kl_ratio",
    "kl_cov_coef": "cov.kl_coef",
}


def _uncarried(section, build) -> list[str]:
    """The fields of `section` whose change leaves `build(section)` as it was; every other
    field's new value must land at its own place in the spec, and nowhere else."""
    base, out = _named(build(section)), []
    for i, f in enumerate(dataclasses.fields(section)):
        value = _other(f.name, getattr(section, f.name), i)
        spec = _named(build(dataclasses.replace(section, **{f.name: value})))
        place = _PLACE.get(f.name, f.name)
        if spec == base:
            out.append(f.name)
        else:
            assert {k: v for k, v in spec.items() if v != base[k]} == {place: value}, f.name
    return out


def test_sampler_spec_carries_every_sampler_and_moe_setting():
    """A changed `sampler.*` / `model.moe.*` field reaches the sampler call's spec, unless it is
    in the stated exclusions (the trainer's: chunking, mesh, weight copy; the update's lb_coef)."""
    moe = schema.Moe()
    of_sampler = lambda s: sampler.SamplerSpec.from_config(s, moe, num_samples=2, eos_ids=(1, 2))
    assert _uncarried(schema.Sampler(), of_sampler) == list(sampler.spec.UNCARRIED)
    of_moe = lambda m: sampler.SamplerSpec.from_config(schema.Sampler(), m)
    assert _uncarried(schema.Moe(), of_moe) == ["lb_coef"]
    spec = of_sampler(schema.Sampler())
    assert (spec.num_samples, spec.eos_ids, spec.max_new_tokens) == (2, (1, 2), 16)
    turn = sampler.SamplerSpec.from_config(schema.Sampler(), max_new_tokens=5)
    assert turn.max_new_tokens == 5


def test_loss_options_carry_every_loss_setting():
    """A changed `loss.*` field reaches LossOptions, unless it is the update's (UNCARRIED)."""
    assert _uncarried(schema.Loss(), losses.LossOptions.from_config) == list(losses.UNCARRIED)


def test_library_defaults_are_the_schemas():
    """SamplerSpec, Sampling, LossOptions and CovOptions default to the config's defaults."""
    assert sampler.SamplerSpec(16) == sampler.SamplerSpec.from_config(schema.Sampler())
    assert losses.LossOptions() == losses.LossOptions.from_config(schema.Loss())
    custom = sampler.SamplerSpec(4, num_samples=2, slots=8, sampling=sampler.Sampling(0.5))
    assert (custom.slots, custom.sampling.top_k, custom.page_size) == (8, 0, 16)
    assert losses.LossOptions(clip_high=0.28).cov == losses.CovOptions()


def test_estimator_option_types_come_from_the_schema():
    hints = {f.name: f.type for f in dataclasses.fields(schema.EstimatorOptions)}
    assert set(ESTIMATOR_OPTIONS) == set(hints) - {"extra"}
    assert ESTIMATOR_OPTIONS == {
        "per_batch": bool,
        "forgetting": float,
        "normalize": str,
        "eps": float,
    }


def _micro(**changes):
    """configs/micro.py with `changes` ({"section.field": value}) applied."""
    from configs import micro

    c = micro.get_config()
    c.unlock()
    c.update_from_flattened_dict(changes)
    return c


GUESS = {"task.family": "guess", "rollout.max_turns": 3}
MOE = {"model.preset": "tiny_moe", "model.moe.routing_replay": True}

# (config changes, devices or None, the one-line error)
RULES = [
    (  # was trainer/step.py's ValueError when the step was built
        {**GUESS, "steps_per_jit": 2, "total_steps": 4},
        None,
        r"steps_per_jit=2: task.family='guess' runs its episodes on the host, so it must be 1",
    ),
    (  # was silently dropped by the turn sampler spec
        {**GUESS, "model.moe.routing_replay": True},
        None,
        r"model.moe.routing_replay: task.family='guess' records no experts",
    ),
    (
        {**GUESS, "sampler.slots": 4},
        None,
        r"sampler.slots=4: task.family='guess' keeps each row's KV pages across turns "
        r"\(rollout.keep_kv\)",
    ),
    (
        {"task.env": "calculator", "rollout.max_turns": 2, "sampler.kv_pages": 64},
        None,
        r"sampler.kv_pages=64: task.env='calculator' keeps each row's KV pages",
    ),
    (  # was the sampler's ValueError when the rollout was traced
        {"model.moe.routing_replay": True},
        None,
        r"model.moe.routing_replay needs a mixture-of-experts policy: model.preset='tiny' has",
    ),
    (  # was trainer/update.py's ValueError when the update was traced
        {**MOE, "model.overrides.attention": "splash"},
        None,
        r"model.moe.routing_replay with model.overrides.attention='splash' \(splash\)",
    ),
    (  # was the sampler engine's ValueError when the rollout was traced
        {"mesh.shape": (2,), "sampler.kv_pages": 9},
        2,
        r"sampler.kv_pages=9 must be a multiple of the sampler mesh's 2 row shards",
    ),
]


@pytest.mark.parametrize(("changes", "devices", "message"), RULES)
def test_mode_rule_is_one_line_at_validate(changes, devices, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(_micro(**changes), devices)
    assert "\n" not in str(err.value)


def test_multi_turn_honours_slots_and_pages_when_turns_reprefill():
    validate(_micro(**GUESS, **{"rollout.keep_kv": False, "sampler.slots": 4}))
    validate(_micro(**GUESS, **{"rollout.keep_kv": False, "sampler.kv_pages": 64}))
    packed_replay = {"loss.tokens_per_microbatch": 64, "model.overrides.attention": "splash"}
    validate(_micro(**MOE, **packed_replay))  # the packed update takes splash with replay


def test_splash_block_widths_of_math_records():
    """Was tasks/families/math_data.py's error once the task's model was built (the rule alone
    here: validate would want the data files)."""
    splash = {"data.path": "train.jsonl", "model.overrides.attention": "splash"}
    with_prompt = lambda n: schema.parse(_micro(**splash, **{"data.max_prompt_len": n}))
    widths = lambda c: checks._splash_widths(c, checks.derive(c))
    with pytest.raises(ConfigError, match="data.max_prompt_len = 600: attention 'splash' needs"):
        widths(with_prompt(600))
    with pytest.raises(ConfigError, match=r"data.max_prompt_len \+ sampler.max_new_tokens = 514"):
        widths(with_prompt(510))
    widths(with_prompt(508))  # 508 + 4 = one block


def test_stale_pipeline_in_several_processes_and_host_reward_steps(monkeypatch):
    """Was trainer/shardings.py's error when the sampler's mesh was made, and trainer/loop.py's."""
    stale = {
        "rollout.max_staleness": 1,
        "mesh.devices": 2,
        "mesh.shape": (2,),
        "sampler.mesh": "data=2",
    }
    validate(_micro(**stale), 4)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 runs in one process only"):
        validate(_micro(**stale), 4)
    checks.host_reward_steps(1)
    with pytest.raises(ConfigError, match="steps_per_jit=2: a host_reward scores each rollout"):
        checks.host_reward_steps(2)


def _turn_spec(**sampler_changes) -> RolloutSpec:
    return RolloutSpec(
        prompts=4, group_size=1, max_new_tokens=20, prompts_per_call=4,
        sampler=schema.Sampler(max_new_tokens=20, temperature=0.0, **sampler_changes),
        rollout=schema.Rollout(max_turns=4, turn_tokens=6, env_workers=0, keep_kv=False),
        dapo=schema.Dapo(max_extra_rounds=0), moe=schema.Moe(),
    )  # fmt: skip


def test_turn_specs_carry_slots_pages_and_routing():
    """The turn loop's sampler specs are the rollout's, at a turn's length and stops."""
    spec = dataclasses.replace(
        _turn_spec(slots=2, kv_pages=16), moe=schema.Moe(routing_replay=True)
    )
    turn = episodes.turn_sampler_spec(spec, 1, (5,))
    assert (turn.slots, turn.kv_pages, turn.record_routing) == (2, 16, True)
    assert (turn.max_new_tokens, turn.eos_ids, turn.num_samples) == (6, (1, 5), 1)
    assert episodes.session_spec(spec, 1, (5,)).max_new_tokens == 20


@pytest.mark.slow  # two sampler engines compile: most of a minute on a loaded CPU
def test_reprefilled_turns_decode_in_the_configured_slots_and_pages(monkeypatch):
    """The turn spec carries sampler.slots and sampler.kv_pages (it dropped them before): each
    turn's call decodes 4 rows through 2 slots, and the episodes equal the static batch's."""
    tok = guess.make_tokenizer()
    config = models.get_config("tiny", vocab_size=tok.vocab_size, max_position_embeddings=48)
    params = jax.tree.map(
        lambda x: x * 4.0 if x.ndim > 1 else x, models.init_params(config, jax.random.key(3))
    )
    prompt_BT, plen_B = tok.encode_batch(["0-15=", "3-9=", "12-15=", "1="], add_bos=True)
    prompts = episodes.EpisodePrompts(prompt_BT, plen_B, ["7"] * 4)
    env = _Echo("<")
    stops = episodes.stop_token_ids(tok, env)
    real, seen = sampler.generate, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((args[4].slots, args[4].kv_pages, int(out.stats.slots)))
        return out

    monkeypatch.setattr(episodes.sampler, "generate", spy)
    out = {}
    for slots, pages in ((0, 0), (2, 16)):
        spec = _turn_spec(slots=slots, kv_pages=pages)
        turns = episodes.make_turns(spec, config, params, tok.eos_id, stops)
        with EnvPool(0) as pool:
            side = episodes.EnvSide(env, pool, tok, tok.eos_id)
            out[slots] = episodes.run_episodes(turns, spec, side, prompts, jax.random.key(2))
    assert {s for s in seen if s[0]} == {(2, 16, 2)} and (0, 0, 4) in seen
    static, slotted = out[0], out[2]
    for field in ("tokens", "action_mask", "lengths", "turns", "tool_calls"):
        np.testing.assert_array_equal(getattr(static, field), getattr(slotted, field), field)
    np.testing.assert_allclose(static.logprobs, slotted.logprobs, rtol=0, atol=1e-5)
