"""Multi-turn rollouts: the host turn loop of model turns and environment replies.

Each row of a step (P prompts x G samples) is an episode: model turns and observations
written one after the other into its completion [N] (N = sampler.max_new_tokens, the
episode's token budget), with `action_mask` False on the observations, so the update trains
on the model's tokens only while the observations are context (trainer/update.py).

A model turn ends at EOS (the episode ends), at `rollout.turn_tokens` or the budget (ends),
or on an environment stop sequence (the environment answers; `rollout.max_turns` model turns
at most). The sampler stops on the last token of each stop sequence; a stop on that token
without the whole sequence (`<calc>` for `</calc>`) continues the same turn in the next call.
Rows finish independently: each sampler call decodes the live rows. Two ways to run the
model turns: `KeptKV` (`rollout.keep_kv`, the default) continues every row on a multi-turn
`sampler.Session`, whose rows keep their KV pages across calls, so a turn feeds only the new
observation through the model; `Reprefill` prefills each row's prompt and episode so far
on every call (finished rows get a one-token limit). `episode/forward_token_ratio` measures
what each costs: tokens the model ran per episode token.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from ebpo_jax import sampler
from ebpo_jax.spec import RolloutSpec
from ebpo_jax.tasks.envs import Environment, Episode
from ebpo_jax.tasks.envs.pool import EnvPool, error_reply


class Episodes(NamedTuple):
    """B episodes as host arrays, and counts of what happened in them."""

    tokens: np.ndarray  # [B, N] model turns and observations, pad 0
    logprobs: np.ndarray  # [B, N] sampler log-probs (0 on observations)
    action_mask: np.ndarray  # [B, N] bool: sampled by the policy
    lengths: np.ndarray  # [B]
    env_reward: np.ndarray  # [B] sum of the environment's reward contributions
    turns: np.ndarray  # [B] model turns
    tool_calls: np.ndarray  # [B] environment calls
    tool_errors: np.ndarray  # [B] calls that crashed or timed out
    prefill_tokens: int  # tokens the sampler prefilled over all calls (live rows)


def concat(parts: list[Episodes]) -> Episodes:
    """Episodes of consecutive row blocks as one."""
    arrays = [np.concatenate(x) for x in zip(*(p[:-1] for p in parts))]
    return Episodes(*arrays, sum(p.prefill_tokens for p in parts))


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens (a CharTokenizer or an HF tokenizer)."""
    if hasattr(tokenizer, "alphabet"):
        return tokenizer.encode(text)
    return tokenizer.encode(text, add_special_tokens=False)


def stop_token_ids(tokenizer, env: Environment) -> tuple[int, ...]:
    """The last token of each of the environment's stop sequences."""
    return tuple(sorted({encode_text(tokenizer, s)[-1] for s in env.stop_sequences}))


def turn_sampler_spec(spec: RolloutSpec, eos_ids, extra_stops) -> sampler.SamplerSpec:
    """One sampler call of the turn loop: one sample per row, up to turn_tokens tokens."""
    stops = (*np.atleast_1d(eos_ids), *extra_stops)
    return sampler.SamplerSpec.from_config(
        spec.sampler, spec.moe, eos_ids=stops, max_new_tokens=spec.rollout.turn_tokens
    )


class _Rows:
    """The mutable state of B episodes during the loop."""

    def __init__(self, B: int, N: int):
        self.tokens, self.logp = np.zeros((B, N), np.int32), np.zeros((B, N), np.float32)
        self.act, self.used = np.zeros((B, N), bool), np.zeros(B, np.int32)
        self.live = np.ones(B, bool)
        self.env_reward = np.zeros(B, np.float32)
        self.turns, self.calls, self.errors = (np.zeros(B, np.int32) for _ in range(3))
        self.cur = [""] * B  # the text of each row's current model turn
        self.history = [([], []) for _ in range(B)]  # (model turns, observations)

    def write(self, b: int, ids, logp=None) -> int:
        """Append ids (an action if logp is given) within the budget; returns tokens written."""
        u, n = self.used[b], min(len(ids), self.tokens.shape[1] - self.used[b])
        self.tokens[b, u : u + n] = ids[:n]
        if logp is not None:
            self.logp[b, u : u + n], self.act[b, u : u + n] = logp[:n], True
        self.used[b] += n
        return n


class EnvSide(NamedTuple):
    """What answers a batch's model turns: the environment, the pool that runs it, the
    tokenizer between its text and ids, and the stop id(s) that end an episode."""

    env: Environment
    pool: EnvPool
    tokenizer: object
    eos_ids: object  # an id or a sequence of ids


class Stops(NamedTuple):
    """How a model turn ends: on an EOS id (the episode ends) or on the last token of one of
    the environment's stop sequences (the environment answers if the whole sequence is there)."""

    eos: frozenset
    ids: frozenset  # the last token of each stop sequence
    sequences: tuple

    @classmethod
    def of(cls, side: EnvSide) -> "Stops":
        """The stops of `side`'s environment and stop ids."""
        eos = frozenset(int(e) for e in np.atleast_1d(side.eos_ids))
        ids = frozenset(stop_token_ids(side.tokenizer, side.env))
        return cls(eos, ids, tuple(side.env.stop_sequences))


def _after_turn(rows: _Rows, b, ids, logp, limit, stops: Stops, tokenizer) -> bool:
    """Record row b's new tokens; True when its turn ended on a whole stop sequence."""
    rows.write(b, ids, logp)
    rows.cur[b] += tokenizer.decode(list(ids))
    last = int(ids[-1]) if len(ids) else -1
    room = rows.used[b] < rows.tokens.shape[1]
    if last in stops.eos or not room:
        rows.live[b], rows.turns[b] = False, rows.turns[b] + 1
        return False
    if last in stops.ids and any(rows.cur[b].endswith(s) for s in stops.sequences):
        return True
    if last in stops.ids and len(ids) < limit:
        return False  # a stop token without its whole sequence: the turn goes on
    rows.live[b], rows.turns[b] = False, rows.turns[b] + 1  # the turn's token limit
    return False


def _answer(rows: _Rows, calls, replies, tokenizer, spec: RolloutSpec, env) -> None:
    """Append each environment reply to its row; end episodes that are over."""
    for b, reply in zip(calls, replies):
        try:
            ids = encode_text(tokenizer, reply.observation)
        except ValueError:  # text the tokenizer cannot write: the tool failed
            reply = error_reply(env)
            ids = encode_text(tokenizer, reply.observation)
        turns, obs = rows.history[b]
        turns.append(rows.cur[b])
        obs.append(reply.observation)
        rows.cur[b] = ""
        rows.turns[b] += 1
        rows.calls[b] += 1
        rows.errors[b] += reply.error
        rows.env_reward[b] += reply.reward
        fits = rows.write(b, ids) == len(ids)
        over = reply.done or rows.turns[b] >= spec.rollout.max_turns
        rows.live[b] = fits and not over and rows.used[b] < rows.tokens.shape[1]


class Turn(NamedTuple):
    """One sampler call's new tokens per row (tokens[b, :lengths[b]]) and tokens prefilled."""

    gen: sampler.Generation
    prefilled: int


class Reprefill:
    """Model turns by `generate(context, lengths, limits, key) -> Generation`: each call
    prefills the live rows' prompts and episodes so far (call c draws with fold_in(key, c))."""

    def __init__(self, generate: Callable):
        self.generate = generate

    def __call__(self, rows: _Rows, prompts: "EpisodePrompts", limit_B, key, call: int) -> Turn:
        ctx_BT = _context(rows, prompts.tokens_BT, prompts.lengths_B)
        ctx_len_B = (prompts.lengths_B + rows.used).astype(np.int32)
        limit_B = np.where(rows.live, limit_B, 1).astype(np.int32)
        g = jax.device_get(self.generate(ctx_BT, ctx_len_B, limit_B, jax.random.fold_in(key, call)))
        return Turn(g, int(ctx_len_B[rows.live].sum()))


class KeptKV:
    """Model turns on a multi-turn `sampler.Session`: the first call prefills the prompts,
    later ones feed each row's new observation tokens and decode on from its kept pages. Row
    b's episode token t is drawn with fold_in(fold_in(key, b), t)."""

    def __init__(self, session: sampler.Session, params):
        self.session, self.params, self.fed_B = session, params, None

    def __call__(self, rows: _Rows, prompts: "EpisodePrompts", limit_B, key, call: int) -> Turn:
        upto_B = (rows.used + limit_B).astype(np.int32)
        if self.fed_B is None:
            g = self.session.start(
                self.params, prompts.tokens_BT, prompts.lengths_B, rng=key, row_limits=upto_B
            )
            fed = int(prompts.lengths_B.sum())
        else:
            pos_N = np.arange(rows.tokens.shape[1])[None]
            new_BN = (pos_N >= self.fed_B[:, None]) & (pos_N < rows.used[:, None]) & ~rows.act
            given_BN = new_BN & rows.live[:, None]
            g = self.session.resume(self.params, rows.tokens, given_BN, rows.live, upto_B)
            fed = int(given_BN.sum())
        g = jax.device_get(g)
        self.fed_B = np.asarray(g.lengths)
        return Turn(_since(g, rows.used), fed)


def _since(g: sampler.Generation, used_B) -> sampler.Generation:
    """Each row's tokens from position used_B[b] on, moved to the front."""
    N = g.tokens.shape[1]
    idx_BN = np.minimum(used_B[:, None] + np.arange(N)[None], N - 1)
    n_B = np.maximum(np.asarray(g.lengths) - used_B, 0).astype(np.int32)
    keep_BN = np.arange(N)[None] < n_B[:, None]
    take = lambda x: np.where(keep_BN, np.take_along_axis(np.asarray(x), idx_BN, 1), 0)
    return sampler.Generation(take(g.tokens), take(g.logprobs), n_B)


def session_spec(spec: RolloutSpec, eos_ids, extra_stops) -> sampler.SamplerSpec:
    """A multi-turn Session's sampler spec: one row per episode, the episode's whole budget."""
    return turn_sampler_spec(spec, eos_ids, extra_stops)._replace(
        max_new_tokens=spec.max_new_tokens
    )


def make_turns(spec: RolloutSpec, model_config, params, eos_ids, extra_stops, *, mesh=None):
    """The model's turns of one batch of episodes: KeptKV (`rollout.keep_kv`), whose session
    decodes the whole episode budget, or Reprefill on `generate`, a turn per call."""
    if spec.rollout.keep_kv:
        s_spec = session_spec(spec, eos_ids, extra_stops)
        return KeptKV(sampler.Session(model_config, s_spec, mesh=mesh, turns=True), params)
    s_spec = turn_sampler_spec(spec, eos_ids, extra_stops)

    def generate(ctx_BT, len_B, limit_B, key):
        return sampler.generate(
            model_config, params, ctx_BT, len_B, s_spec, rng=key, mesh=mesh, row_limits=limit_B
        )

    return Reprefill(generate)


def _context(rows: _Rows, prompt_BT, prompt_len_B):
    """[B, Tp + N] each row's prompt then its episode so far (what the next call prefills)."""
    B, N = rows.tokens.shape
    ctx_BT = np.concatenate([prompt_BT, np.zeros((B, N), np.int32)], 1)
    for b in range(B):
        lp, u = prompt_len_B[b], rows.used[b]
        ctx_BT[b, lp : lp + u] = rows.tokens[b, :u]
    return ctx_BT


def _episode(rows: _Rows, b: int, prompt: str, answer: str) -> Episode:
    """Row b's Episode for its environment: only its own prompt, answer and turns."""
    turns, observations = rows.history[b]
    return Episode(prompt, answer, (*turns, rows.cur[b]), tuple(observations))


class EpisodePrompts(NamedTuple):
    """The rows' right-padded prompts [B, T], their lengths [B] and reference answers (text)."""

    tokens_BT: np.ndarray
    lengths_B: np.ndarray
    answers: list[str]


def run_episodes(
    turns: Callable, spec: RolloutSpec, side: EnvSide, prompts: EpisodePrompts, key
) -> Episodes:
    """B episodes: model turns by `turns` (Reprefill or KeptKV), replies by `side.pool`."""
    prompt_BT, prompt_len_B, answers = prompts
    env, tokenizer = side.env, side.tokenizer
    B = prompt_BT.shape[0]
    N, T = spec.max_new_tokens, spec.rollout.turn_tokens or spec.max_new_tokens
    stops = Stops.of(side)
    rows, prefill = _Rows(B, N), 0
    texts = [tokenizer.decode(list(prompt_BT[b, : prompt_len_B[b]])) for b in range(B)]
    for call in range(4 * spec.rollout.max_turns * max(1, -(-N // T))):  # a bound, never reached
        if not rows.live.any():
            break
        limit_B = np.minimum(T, N - rows.used).astype(np.int32)
        g, fed = turns(rows, prompts, limit_B, key, call)
        prefill += fed
        calls = []
        for b in np.flatnonzero(rows.live):
            n = int(g.lengths[b])
            ids, logp = g.tokens[b, :n], g.logprobs[b, :n]
            if _after_turn(rows, b, ids, logp, limit_B[b], stops, tokenizer):
                calls.append(int(b))
        if calls:
            eps = [_episode(rows, b, texts[b], answers[b]) for b in calls]
            _answer(rows, calls, side.pool.map(env, eps), tokenizer, spec, env)
    return Episodes(
        rows.tokens, rows.logp, rows.act, rows.used, rows.env_reward, rows.turns,
        rows.calls, rows.errors, prefill,
    )  # fmt: skip


def episode_metrics(ep: Episodes, rewards_B, prompt_len_B) -> dict[str, float]:
    """Turns, tool calls and errors per episode, observation share, reward by turn count."""
    total = max(int(ep.lengths.sum()), 1)
    acts = int(ep.action_mask.sum())
    out = {
        "episode/turns_mean": float(ep.turns.mean()),
        "episode/tool_calls_mean": float(ep.tool_calls.mean()),
        "episode/tool_errors_mean": float(ep.tool_errors.mean()),
        "episode/tool_call_rate": float((ep.tool_calls > 0).mean()),
        "episode/observation_token_share": 1.0 - acts / total,
        # Tokens the model ran per episode token: > 1 when turns re-prefill, 1.0 with KV kept.
        "episode/forward_token_ratio": (ep.prefill_tokens + acts)
        / max(int(prompt_len_B.sum()) + total, 1),
    }
    r_B, called_B = np.asarray(rewards_B), ep.tool_calls > 0
    for name, rows in (("with_tool", called_B), ("without_tool", ~called_B)):
        if rows.any():  # the reward of episodes that called the environment, and of the rest
            out[f"episode/reward_{name}"] = float(r_B[rows].mean())
    for t in np.unique(ep.turns):
        out[f"episode/reward_at_{int(t)}_turns"] = float(
            np.asarray(rewards_B)[ep.turns == t].mean()
        )
    return out


def episode_text(tokenizer, tokens, action_mask, length) -> str:
    """An episode's text with each observation marked as [[obs: ...]]."""
    out, n = [], int(length)
    start = 0
    for t in range(1, n + 1):
        if t == n or action_mask[t] != action_mask[start]:
            piece = tokenizer.decode(list(np.asarray(tokens[start:t])))
            out.append(piece if action_mask[start] else f"[[obs: {piece}]]")
            start = t
    return "".join(out)


def answers_text(tokenizer, answer_tokens, answer_lengths) -> list[str]:
    """The reference answers of a batch as text."""
    return [
        tokenizer.decode(list(a[:n])) for a, n in zip(np.asarray(answer_tokens), answer_lengths)
    ]
