"""Multi-turn rollouts: environments, the worker pool's timeouts, the turn loop against a
scripted sampler, and the toy families' problems."""

import dataclasses
import os
import pathlib
import time
import types

import jax
import numpy as np
import pytest
from flaky_env import Flaky

from ebpo_jax import models, sampler, schema
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import RolloutSpec
from ebpo_jax.tasks import calc, envs, episodes, guess, reasoning
from ebpo_jax.tasks.envs import Episode, Reply, calculator
from ebpo_jax.tasks.envs.guess import reply_to
from ebpo_jax.tasks.envs.pool import EnvPool

EOS = 2


def test_calculator_evaluates_exactly_and_rejects_malformed_calls():
    assert calculator.evaluate("12*3+4-5*2") == 30
    assert calculator.evaluate("0-7") == -7
    for bad in ("", "1//2", "1+", "(1)", "1/0", "2**3"):
        assert calculator.evaluate(bad) is None, bad
    env = envs.get("calculator")
    ep = lambda turn: Episode("1=", "1", (turn,), ())
    assert env.step(ep("x<calc>12*3</calc>")) == Reply("36")
    assert env.step(ep("<calc>1/0</calc>")) == Reply("?")
    assert env.step(ep("12*3</calc>")) == Reply("?")


def test_guess_hints_and_open_range():
    assert reply_to("0-15=", ("10?",), 7) == Reply("<0-9=")
    assert reply_to("0-15=", ("10?", "3?"), 7) == Reply(">4-9=")
    assert reply_to("0-15=", ("10?", "3?", "7?"), 7) == Reply("=", reward=1.0, done=True)
    assert reply_to("0-15=", ("10?", "x?"), 7) == Reply(" 0-9=")


def test_unknown_environment_is_a_config_error():
    with pytest.raises(ConfigError, match="'nope' is not one of"):
        envs.get("nope")


def test_pool_gives_stuck_crashing_and_raising_tools_an_error_reply():
    """A stuck, a crashing and a raising call cost at most one timeout, the others answer,
    and the pool keeps working (its dead workers replaced)."""
    eps = [Episode("p", "a", (t,), ()) for t in ("sleep?", "ok?", "crash?", "raise?", "b?")]
    with EnvPool(2, timeout_s=1.0) as pool:
        t0 = time.monotonic()
        out = pool.map(Flaky(), eps)
        assert time.monotonic() - t0 < 120  # the stuck call sleeps 600 s
        assert [r.error for r in out] == [True, False, True, True, False]
        assert out[1] == Reply("OK?", reward=1.0) and out[0].observation == "!"
        assert pool.num_errors == 3
        assert pool.map(Flaky(), eps[1:2]) == [Reply("OK?", reward=1.0)]


def _scripted(tokenizer, scripts, stop_ids, N):
    """A fake `generate`: row b writes scripts[b] in order, each call up to its first stop id
    or its limit, as the sampler does; a finished row (limit 1) writes one pad token."""
    cursor = [0] * len(scripts)
    ids = [tokenizer.encode(s) + [EOS] for s in scripts]

    def generate(ctx_BT, len_B, limit_B, key):
        del ctx_BT, len_B, key
        B = len(scripts)
        tok, logp, n_B = np.zeros((B, N), np.int32), np.zeros((B, N), np.float32), []
        for b in range(B):
            rest = ids[b][cursor[b] : cursor[b] + int(limit_B[b])]
            stop = next((i for i, t in enumerate(rest) if t in stop_ids), len(rest) - 1)
            piece = rest[: stop + 1]
            cursor[b] += len(piece)
            tok[b, : len(piece)] = piece
            logp[b, : len(piece)] = -1.0
            n_B.append(len(piece))
        return sampler.Generation(tok, logp, np.array(n_B, np.int32))

    return generate


def _spec(N, turns, T=0):
    return RolloutSpec(
        prompts=1, group_size=1, max_new_tokens=N, prompts_per_call=1,
        sampler=schema.Sampler(max_new_tokens=N),
        rollout=schema.Rollout(max_turns=turns, turn_tokens=T, env_workers=0),
        dapo=schema.Dapo(max_extra_rounds=0), moe=schema.Moe(),
    )  # fmt: skip


def _run(tok, env, prompts, answers, scripts, N, turns, T=0):
    stops = set(episodes.stop_token_ids(tok, env)) | {EOS}
    prompt_BT, plen_B = tok.encode_batch(prompts, add_bos=True)
    gen = _scripted(tok, scripts, stops, N)
    with EnvPool(0) as pool:
        return episodes.run_episodes(
            episodes.Reprefill(gen),
            _spec(N, turns, T),
            episodes.EnvSide(env, pool, tok, EOS),
            episodes.EpisodePrompts(prompt_BT, plen_B, answers),
            jax.random.key(0),
        )


def _text(tok, ep, b):
    return episodes.episode_text(tok, ep.tokens[b], ep.action_mask[b], ep.lengths[b])


def test_calculator_episodes_mask_observations_and_continue_false_stops():
    tok = calc.make_tokenizer()
    scripts = [
        "<calc>12*3</calc>#36",
        "7+5=12;#12",
        "<calc>1/0</calc>#5",
        "<calc>99*9</calc><calc>1+1</calc>#2",
    ]
    ep = _run(tok, envs.get("calculator"), ["12*3="] * 4, ["36"] * 4, scripts, N=40, turns=2)
    assert _text(tok, ep, 0) == "<calc>12*3</calc>[[obs: 36]]#36"
    assert _text(tok, ep, 1) == "7+5=12;#12"
    assert _text(tok, ep, 2) == "<calc>1/0</calc>[[obs: ?]]#5"
    # max_turns=2: the second turn ends the episode although the script goes on.
    assert _text(tok, ep, 3) == "<calc>99*9</calc>[[obs: 891]]<calc>1+1</calc>[[obs: 2]]"
    np.testing.assert_array_equal(ep.turns, [2, 1, 2, 2])
    np.testing.assert_array_equal(ep.tool_calls, [1, 0, 1, 2])
    assert ep.lengths[0] == len("<calc>12*3</calc>36#36") + 1  # EOS
    obs = ~ep.action_mask[0, : ep.lengths[0]]
    assert obs.sum() == 2 and np.all(ep.logprobs[0][~ep.action_mask[0]] == 0)
    rewards = np.asarray(
        calc.reward_fn(ep.tokens, ep.lengths, *tok.encode_batch(["36"] * 4), eos_id=EOS)
    )
    np.testing.assert_array_equal(rewards, [1, 0, 0, 0])  # row 1 answers 12


def test_guess_episodes_end_when_found_at_max_turns_or_budget():
    tok = guess.make_tokenizer()
    scripts = ["10?5?7?", "1?2?3?4?5?", "10?12?", "11?"]
    ep = _run(
        tok, envs.get("guess"), ["0-15="] * 4, ["7", "15", "13", "11"], scripts, N=24, turns=4
    )
    assert _text(tok, ep, 0) == "10?[[obs: <0-9=]]5?[[obs: >6-9=]]7?[[obs: =]]"
    # The budget (N=24 tokens) ends row 1 after three turns.
    assert _text(tok, ep, 1) == "1?[[obs: >2-15=]]2?[[obs: >3-15=]]3?[[obs: >4-15=]]"
    assert _text(tok, ep, 2) == "10?[[obs: >11-15=]]12?[[obs: >13-15=]]"
    assert _text(tok, ep, 3) == "11?[[obs: =]]"
    np.testing.assert_array_equal(ep.env_reward, [1, 0, 0, 1])
    np.testing.assert_array_equal(ep.turns, [3, 3, 3, 1])
    m = episodes.episode_metrics(ep, ep.env_reward, np.full(4, 6))
    assert m["episode/reward_at_1_turns"] == 1.0
    assert m["episode/reward_at_3_turns"] == pytest.approx(1 / 3)
    assert m["episode/reward_with_tool"] == 0.5 and "episode/reward_without_tool" not in m
    assert 0 < m["episode/observation_token_share"] < 0.8
    assert m["episode/forward_token_ratio"] > 1.0  # every turn re-prefills the episode


def test_turn_token_limit_ends_the_episode():
    tok = guess.make_tokenizer()
    ep = _run(tok, envs.get("guess"), ["0-15="], ["7"], ["12345?"], N=12, turns=4, T=3)
    assert _text(tok, ep, 0) == "123" and ep.turns[0] == 1


def test_toy_families_problems():
    train, test = calc.make_splits(0, train_per_cell=40, test_per_cell=5)
    tool = [p for p in train if p.completion.startswith("<calc>")]
    assert abs(len(tool) / len(train) - calc.TOOL_SFT_FRAC) < 0.1
    for p in tool:
        expr = calculator.call_of(p.completion.split("</calc>")[0] + "</calc>")
        assert str(calculator.evaluate(expr)) == p.answer
        assert reasoning.final_answer(p.completion) == p.answer
    assert all(not p.completion.startswith("<") for p in test + [p for p in train if p not in tool])
    gtrain, gtest = guess.make_splits(0, train_per_cell=30, test_per_cell=5)
    triple = lambda p: (p.prompt, p.answer)
    assert not {triple(p) for p in gtrain} & {triple(p) for p in gtest}
    for p in gtrain:  # the transcripts are what the environment would answer
        lo, hi = (int(x) for x in p.prompt.removesuffix("=").split("-"))
        assert lo <= int(p.answer) <= hi
        prompt, rest, turns = p.prompt, p.completion, []
        while rest:
            turn, _, rest = rest.partition("?")
            turns.append(turn + "?")
            obs = reply_to(prompt, turns, int(p.answer)).observation
            assert rest.startswith(obs), (p, turns, obs)
            rest = rest[len(obs) :]
    found = np.mean(["?=" in p.completion for p in gtrain])
    assert 0.5 < found < 1.0  # the SFT transcripts are not all successes
    assert dataclasses.is_dataclass(gtrain[0])


def test_calculator_sft_learns_to_read_the_observation_not_to_predict_it():
    train, _ = calc.make_splits(0, train_per_cell=10, test_per_cell=2)
    tok = calc.make_tokenizer()
    ex = calc.sft_examples(train, tok)
    for i, p in enumerate(train):
        n = int(ex.lengths[i])
        text = tok.decode(list(ex.tokens[i, 1 : n - 1]))  # BOS, EOS off
        assert text == p.prompt + p.completion
        off = "".join(c for c, m in zip(text, ex.loss_mask[i, 1 : n - 1]) if not m)
        obs = p.answer if p.completion.startswith(calculator.OPEN) else ""
        assert off == p.prompt + obs  # the call, "#" and the answer stay on the loss
        assert ex.loss_mask[i, n - 1]  # EOS


@pytest.mark.slow  # the worker imports the trainer (the example registers a task family)
def test_readme_environment_example_runs_in_the_pool(tmp_path, monkeypatch):
    """The README's custom environment, written to a module, answers through worker processes."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Tools and multi-turn", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_tools_readme.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    import my_tools_readme

    env = envs.get("lookup")
    assert isinstance(env, my_tools_readme.Lookup)
    eps = [Episode("p", "", ("look up [NaCl]",), ()), Episode("p", "", ("[x]",) * 4, ("",) * 3)]
    with EnvPool(1, timeout_s=5.0) as pool:
        assert pool.map(env, eps) == [Reply("salt"), Reply("(no more lookups)", done=True)]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("rollout.max_turns", 0, "rollout.max_turns must be >= 1"),
        ("rollout.turn_tokens", 99, "rollout.turn_tokens=99 must be in"),
        ("rollout.env_workers", -1, "rollout.env_workers must be >= 0"),
        ("rollout.env_timeout_s", 0.0, "rollout.env_timeout_s must be > 0"),
        ("task.family", "guess", r"task.family='guess' is multi-turn: set rollout.max_turns >= 2"),
        ("task.env", "guess", r"task.env='guess' is multi-turn: set rollout.max_turns >= 2"),
        ("rollout.max_turns", 3, "rollout.max_turns=3 needs an environment: set task.env"),
    ],
)
def test_bad_turn_fields_are_config_errors(field, value, message):
    from configs import micro
    from ebpo_jax.spec import resolve

    c = micro.get_config()
    c.unlock()
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=message):
        resolve(c)


class _Echo:
    """A test environment: a turn ending on `stop` reads "<7" back, reward 1 per call."""

    error_observation = "!"

    def __init__(self, stop: str):
        self.stop_sequences = (stop,)

    def step(self, episode):
        return envs.Reply("<7", reward=1.0)


def test_kept_kv_episodes_equal_reprefilled_ones_greedy():
    """Greedy episodes do not depend on the keys: keeping the KV pages across turns must give
    the re-prefilled episodes token for token, running each episode token at most once."""
    tok = guess.make_tokenizer()
    config = models.get_config("tiny", vocab_size=tok.vocab_size, max_position_embeddings=48)
    params = jax.tree.map(
        lambda x: x * 4.0 if x.ndim > 1 else x, models.init_params(config, jax.random.key(3))
    )
    prompt_BT, plen_B = tok.encode_batch(["0-15=", "3-9=", "12-15=", "1="], add_bos=True)
    greedy = schema.Sampler(max_new_tokens=20, temperature=0.0)
    spec = dataclasses.replace(_spec(20, turns=4, T=6), sampler=greedy)
    s_spec = episodes.turn_sampler_spec(spec, tok.eos_id, ())
    free = np.asarray(
        sampler.generate(config, params, prompt_BT, plen_B, s_spec, rng=jax.random.key(0)).tokens
    )
    # The stop: the text token these greedy rows emit most, so that rows call the environment.
    env = _Echo(tok.decode([int(np.bincount(free[free >= 3]).argmax())]))
    stops = episodes.stop_token_ids(tok, env)
    prompts = episodes.EpisodePrompts(prompt_BT, plen_B, ["7"] * 4)
    out = {}
    for keep in (True, False):
        ro = dataclasses.replace(spec.rollout, keep_kv=keep)
        turns = episodes.make_turns(
            dataclasses.replace(spec, rollout=ro), config, params, tok.eos_id, stops
        )
        with EnvPool(0) as pool:
            side = episodes.EnvSide(env, pool, tok, tok.eos_id)
            out[keep] = episodes.run_episodes(turns, spec, side, prompts, jax.random.key(2))
    kept, again = out[True], out[False]
    assert kept.tool_calls.sum() >= 2  # the test exercises continued rows
    for field in ("tokens", "action_mask", "lengths", "turns", "tool_calls", "env_reward"):
        np.testing.assert_array_equal(getattr(kept, field), getattr(again, field), field)
    np.testing.assert_allclose(kept.logprobs, again.logprobs, rtol=0, atol=1e-5)
    ratio = {k: episodes.episode_metrics(e, e.env_reward, plen_B) for k, e in out.items()}
    # Kept: each token once (a last observation of an episode that is over is never fed).
    assert ratio[True]["episode/forward_token_ratio"] <= 1.0
    assert ratio[False]["episode/forward_token_ratio"] > 1.2


def test_task_env_gives_any_family_episodes():
    from ebpo_jax.tasks import protocol as task_module

    tokenizers = {"calc_chars": calc.make_tokenizer(), "guess_chars": guess.make_tokenizer()}

    @task_module.register("single_turn_for_env_test")
    def build(spec, *, mesh=None, log=print):
        fields = dict.fromkeys(task_module.Task._fields)
        return task_module.Task(**fields | {"tokenizer": tokenizers[spec.tokenizer]})

    spec = types.SimpleNamespace(
        family="single_turn_for_env_test", task=schema.Task(), tokenizer="calc_chars"
    )
    assert task_module.build_task(spec).env is None
    spec.task = schema.Task(env="calculator")
    assert isinstance(task_module.build_task(spec).env, calculator.Calculator)
    spec.task = schema.Task(env="nope")
    with pytest.raises(ConfigError, match="environment 'nope' is not one of"):
        task_module.build_task(spec)
    # guess's alphabet has no "c": "</calc>" cannot be a stop sequence of its rows.
    spec.task, spec.tokenizer = schema.Task(env="calculator"), "guess_chars"
    with pytest.raises(ConfigError, match="cannot write its stop sequence '</calc>'"):
        task_module.build_task(spec)
