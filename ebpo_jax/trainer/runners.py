"""The runners the host loop drives, over the same `step.Pieces`, and `make_runner`.

- `ScanRunner`, K > 1 steps per call (jittable reward): one jitted `lax.scan` of `train_step`;
- `HostRunner`, K == 1: jitted rollout on the sampler mesh -> host reward (if any) -> jitted
  update, so each phase is timed and a host reward (math-verify) can run in between;
- `pipeline.Pipeline`, rollout.max_staleness=1: rollout t+1 overlaps update t.

A runner is `runner(state, step, next_batches) -> (state, metrics [K]-stacked, phase times)`
(`next_batches()` gives the next [K]-stacked prompt batches on the host, which the runner
places: `Pieces.place`), with `policy(state)` (the sampler's weights), `view`
(trainer/policy.py), `sh` (the Shardings), `update` (the jitted update: aot.py compiles it),
`timer` (a watchdog.PhaseTimer: its phases' wall times, and which phase runs), `last_rollout`
(K == 1: the rollout the latest update consumed) and its own checkpoint entries:
`checkpoint_entries()`, `restore_targets(saved, directory)` (abstract targets of the entries
it restores) and `restored(tree)` (takes them back).
"""

import functools
import time

import jax
import numpy as np

from ebpo_jax.runtime.watchdog import PhaseTimer
from ebpo_jax.spec import RunSpec
from ebpo_jax.trainer import pipeline, policy
from ebpo_jax.trainer.shardings import Shardings
from ebpo_jax.trainer.state import TrainState
from ebpo_jax.trainer.step import Pieces, first, multi_step


class _Runner:
    """What the K-step and the K = 1 runner share: pieces, and no checkpoint entry."""

    def __init__(self, pieces: Pieces):
        self.pieces, self.sh, self.update = pieces, pieces.sh, pieces.update
        self.policy, self.view = pieces.policy, pieces.view
        self.last_rollout = None
        self.timer = PhaseTimer()

    def checkpoint_entries(self) -> dict:
        return {}

    def restore_targets(self, saved: dict, directory: str) -> dict:
        pipeline.refuse_inflight(saved, directory)  # another runner's entry: name the fix
        return {}

    def restored(self, tree: dict) -> None:
        pass


class ScanRunner(_Runner):
    """K > 1: K steps of `train_step` in one jitted lax.scan (phase times are NaN)."""

    def __init__(self, pieces: Pieces):
        super().__init__(pieces)
        sh = pieces.sh
        self.multi = jax.jit(
            functools.partial(multi_step, pieces.scan_body),
            out_shardings=(sh.state, sh.replicated),
            donate_argnums=0,
        )

    def __call__(self, state: TrainState, step: int, next_batches):
        with self.timer("scan_step"), jax.set_mesh(self.sh.mesh):  # phases inseparable
            state, m = self.multi(state, self.pieces.place(next_batches()))
            state, m = jax.block_until_ready((state, m))
        return state, m, {"perf/sample_time_s": np.nan, "perf/update_time_s": np.nan}


class HostRunner(_Runner):
    """K == 1: rollout (sampler mesh) -> host reward -> update (trainer mesh), each phase
    timed (the weight move, rollout, reward and update; prefill and decode are one program)."""

    def __call__(self, state: TrainState, step: int, next_batches):
        pieces, phase = self.pieces, self.timer
        t0 = time.perf_counter()
        with phase("weight_move"):  # the sampler's copy: LoRA merge, cast, move to its mesh
            weights = jax.block_until_ready(pieces.sampler_weights(pieces.policy(state)))
        if pieces.refill is not None:  # DAPO's rounds alternate sampling and the host reward
            with phase("rollout_refill"):
                ro = pieces.scored(state, first(pieces.place(next_batches())), 1, weights)
        else:
            with phase("rollout"):
                batch = first(pieces.place(next_batches()))
                ro = pieces.to_trainer(pieces.rollout_from(state, batch, 1, weights))
            if pieces.host_reward is not None:  # a jittable reward runs inside the rollout
                with phase("reward"):
                    ro = pieces.score(ro)
        t1 = time.perf_counter()
        self.last_rollout = ro
        with phase("update"):
            state, m = pieces.run_update(state, ro)
            m = jax.block_until_ready(jax.tree.map(lambda x: x[None], m))
        times = {"perf/sample_time_s": t1 - t0, "perf/update_time_s": time.perf_counter() - t1}
        if pieces.episodes is not None:
            times.update(pieces.episodes.last_metrics)
        if pieces.refill is not None:
            times.update(pieces.refill.last_metrics)
        return state, m, times


def make_runner(spec: RunSpec, task, optimizer, sh: Shardings, view: policy.Policy):
    """The runner `spec` asks for, over the run's policy `view`: the stale pipeline, the
    K-step scan, or K = 1 via the host."""
    pieces = Pieces(spec, task, optimizer, sh, view)
    if spec.rollout.rollout.max_staleness:
        return pipeline.Pipeline(pieces, spec.run.total_steps)
    return ScanRunner(pieces) if spec.run.steps_per_jit > 1 else HostRunner(pieces)
