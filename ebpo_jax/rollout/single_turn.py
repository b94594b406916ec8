"""Group rollouts: G samples per prompt, jittable rewards, DAPO's dynamic-sampling refill."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax import sampler
from ebpo_jax.spec import RolloutSpec


class Rollout(NamedTuple):
    """P prompt groups of G completions, grouped prompt-major."""

    prompt_tokens: jax.Array  # [P, Tp]
    prompt_lengths: jax.Array  # [P]
    answer_tokens: jax.Array  # [P, A]
    answer_lengths: jax.Array  # [P]
    index: jax.Array  # [P] each prompt's index in its source (a host reward looks it up)
    cluster_ids: jax.Array  # [P] EB cluster of each prompt (the task's cluster_ids)
    tokens: jax.Array  # [P, G, N] completions, pad 0 after the stop
    logprobs: jax.Array  # [P, G, N] sampler log-probs at temperature 1 (old policy)
    lengths: jax.Array  # [P, G] generated tokens including EOS
    rewards: jax.Array  # [P, G] task reward, before any shaping
    group_valid: jax.Array  # [P] bool: False for a slot no refill round could fill
    generated_tokens: jax.Array  # int32: tokens generated this step, kept or dropped
    all_same_frac: jax.Array  # share of generated groups whose rewards were all equal
    # [P, G, N] bool: True on tokens the policy sampled, False on environment observations
    # (multi-turn episodes): only actions get loss, KL, entropy and count in normalisers.
    action_mask: jax.Array
    # Routing replay (mixture of experts): the sampler's experts per token, the Generation's
    # routing as [P, G, ...] ({"prompt", "comp"}); None when not recorded.
    routing: Any = None


RewardFn = Callable[[Any, Any, Any, Any], jax.Array]  # (tokens, lengths, answers, answer_lengths)
ClusterFn = Callable[[Any], jax.Array]  # PromptBatch -> [P] int32 EB cluster ids


def all_same(rewards_PG) -> jax.Array:
    """[P] bool: every reward in the group is equal (GRPO's zero-signal case)."""
    return jnp.all(rewards_PG == rewards_PG[:, :1], axis=-1)


def compact(buffer: Rollout, filled_P, new: Rollout, keep_P) -> tuple[Rollout, jax.Array]:
    """Fill `buffer`'s empty slots with `new`'s kept groups, order preserved; returns filled."""
    P = filled_P.shape[0]
    keys_2P = jnp.concatenate([filled_P, keep_P])
    order_P = jnp.argsort(~keys_2P, stable=True)[:P]
    pick = lambda a, b: jnp.concatenate([a, b])[order_P]
    merged = jax.tree.map(
        lambda a, b: pick(a, b) if getattr(a, "ndim", 0) and a.shape[0] == P else a, buffer, new
    )
    return merged, keys_2P[order_P]


def sampler_spec_of(spec: RolloutSpec, stop_ids) -> sampler.SamplerSpec:
    """What one sampler call of the rollout draws: G samples per prompt, its slots and pages."""
    return sampler.SamplerSpec.from_config(
        spec.sampler, spec.moe, num_samples=spec.group_size, eos_ids=stop_ids
    )


def _sample(spec: RolloutSpec, model_config, stop_ids, mesh, params, b, rng):
    """Generation for b's P prompts: P / prompts_per_call sampler calls, one after another."""
    P, per_call = spec.prompts, spec.prompts_per_call
    chunks = P // per_call

    sampler_spec = sampler_spec_of(spec, stop_ids)

    def call(tokens, lengths, key):
        gen = sampler.generate(
            model_config, params, tokens, lengths, sampler_spec, rng=key, mesh=mesh
        )
        return gen._replace(stats=None)  # per row only: the chunks stack on rows

    if chunks == 1:
        return call(b.prompt_tokens, b.prompt_lengths, rng)
    # lax.map keeps one chunk's KV cache alive at a time. Chunk c samples with
    # fold_in(rng, c): its rows' keys restart at 0 inside the call.
    split = lambda x: x.reshape(chunks, per_call, *x.shape[1:])
    gen = jax.lax.map(
        lambda a: call(a[0], a[1], jax.random.fold_in(rng, a[2])),
        (split(b.prompt_tokens), split(b.prompt_lengths), jnp.arange(chunks)),
    )
    return jax.tree.map(lambda x: x.reshape(P * spec.group_size, *x.shape[2:]), gen)


class Round(NamedTuple):
    """How a round draws and scores its prompts, built once per rollout function."""

    spec: RolloutSpec
    sample: Callable  # (params, PromptBatch, rng) -> Generation
    reward_fn: RewardFn | None  # None: a host reward fills the rewards in
    cluster_ids_fn: ClusterFn


def _one_round(how: Round, params, batch, r, rng):
    """Round r's P prompts (rows r*P .. r*P+P-1 of `batch`) sampled and, if jittable, scored."""
    spec, sample, reward_fn, cluster_ids_fn = how
    P, G, N = spec.prompts, spec.group_size, spec.max_new_tokens
    b = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, r * P, P, axis=0), batch)
    gen = sample(params, b, jax.random.fold_in(rng, r))
    rep = lambda x: jnp.repeat(x, G, axis=0)
    if reward_fn is None:  # a host reward fills these in between the two jits
        rewards_PG = jnp.zeros((P, G), jnp.float32)
    else:
        rewards_B = reward_fn(gen.tokens, gen.lengths, rep(b.answer_tokens), rep(b.answer_lengths))
        rewards_PG = rewards_B.reshape(P, G).astype(jnp.float32)
    return Rollout(
        prompt_tokens=b.prompt_tokens,
        prompt_lengths=b.prompt_lengths,
        answer_tokens=b.answer_tokens,
        answer_lengths=b.answer_lengths,
        index=jnp.asarray(b.index, jnp.int32),
        cluster_ids=jnp.asarray(cluster_ids_fn(b), jnp.int32),
        tokens=gen.tokens.reshape(P, G, N),
        logprobs=gen.logprobs.reshape(P, G, N).astype(jnp.float32),
        lengths=gen.lengths.reshape(P, G).astype(jnp.int32),
        rewards=rewards_PG,
        group_valid=jnp.ones((P,), bool),
        generated_tokens=gen.lengths.sum().astype(jnp.int32),
        all_same_frac=all_same(rewards_PG).mean(),
        action_mask=jnp.ones((P, G, N), bool),
        routing=jax.tree.map(lambda x: x.reshape(P, G, *x.shape[1:]), gen.routing),
    )


def absorb(buf: Rollout, filled_P, ntok, nsame, new: Rollout):
    """One round into the buffer: `new`'s spread groups fill empty slots, the rest counted."""
    same_P = all_same(new.rewards)
    buf, filled_P = compact(buf, filled_P, new, ~same_P)
    return buf, filled_P, ntok + new.generated_tokens, nsame + same_P.sum()


def finish_refill(buf: Rollout, filled_P, rounds, ntok, nsame) -> Rollout:
    """The buffer as the step's rollout: unfilled slots invalid, every round's tokens counted."""
    return buf._replace(
        group_valid=filled_P,
        generated_tokens=jnp.asarray(ntok, jnp.int32),
        all_same_frac=nsame / (rounds * filled_P.shape[0]).astype(jnp.float32),
    )


def _refill(spec: RolloutSpec, round_fn, first: Rollout) -> Rollout:
    """DAPO dynamic sampling: all-equal groups are dropped and refilled from later rounds."""
    empty = jnp.zeros((spec.prompts,), bool)
    carry = (*absorb(first, empty, jnp.int32(0), jnp.int32(0), first), jnp.int32(1))

    def cond(c):
        return (c[-1] < spec.rounds) & ~jnp.all(c[1])

    def body(c):
        *acc, r = c
        return (*absorb(*acc, round_fn(r)), r + 1)

    buf, filled, ntok, nsame, r = jax.lax.while_loop(cond, body, carry)
    return finish_refill(buf, filled, jnp.asarray(r), ntok, nsame)


def make_round_fn(spec: RolloutSpec, model_config, stop_ids, cluster_ids_fn: ClusterFn, mesh=None):
    """round(params, batch, r, rng) -> round r's Rollout (rows r*P .. r*P+P-1 of the batch,
    key fold_in(rng, r)), rewards 0: DAPO's refill rounds when the host scores them."""
    sample = functools.partial(_sample, spec, model_config, stop_ids, mesh)
    return functools.partial(_one_round, Round(spec, sample, None, cluster_ids_fn))


def make_rollout_fn(
    spec: RolloutSpec,
    model_config,
    reward_fn: RewardFn | None,
    stop_ids: int | Sequence[int],
    cluster_ids_fn: ClusterFn,
    mesh=None,
):
    """rollout(params, batch, rng) -> Rollout; pure, jittable, scan-able.

    `batch` is a tasks.PromptBatch with `spec.batch_prompts` prompts. `stop_ids` is the id,
    or list of ids (an HF chat model's EOS and end-of-turn tokens), the sampler stops on;
    `cluster_ids_fn(batch) -> [P]` is the task's EB cluster of each prompt. With
    `reward_fn=None` the rewards stay 0 for a host reward to fill in (jit -> host -> jit);
    with DAPO's dynamic sampling that is round 0 alone (trainer/refill.py runs the others).
    """
    sample = functools.partial(_sample, spec, model_config, stop_ids, mesh)
    one_round = functools.partial(_one_round, Round(spec, sample, reward_fn, cluster_ids_fn))

    def rollout(params, batch, rng) -> Rollout:
        if batch.prompt_tokens.shape[0] != spec.batch_prompts:
            raise ValueError(
                f"batch has {batch.prompt_tokens.shape[0]} prompts, expected "
                f"{spec.rounds} x {spec.prompts}"
            )
        first = one_round(params, batch, 0, rng)
        if not spec.dapo.dynamic_sampling or reward_fn is None:
            return first
        return _refill(spec, lambda r: one_round(params, batch, r, rng), first)

    return rollout
