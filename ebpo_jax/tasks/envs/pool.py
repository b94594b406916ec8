"""Worker processes that run environment calls, each cut at a timeout.

A call that raises, crashes its worker or overruns `timeout_s` gives its row the
environment's `error_observation` (Reply.error=True, counted), never an exception in the
trainer: a stuck tool costs at most one timeout per turn boundary. The processes are an
`ebpo_jax.runtime.workers.WorkerPool` (a timed-out or dead worker is killed and replaced; workers
start from a `forkserver`, since the parent has JAX threads, and die with the pool's owner).

Not `rewards.RewardPool`: that pool scores (response, answer) -> float with math-verify
preloaded; this one sends any picklable environment and Episode and gets a Reply back.
"""

from collections.abc import Sequence
from functools import partial

from ebpo_jax.runtime.workers import LoadError, PoolOwner, WorkerPool
from ebpo_jax.tasks.envs import Environment, Episode, Reply


def _safe_step(env: Environment, episode: Episode) -> tuple[Reply, str | None]:
    """env.step(episode), or the error Reply and the exception text."""
    try:
        reply = env.step(episode)
        if not isinstance(reply, Reply):
            raise TypeError(f"{type(env).__name__}.step returned {type(reply).__name__}, not Reply")
        return reply, None
    except Exception as e:  # noqa: BLE001  a tool's failure is the row's, not the run's
        return error_reply(env), f"{type(e).__name__}: {e}"


def _step(env: Environment, episode: Episode) -> tuple:
    """What a pool worker runs: the Reply's fields (a failed call's error Reply)."""
    return tuple(_safe_step(env, episode)[0])


def error_reply(env: Environment) -> Reply:
    """What a row gets when its environment call failed: the error observation, episode over."""
    return Reply(observation=getattr(env, "error_observation", ""), done=True, error=True)


class EnvPool(PoolOwner):
    """`workers` processes answering environment calls (0: in this process, no timeout).

    Each worker loads a map's environment once (within `load_timeout_s`, the time to import
    its module) before its calls, each cut at `timeout_s`.
    """

    def __init__(self, workers: int = 2, *, timeout_s: float = 10.0, load_timeout_s=120.0):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(
                f"EnvPool needs workers >= 0 and timeout_s > 0, got {workers}, {timeout_s}"
            )
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        super().__init__(
            WorkerPool(workers, preload=("ebpo_jax.tasks.envs.pool",), name="environment worker")
        )
        self._local = workers == 0
        self.num_errors = 0  # calls that raised, crashed or timed out, over the pool's life

    def map(self, env: Environment, episodes: Sequence[Episode]) -> list[Reply]:
        """env.step of every episode, in order; failed calls give error replies."""
        if self._local:
            out = [_safe_step(env, e)[0] for e in episodes]
        else:
            try:
                outcomes = self._workers.map(
                    partial(_step, env),
                    episodes,
                    timeout_s=self.timeout_s,
                    load_timeout_s=self.load_timeout_s,
                )
            except LoadError as e:
                raise RuntimeError(
                    f"environment workers cannot load {type(env).__name__} ({e}); define "
                    "it in an importable module, not in __main__"
                ) from None
            out = [error_reply(env) if o.error else Reply(*o.value) for o in outcomes]
        self.num_errors += sum(r.error for r in out)
        return out
