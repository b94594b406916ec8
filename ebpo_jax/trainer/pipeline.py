"""The one-step-stale pipeline (rollout.max_staleness=1): rollout t+1 is dispatched with
params t on the sampler's own devices, then update t on rollout t on the trainer's; JAX's
asynchronous dispatch runs both at once, and the host waits only when it needs both.

The pipeline owns the rollout in flight and its checkpoint entry, so a resume continues
with the rollout the next update consumes. Rollout t+1's key is fold_in(rng_t, 2) (rollout
0's, like every rollout at staleness 0, fold_in(rng_t, 1)), so runs are deterministic given
the seed.
"""

import time

import jax

from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.runtime.watchdog import PhaseTimer
from ebpo_jax.schema import ConfigError
from ebpo_jax.trainer.state import TrainState
from ebpo_jax.trainer.step import Pieces, first

INFLIGHT = "inflight_rollout"  # checkpoint entry: the rollout the next update consumes


def refuse_inflight(saved: dict, directory: str) -> None:
    """ConfigError when a checkpoint holds an in-flight rollout a staleness-0 run would drop."""
    if INFLIGHT in saved:
        raise ConfigError(
            f"{directory} holds an in-flight rollout (saved at rollout.max_staleness=1): "
            "resume with rollout.max_staleness=1"
        )


class Pipeline:
    """A runner (trainer/runners.py): update t on rollout t while rollout t+1 samples."""

    def __init__(self, pieces: Pieces, total_steps: int):
        self.pieces, self.sh, self.update = pieces, pieces.sh, pieces.update
        self.policy, self.view = pieces.policy, pieces.view
        self.total_steps = total_steps
        self.inflight = None  # rollout t on the trainer mesh, or None: none sampled yet
        self.last_rollout = None
        self.timer = PhaseTimer()  # rollout_update (overlapped) and reward

    def __call__(self, state: TrainState, step: int, next_batches):
        place = lambda: self.pieces.place(next_batches())
        if self.inflight is None:  # step 0 (or a checkpoint without one): no overlap
            with self.timer("rollout"):
                self.inflight = self.first_rollout(state, place())
        batches = place() if step + 1 < self.total_steps else None
        state, m, times, self.inflight = self.overlapped(state, self.inflight, batches)
        return state, m, times

    def first_rollout(self, state: TrainState, batches):
        """Rollout t from params t (step 0, or a resume with none in flight)."""
        return self.pieces.finish(self.pieces.rollout_from(state, first(batches), 1))

    def overlapped(self, state: TrainState, rollout, batches):
        """Update t on `rollout` (rollout t) while rollout t+1 samples `batches` with params t
        on the sampler's devices.

        Returns (state t+1, metrics, times, rollout t+1 on the trainer mesh, or None when
        `batches` is None: the last step). Both programs are dispatched before anything waits.
        """
        pieces = self.pieces
        t0 = time.perf_counter()
        nxt = None
        if batches is not None:  # key: a function of state t's rng, distinct from update t's
            nxt = pieces.rollout_from(state, first(batches), 2)
        t_update = time.perf_counter()
        self.last_rollout = rollout
        with self.timer("rollout_update"):
            state, m = pieces.run_update(state, rollout)
            r_ready, u_ready = _ready_times(nxt, m)
        t_finish = time.perf_counter()
        if nxt is not None:  # the move to the trainer's devices and the host reward
            with self.timer("reward"):
                nxt = pieces.finish(nxt)
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

    def checkpoint_entries(self) -> dict:
        """The rollout in flight, saved beside the state (none after the last step)."""
        return {} if self.inflight is None else {INFLIGHT: self.inflight._asdict()}

    def restore_targets(self, saved: dict, directory: str) -> dict:
        """The in-flight rollout's abstract target, placed as the update reads it, if saved."""
        if INFLIGHT not in saved:
            return {}
        abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return {INFLIGHT: jax.tree.map(abstract, saved[INFLIGHT], self.sh.rollout._asdict())}

    def restored(self, tree: dict) -> None:
        """Take the restored in-flight rollout (if any) out of `tree`."""
        inflight = tree.pop(INFLIGHT, None)
        self.inflight = None if inflight is None else Rollout(**inflight)


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
