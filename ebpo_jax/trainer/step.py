"""The step builder: one RL step (rollout -> reward -> update) from the RunSpec and the Task.

`make_train_step` is the pure `lax.scan` body for a jittable reward. `Step` wraps the same
rollout and update functions for the host loop, in one of two shapes:
- K > 1 steps per call (jittable reward): one jitted `lax.scan` of `train_step`;
- K == 1: jitted rollout on the sampler mesh -> host reward (if any) -> jitted update, so each
  phase is timed and a host reward (math-verify) can run in between.
"""

import functools
import time

import jax
import numpy as np

from ebpo_jax import distributed
from ebpo_jax.spec import RunSpec
from ebpo_jax.trainer.rollout import make_rollout_fn
from ebpo_jax.trainer.shardings import Shardings
from ebpo_jax.trainer.state import TrainState
from ebpo_jax.trainer.update import make_update_fn


def _no_clusters(batch):
    return jax.numpy.zeros(batch.prompt_tokens.shape[:1], jax.numpy.int32)


def train_step(rollout_fn, update_fn, state: TrainState, batch):
    """(state, batch) -> (state, metrics): sample with the current params, then update."""
    key = jax.random.wrap_key_data(state.rng)
    ro = rollout_fn(state.params, batch, jax.random.fold_in(key, 1))
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
    return functools.partial(train_step, rollout, update)


class Step:
    """(state, batches [K, ...]) -> (state, metrics [K]-stacked, phase times), jitted once."""

    def __init__(self, spec: RunSpec, task, optimizer, sh: Shardings):
        self.K, self.sh = spec.steps_per_jit, sh
        self.last_rollout = None  # K == 1: the latest step's rollout (sample logging)
        self.host_reward = None if task.reward.jittable else task.reward.fn
        reward_fn = task.reward.fn if task.reward.jittable else None
        mc, stops = task.model_config, task.stop_ids
        rollout = make_rollout_fn(
            spec.rollout, mc, reward_fn, stops, task.cluster_ids, sh.sampler_mesh
        )
        update = make_update_fn(spec.update, mc, optimizer, stops)
        out = (sh.state, sh.replicated)
        self.rollout = jax.jit(rollout, out_shardings=sh.sampler_rollout)
        self.update = jax.jit(
            update, in_shardings=(sh.state, sh.rollout), out_shardings=out, donate_argnums=0
        )
        scan_body = functools.partial(train_step, rollout, update)
        self.multi = jax.jit(
            functools.partial(multi_step, scan_body), out_shardings=out, donate_argnums=0
        )

    def __call__(self, state: TrainState, batches):
        if self.K > 1:
            with jax.set_mesh(self.sh.mesh):
                state, m = self.multi(state, batches)
            state, m = jax.block_until_ready((state, m))
            return state, m, {"perf/sample_time_s": np.nan, "perf/update_time_s": np.nan}
        return self._one(state, jax.tree.map(lambda x: x[0], batches))

    def _one(self, state: TrainState, batch):
        """K == 1: rollout (sampler mesh) -> host reward -> update (trainer mesh), timed."""
        sh = self.sh
        t0 = time.perf_counter()
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
        params = state.params
        if sh.sampler_mesh is not sh.mesh:  # weights move device to device, not via the host
            params = jax.device_put(params, sh.sampler_params)
            batch = jax.device_put(batch, sh.batches(batch, axis=0, on_sampler=True))
            key = jax.device_put(key, jax.sharding.NamedSharding(sh.sampler_mesh, _REPLICATED))
        with jax.set_mesh(sh.sampler_mesh):
            ro = self.rollout(params, batch, key)
        ro = jax.block_until_ready(jax.device_put(ro, sh.rollout))
        if self.host_reward is not None:
            rewards_PG = np.asarray(self.host_reward(distributed.to_host(ro)), np.float32)
            ro = ro._replace(rewards=put(rewards_PG, sh.rollout.rewards))
        t1 = time.perf_counter()
        self.last_rollout = ro
        with jax.set_mesh(sh.mesh):
            state, m = self.update(state, ro)
        m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
        times = {"perf/sample_time_s": t1 - t0, "perf/update_time_s": time.perf_counter() - t1}
        return state, m, times


_REPLICATED = jax.sharding.PartitionSpec()


def put(tree, shardings):
    """Host arrays (identical on every process) -> global arrays placed by `shardings`."""

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)
