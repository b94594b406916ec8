"""The multi-turn rollout: a step's P x G episodes (trainer/episodes.py) as a `Rollout`.

Replaces the jitted single-turn rollout when the task has an environment (`Task.env`):
sampler calls run on the sampler mesh from the host turn loop; the episode's reward is the
task's reward on the whole episode plus the environment's contributions.
"""

import atexit

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.rollout.single_turn import Rollout, all_same
from ebpo_jax.spec import RolloutSpec
from ebpo_jax.tasks import episodes
from ebpo_jax.tasks.envs.pool import EnvPool


class MultiTurnRollout:
    """rollout(params, batch, key) -> (Rollout, host metrics): episodes with `task.env`."""

    def __init__(self, spec: RolloutSpec, task, mesh=None):
        self.spec, self.task = spec, task
        stops = episodes.stop_token_ids(task.tokenizer, task.env)
        self.turns = lambda params: episodes.make_turns(
            spec, task.model_config, params, task.stop_ids, stops, mesh=mesh
        )
        self.pool = EnvPool(spec.rollout.env_workers, timeout_s=spec.rollout.env_timeout_s)
        atexit.register(self.pool.close)
        self.side = episodes.EnvSide(task.env, self.pool, task.tokenizer, task.stop_ids)
        self.reward = jax.jit(task.reward.fn) if task.reward.jittable else task.reward.fn
        self.last_metrics: dict[str, float] = {}

    def __call__(self, params, batch, key) -> Rollout:
        P, G = self.spec.prompts, self.spec.group_size
        b = jax.device_get(batch)
        rep = lambda x: np.repeat(np.asarray(x), G, axis=0)
        tok = self.task.tokenizer
        prompts = episodes.EpisodePrompts(
            rep(b.prompt_tokens),
            rep(b.prompt_lengths),
            episodes.answers_text(tok, rep(b.answer_tokens), rep(b.answer_lengths)),
        )
        ep = self._episodes(params, prompts, key)
        ro = self._rollout(b, ep, np.zeros((P, G), np.float32))
        if self.task.reward.jittable:
            ans = (rep(b.answer_tokens), rep(b.answer_lengths))
            task_r = np.asarray(self.reward(ep.tokens, ep.lengths, *ans)).reshape(P, G)
        else:  # a host reward reads the whole rollout (jit -> host -> jit, as single-turn)
            task_r = np.asarray(self.reward(jax.device_get(ro)), np.float32)
        rewards_B = task_r.reshape(-1) + ep.env_reward
        self.last_metrics = episodes.episode_metrics(ep, rewards_B, rep(b.prompt_lengths))
        rewards_PG = jnp.asarray(rewards_B.reshape(P, G), jnp.float32)
        return ro._replace(rewards=rewards_PG, all_same_frac=all_same(rewards_PG).mean())

    def round(self, params, batch, r: int, key) -> Rollout:
        """DAPO's refill round r: the batch's rows r*P .. r*P+P-1 with key fold_in(key, r)."""
        P = self.spec.prompts
        part = jax.tree.map(lambda x: x[r * P : (r + 1) * P], jax.device_get(batch))
        return self(params, part, jax.random.fold_in(key, r))

    def _episodes(self, params, prompts: episodes.EpisodePrompts, key) -> episodes.Episodes:
        """The rows in sampler calls of prompts_per_call x G rows (the KV pages of one call's
        rows are what must fit); call c draws with fold_in(key, c) when there are several."""
        rows = self.spec.prompts_per_call * self.spec.group_size
        B = len(prompts.lengths_B)
        parts = []
        for c, lo in enumerate(range(0, B, rows)):
            part = episodes.EpisodePrompts(*(x[lo : lo + rows] for x in prompts))
            k = key if rows >= B else jax.random.fold_in(key, c)
            turns = self.turns(params)
            parts.append(episodes.run_episodes(turns, self.spec, self.side, part, k))
        return episodes.concat(parts)

    def _rollout(self, b, ep: episodes.Episodes, rewards_PG) -> Rollout:
        """The episodes as a Rollout (prompt-major groups)."""
        P, G, N = self.spec.prompts, self.spec.group_size, self.spec.max_new_tokens
        shape = lambda x, dt: jnp.asarray(x.reshape(P, G, N), dt)
        return Rollout(
            prompt_tokens=jnp.asarray(b.prompt_tokens),
            prompt_lengths=jnp.asarray(b.prompt_lengths),
            answer_tokens=jnp.asarray(b.answer_tokens),
            answer_lengths=jnp.asarray(b.answer_lengths),
            index=jnp.asarray(b.index, jnp.int32),
            cluster_ids=jnp.asarray(self.task.cluster_ids(b), jnp.int32),
            tokens=shape(ep.tokens, jnp.int32),
            logprobs=shape(ep.logprobs, jnp.float32),
            lengths=jnp.asarray(ep.lengths.reshape(P, G), jnp.int32),
            rewards=jnp.asarray(rewards_PG),
            group_valid=jnp.ones((P,), bool),
            generated_tokens=jnp.int32(ep.action_mask.sum()),
            all_same_frac=jnp.float32(0),
            action_mask=shape(ep.action_mask, bool),
        )

    def close(self) -> None:
        self.pool.close()
