"""The step builder: one RL step (rollout -> reward -> update) from the RunSpec and the Task.

`make_train_step` is the pure `lax.scan` body for a jittable reward. `Step` wraps the same
rollout and update functions for the host loop, in one of two shapes:
- K > 1 steps per call (jittable reward): one jitted `lax.scan` of `train_step`;
- K == 1: jitted rollout on the sampler mesh -> host reward (if any) -> jitted update, so each
  phase is timed and a host reward (math-verify) can run in between;
- K == 1 at rollout.max_staleness=1 (`first_rollout`, then `overlapped`): rollout t+1 is
  dispatched with params t on the sampler's own devices, then update t on rollout t on the
  trainer's; JAX's asynchronous dispatch runs both at once, and the host waits only when it
  needs both. Rollout t+1's key is fold_in(rng_t, 2) (rollout 0's, like every rollout at
  staleness 0, fold_in(rng_t, 1)), so runs are deterministic given the seed.
"""

import functools
import time

import jax
import numpy as np

from ebpo_jax import distributed
from ebpo_jax.models import lora
from ebpo_jax.spec import RunSpec
from ebpo_jax.trainer.multiturn import MultiTurnRollout
from ebpo_jax.trainer.rollout import make_rollout_fn
from ebpo_jax.trainer.shardings import Shardings
from ebpo_jax.trainer.state import TrainState
from ebpo_jax.trainer.update import make_update_fn


def _no_clusters(batch):
    return jax.numpy.zeros(batch.prompt_tokens.shape[:1], jax.numpy.int32)


def policy_params(update_spec, model_config, state: TrainState):
    """The weights the sampler runs: the params, or LoRA's base + A B merged in the compute
    dtype (faster to sample than the adapter path: benchmarks/lora_bench.py)."""
    if update_spec.lora is None:
        return state.params
    return lora.merge(state.base, state.params, update_spec.lora, dtype=model_config.dtype)


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
    policy = functools.partial(policy_params, spec.update, model_config)
    return functools.partial(train_step, rollout, update, policy)


class Step:
    """(state, batches [K, ...]) -> (state, metrics [K]-stacked, phase times), jitted once."""

    def __init__(self, spec: RunSpec, task, optimizer, sh: Shardings):
        self.K, self.sh = spec.run.steps_per_jit, sh
        self.last_rollout = None  # K == 1: the rollout the latest update consumed (samples log)
        self.host_reward = None if task.reward.jittable else task.reward.fn
        reward_fn = task.reward.fn if task.reward.jittable else None
        mc, stops = task.model_config, task.stop_ids
        rollout = make_rollout_fn(
            spec.rollout, mc, reward_fn, stops, task.cluster_ids, sh.sampler_mesh
        )
        update = make_update_fn(spec.update, mc, optimizer, stops)
        out = (sh.state, sh.replicated)
        self.rollout = jax.jit(rollout, out_shardings=sh.sampler_rollout)
        self.episodes = None  # a task with an environment: the host turn loop samples
        if task.env is not None:
            if self.K != 1:
                raise ValueError(f"a multi-turn task needs steps_per_jit=1, got {self.K}")
            self.episodes = MultiTurnRollout(spec.rollout, task, sh.sampler_mesh)
            self.host_reward = None  # the episodes score themselves (task + environment)
            self.rollout = lambda params, batch, key: jax.device_put(
                self.episodes(params, batch, key), sh.sampler_rollout
            )
        # sampler.param_dtype: the sampler's copy of the weights in another dtype (bfloat16).
        dtype = spec.rollout.sampler.param_dtype
        self.cast = None
        if dtype:
            cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
            self.cast = jax.jit(cast, out_shardings=sh.state.params)
        self.update = jax.jit(
            update, in_shardings=(sh.state, sh.rollout), out_shardings=out, donate_argnums=0
        )
        policy = functools.partial(policy_params, spec.update, mc)
        # The sampler's weights: state.params itself, or (LoRA) one merge per step.
        self.policy = policy if spec.update.lora is None else jax.jit(policy)
        scan_body = functools.partial(train_step, rollout, update, policy)
        self.multi = jax.jit(
            functools.partial(multi_step, scan_body), out_shardings=out, donate_argnums=0
        )

    def __call__(self, state: TrainState, batches):
        if self.K > 1:
            with jax.set_mesh(self.sh.mesh):
                state, m = self.multi(state, batches)
            state, m = jax.block_until_ready((state, m))
            return state, m, {"perf/sample_time_s": np.nan, "perf/update_time_s": np.nan}
        return self._one(state, _first(batches))

    def _one(self, state: TrainState, batch):
        """K == 1: rollout (sampler mesh) -> host reward -> update (trainer mesh), timed."""
        t0 = time.perf_counter()
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
        ro = self._finish(self._sample(self.policy(state), batch, key))
        t1 = time.perf_counter()
        self.last_rollout = ro
        with jax.set_mesh(self.sh.mesh):
            state, m = self.update(state, ro)
        m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
        times = {"perf/sample_time_s": t1 - t0, "perf/update_time_s": time.perf_counter() - t1}
        if self.episodes is not None:
            times.update(self.episodes.last_metrics)
        return state, m, times

    def _sample(self, params, batch, key):
        """Dispatch a rollout on the sampler mesh (asynchronous: nothing waits for it)."""
        sh = self.sh
        if self.cast is not None:  # on the trainer's devices: half the bytes to move
            with jax.set_mesh(sh.mesh):
                params = self.cast(params)
        if sh.sampler_mesh is not sh.mesh:  # weights move device to device, not via the host
            params = jax.device_put(params, sh.sampler_params)
            batch = jax.device_put(batch, sh.batches(batch, axis=0, on_sampler=True))
            key = jax.device_put(key, jax.sharding.NamedSharding(sh.sampler_mesh, _REPLICATED))
        with jax.set_mesh(sh.sampler_mesh):
            return self.rollout(params, batch, key)

    def _finish(self, ro):
        """A sampler-mesh rollout on the trainer mesh, ready, its host reward filled in."""
        ro = jax.block_until_ready(jax.device_put(ro, self.sh.rollout))
        if self.host_reward is not None:
            rewards_PG = np.asarray(self.host_reward(distributed.to_host(ro)), np.float32)
            ro = ro._replace(rewards=put(rewards_PG, self.sh.rollout.rewards))
        return ro

    def first_rollout(self, state: TrainState, batches):
        """Staleness 1: rollout t from params t (step 0, or a resume with none in flight)."""
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
        return self._finish(self._sample(self.policy(state), _first(batches), key))

    def overlapped(self, state: TrainState, rollout, batches):
        """Staleness 1: update t on `rollout` (rollout t) while rollout t+1 samples `batches`
        with params t on the sampler's devices.

        Returns (state t+1, metrics, times, rollout t+1 on the trainer mesh, or None when
        `batches` is None: the last step). Both programs are dispatched before anything waits.
        """
        t0 = time.perf_counter()
        nxt = None
        if batches is not None:  # key: a function of state t's rng, distinct from update t's
            key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 2)
            nxt = self._sample(self.policy(state), _first(batches), key)
        t_update = time.perf_counter()
        self.last_rollout = rollout
        with jax.set_mesh(self.sh.mesh):
            state, m = self.update(state, rollout)
        r_ready, u_ready = _ready_times(nxt, m)
        t_finish = time.perf_counter()
        if nxt is not None:  # the move to the trainer's devices and the host reward
            nxt = self._finish(nxt)
        sample_s = (r_ready - t0) + (time.perf_counter() - t_finish) if nxt is not None else 0.0
        m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
        times = {
            "perf/sample_time_s": sample_s,
            "perf/update_time_s": u_ready - t_update,
            # Seconds both programs were in flight at once (0: they ran one after the other).
            "perf/overlap_s": max(0.0, min(r_ready, u_ready) - t_update)
            if nxt is not None
            else 0.0,
        }
        return state, m, times, nxt


def _first(batches):
    return jax.tree.map(lambda x: x[0], batches)


def _ready_times(*trees, poll_s: float = 1e-3) -> list[float]:
    """perf_counter time at which each tree's arrays became ready (None: at once); polls."""
    leaves = [[x for x in jax.tree.leaves(t) if isinstance(x, jax.Array)] for t in trees]
    done = [None if ls else time.perf_counter() for ls in leaves]
    while any(d is None for d in done):
        for i, ls in enumerate(leaves):
            if done[i] is None and all(x.is_ready() for x in ls):
                done[i] = time.perf_counter()
        time.sleep(poll_s)
    return done


_REPLICATED = jax.sharding.PartitionSpec()


def put(tree, shardings):
    """Host arrays (identical on every process) -> global arrays placed by `shardings`."""

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)
