"""The step builder: one RL step (rollout -> reward -> update) from the RunSpec and the Task.

`make_train_step` is the pure `lax.scan` body for a jittable reward. `Pieces` holds what every
runner (trainer/runners.py, trainer/pipeline.py) shares: the jitted rollout on the sampler
mesh, the host reward, the jitted update on the trainer mesh, the sampler's weights, and the
scan body the K-step runner jits.
"""

import functools

import jax
import numpy as np

from ebpo_jax.rollout.multi_turn import MultiTurnRollout
from ebpo_jax.rollout.refill import HostRefill
from ebpo_jax.rollout.single_turn import make_rollout_fn, make_round_fn
from ebpo_jax.runtime import distributed
from ebpo_jax.sharding import put
from ebpo_jax.spec import RolloutSpec, RunSpec
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer.shardings import Shardings
from ebpo_jax.trainer.state import TrainState
from ebpo_jax.trainer.update import make_update_fn


def _no_clusters(batch):
    return jax.numpy.zeros(batch.prompt_tokens.shape[:1], jax.numpy.int32)


def train_step(rollout_fn, update_fn, policy_fn, state: TrainState, batch):
    """(state, batch) -> (state, metrics): sample with the current policy, then update."""
    key = jax.random.wrap_key_data(state.rng)
    ro = rollout_fn(policy_fn(state), batch, jax.random.fold_in(key, 1))
    return update_fn(state, ro)


def multi_step(step_fn, state: TrainState, batches):
    """K steps in one lax.scan over batches stacked on a leading [K] axis."""
    return jax.lax.scan(step_fn, state, batches)


def make_train_step(
    spec: RunSpec, model_config, optimizer, reward_fn, stop_ids, cluster_ids=None, *, mesh=None
):
    """train_step(state, batch) -> (state, metrics): a pure lax.scan body.

    `reward_fn` is jittable (tokens, lengths, answers, answer_lengths) -> [B];
    `cluster_ids(batch) -> [P]` the task's EB clusters (None: one cluster).
    """
    rollout = make_rollout_fn(
        spec.rollout, model_config, reward_fn, stop_ids, cluster_ids or _no_clusters, mesh
    )
    update = make_update_fn(spec.update, model_config, optimizer, stop_ids)
    sampled = policy_lib.of(spec, model_config).sampled
    return functools.partial(train_step, rollout, update, sampled)


class Pieces:
    """The jitted rollout and update of a run, and the helpers every runner shares."""

    def __init__(self, spec: RunSpec, task, optimizer, sh: Shardings, view: policy_lib.Policy):
        self.sh, self.view = sh, view
        self.host_reward = None if task.reward.jittable else task.reward.fn
        self.episodes = self.refill = self.scan_body = None
        # DAPO's dynamic sampling scored on the host: each round its own sampler program.
        host_rounds = spec.rollout.dapo.dynamic_sampling and (
            task.env is not None or not task.reward.jittable
        )
        update = make_update_fn(spec.update, task.model_config, optimizer, task.stop_ids)
        self.update = jax.jit(
            update,
            in_shardings=(sh.state, sh.rollout),
            out_shardings=(sh.state, sh.replicated),
            donate_argnums=0,
        )
        # The sampler's weights: state.params itself, or (LoRA) one merge per step; then
        # their cast and move (AOT compiles the same programs from `weights`).
        sampler = spec.rollout.sampler
        self.weights = policy_lib.SamplerWeights(
            view, sampler.param_dtype, sh, relaid=sampler.expert_parallel
        )
        self.policy = self.weights.sampled
        if task.env is None:
            rollout = self._single_turn(spec.rollout, task, host_rounds)
            self.scan_body = functools.partial(train_step, rollout, update, view.sampled)
        else:  # one step per call (config.checks); the turn loop scores its own episodes
            ep = self.episodes = MultiTurnRollout(spec.rollout, task, sh.sampler_mesh)
            self.host_reward = None
            on_sampler = lambda ro: jax.device_put(ro, sh.sampler_rollout)
            self.rollout = lambda params, batch, key: on_sampler(ep(params, batch, key))
            if host_rounds:  # round r of a refilled step, round 0 being the rollout
                self.round = lambda params, batch, r, key: on_sampler(
                    ep.round(params, batch, r, key)
                )
                self.rollout = lambda params, batch, key: self.round(params, batch, 0, key)
        if host_rounds:
            self.refill = HostRefill(spec.rollout, sh)

    def _single_turn(self, spec: RolloutSpec, task, host_rounds: bool):
        """The jitted rollout on the sampler mesh and, with `host_rounds`, round r's program;
        returns the rollout function (the scan body's)."""
        sh, mc, stops, clusters = self.sh, task.model_config, task.stop_ids, task.cluster_ids
        reward_fn = task.reward.fn if task.reward.jittable else None
        rollout = make_rollout_fn(spec, mc, reward_fn, stops, clusters, sh.sampler_mesh)
        self.rollout = jax.jit(rollout, out_shardings=sh.sampler_rollout)
        if host_rounds:
            round_fn = make_round_fn(spec, mc, stops, clusters, sh.sampler_mesh)
            self.round = jax.jit(round_fn, out_shardings=sh.sampler_rollout)
        return rollout

    def place(self, batches):
        """Host prompt batches ([K]-stacked) placed on the trainer mesh."""
        return self.sh.place_batches(batches)

    def scored(self, state: TrainState, batch, stream: int, weights=None):
        """rollout_from then finish; with a host-scored DAPO step, every refill round.
        `weights`: the policy's sampler_weights, if already made."""
        if self.refill is None:
            return self.finish(self.rollout_from(state, batch, stream, weights))
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), stream)
        if weights is None:
            weights = self.sampler_weights(self.policy(state))
        return self.refill(lambda r: self.finish(self.sample(weights, batch, key, r, moved=True)))

    def sampler_weights(self, params):
        """The sampler's copy of `params`: cast, and moved to its mesh (dispatched, not waited)."""
        return self.weights(params)

    def sample(self, params, batch, key, round_: int = 0, *, moved: bool = False):
        """Dispatch a rollout (round `round_` of a host-refilled step) on the sampler mesh
        (asynchronous: nothing waits for it); `moved`: `params` are already the sampler's
        (sampler_weights)."""
        sh = self.sh
        params = params if moved else self.sampler_weights(params)
        if sh.sampler_mesh is not sh.mesh:
            batch = jax.device_put(batch, sh.batches(batch, axis=0, on_sampler=True))
            key = jax.device_put(key, jax.sharding.NamedSharding(sh.sampler_mesh, _REPLICATED))
        with jax.set_mesh(sh.sampler_mesh):
            if round_:
                return self.round(params, batch, jax.numpy.int32(round_), key)
            return self.rollout(params, batch, key)

    def finish(self, ro):
        """A sampler-mesh rollout on the trainer mesh, ready, its host reward filled in."""
        return self.score(self.to_trainer(ro))

    def to_trainer(self, ro):
        """A sampler-mesh rollout on the trainer mesh, ready."""
        return jax.block_until_ready(jax.device_put(ro, self.sh.rollout))

    def score(self, ro):
        """`ro` with its host reward filled in (as it is without one)."""
        if self.host_reward is not None:
            rows = ro.rewards.shape[0]  # each process scores its block of the prompts
            rewards_PG = distributed.map_row_blocks(self.host_reward, distributed.to_host(ro), rows)
            rewards_PG = np.asarray(rewards_PG, np.float32)
            ro = ro._replace(rewards=put(rewards_PG, self.sh.rollout.rewards))
        return ro

    def rollout_from(self, state: TrainState, batch, stream: int, weights=None):
        """Dispatch a rollout of `batch` with state's policy, key fold_in(rng, stream);
        `weights`: that policy's sampler_weights, if already made."""
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), stream)
        if weights is not None:
            return self.sample(weights, batch, key, moved=True)
        return self.sample(self.policy(state), batch, key)

    def run_update(self, state: TrainState, ro):
        """Dispatch the update on the trainer mesh: (state, metrics), nothing waited for."""
        with jax.set_mesh(self.sh.mesh):
            return self.update(state, ro)


def first(batches):
    """Step 0 of [K]-stacked batches."""
    return jax.tree.map(lambda x: x[0], batches)


_REPLICATED = jax.sharding.PartitionSpec()
