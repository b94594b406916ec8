"""Group rollouts: G samples per prompt, jittable rewards, DAPO's dynamic-sampling refill."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax import sampler
from ebpo_jax.tasks import DIFFICULTIES, TOPICS


class Rollout(NamedTuple):
    """P prompt groups of G completions, grouped prompt-major."""

    prompt_tokens: jax.Array  # [P, Tp]
    prompt_lengths: jax.Array  # [P]
    answer_tokens: jax.Array  # [P, A]
    answer_lengths: jax.Array  # [P]
    cluster_ids: jax.Array  # [P] EB cluster of each prompt (see num_clusters)
    tokens: jax.Array  # [P, G, N] completions, pad 0 after the stop
    logprobs: jax.Array  # [P, G, N] sampler log-probs at temperature 1 (old policy)
    lengths: jax.Array  # [P, G] generated tokens including EOS
    rewards: jax.Array  # [P, G] task reward, before any shaping
    group_valid: jax.Array  # [P] bool: False for a slot no refill round could fill
    generated_tokens: jax.Array  # int32: tokens generated this step, kept or dropped
    all_same_frac: jax.Array  # share of generated groups whose rewards were all equal


RewardFn = Callable[[Any, Any, Any, Any], jax.Array]


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


def num_clusters(config, topic_count: int | None = None) -> int:
    """How many EB priors `config.eb_clusters` asks for: none, per topic, per (topic, level).

    `topic_count` is a math source's number of topics; None = the synthetic tasks' TOPICS.
    """
    topics = len(TOPICS) if topic_count is None else topic_count
    if config.eb_clusters == "cell" and topic_count is not None:
        raise ValueError("eb_clusters='cell' needs the synthetic tasks' difficulty levels")
    return {"none": 1, "topic": topics, "cell": topics * len(DIFFICULTIES)}[config.eb_clusters]


def cluster_ids(config, batch) -> jax.Array:
    """[P] int32 EB cluster of each prompt of a PromptBatch (synthetic or math).

    `topic_ids` index the source's topics (TOPICS, or a MathPromptSource's topic_names);
    `cell` also uses the synthetic tasks' integer difficulty levels.
    """
    topic = jnp.asarray(batch.topic_ids, jnp.int32)
    if config.eb_clusters == "topic":
        return topic
    if config.eb_clusters == "cell":
        return topic * len(DIFFICULTIES) + jnp.asarray(batch.difficulty, jnp.int32) - 1
    return jnp.zeros_like(topic)


def make_rollout_fn(
    config, model_config, reward_fn: RewardFn | None, eos_id: int | Sequence[int], mesh=None
):
    """rollout(params, batch, rng) -> Rollout; pure, jittable, scan-able.

    `batch` is a tasks.PromptBatch (from tasks.PromptSource or data.MathPromptSource) with
    `batch_rounds(config) * P` prompts. `eos_id` is the id, or list of ids (an HF chat
    model's EOS and end-of-turn tokens), the sampler stops on.
    With `reward_fn=None` the rewards are left at 0 for a host reward to fill in
    (jit -> host -> jit); dynamic sampling then needs the jittable reward.
    """
    if reward_fn is None and config.dapo.dynamic_sampling:
        raise ValueError("dapo.dynamic_sampling needs a jittable reward_fn (got a host reward)")
    P, G = config.prompts_per_step, config.group_size
    N = config.sampler.max_new_tokens
    dynamic = bool(config.dapo.dynamic_sampling)
    rounds = 1 + config.dapo.max_extra_rounds if dynamic else 1

    per_call = config.sampler.get("prompts_per_call", 0) or P
    if P % per_call:
        raise ValueError(f"sampler.prompts_per_call={per_call} does not divide P={P}")
    chunks = P // per_call

    def sample(params, b, rng):
        """Generation for b's P prompts, `chunks` sampler calls of `per_call` prompts each."""
        call = lambda tokens, lengths, key: sampler.generate(
            model_config,
            params,
            tokens,
            lengths,
            max_new_tokens=N,
            rng=key,
            temperature=config.sampler.temperature,
            top_p=config.sampler.top_p,
            top_k=config.sampler.top_k,
            eos_id=eos_id,
            num_samples=G,
            mesh=mesh,
        )
        if chunks == 1:
            return call(b.prompt_tokens, b.prompt_lengths, rng)
        # One call after another (lax.map), so only one chunk's KV cache is alive at a time.
        # Chunk c samples with fold_in(rng, c): its rows' keys restart at 0 inside the call.
        split = lambda x: x.reshape(chunks, per_call, *x.shape[1:])
        gen = jax.lax.map(
            lambda a: call(a[0], a[1], jax.random.fold_in(rng, a[2])),
            (split(b.prompt_tokens), split(b.prompt_lengths), jnp.arange(chunks)),
        )
        return jax.tree.map(lambda x: x.reshape(P * G, *x.shape[2:]), gen)

    def one_round(params, batch, r, rng) -> Rollout:
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, r * P, P, axis=0)
        b = jax.tree.map(take, batch)
        gen = sample(params, b, jax.random.fold_in(rng, r))
        rep = lambda x: jnp.repeat(x, G, axis=0)
        if reward_fn is None:  # a host reward fills these in between the two jits
            rewards_PG = jnp.zeros((P, G), jnp.float32)
        else:
            rewards_B = reward_fn(
                gen.tokens, gen.lengths, rep(b.answer_tokens), rep(b.answer_lengths)
            )
            rewards_PG = rewards_B.reshape(P, G).astype(jnp.float32)
        return Rollout(
            prompt_tokens=b.prompt_tokens,
            prompt_lengths=b.prompt_lengths,
            answer_tokens=b.answer_tokens,
            answer_lengths=b.answer_lengths,
            cluster_ids=cluster_ids(config, b),
            tokens=gen.tokens.reshape(P, G, N),
            logprobs=gen.logprobs.reshape(P, G, N).astype(jnp.float32),
            lengths=gen.lengths.reshape(P, G).astype(jnp.int32),
            rewards=rewards_PG,
            group_valid=jnp.ones((P,), bool),
            generated_tokens=gen.lengths.sum().astype(jnp.int32),
            all_same_frac=all_same(rewards_PG).mean(),
        )

    def rollout(params, batch, rng) -> Rollout:
        if batch.prompt_tokens.shape[0] != rounds * P:
            raise ValueError(
                f"batch has {batch.prompt_tokens.shape[0]} prompts, expected {rounds} x {P}"
            )
        first = one_round(params, batch, 0, rng)
        if not dynamic:
            return first
        keep = ~all_same(first.rewards)
        buf, filled = compact(first, jnp.zeros((P,), bool), first, keep)
        carry = (buf, filled, jnp.int32(1), first.generated_tokens, all_same(first.rewards).sum())

        def cond(c):
            return (c[2] < rounds) & ~jnp.all(c[1])

        def body(c):
            buf, filled, r, ntok, nsame = c
            new = one_round(params, batch, r, rng)
            same = all_same(new.rewards)
            buf, filled = compact(buf, filled, new, ~same)
            return buf, filled, r + 1, ntok + new.generated_tokens, nsame + same.sum()

        buf, filled, r, ntok, nsame = jax.lax.while_loop(cond, body, carry)
        return buf._replace(
            group_valid=filled,
            generated_tokens=ntok,
            all_same_frac=nsame / (r * P).astype(jnp.float32),
        )

    return rollout


def batch_rounds(config) -> int:
    """How many P-prompt rounds one step's Batch holds."""
    return 1 + config.dapo.max_extra_rounds if config.dapo.dynamic_sampling else 1
