"""Environments for multi-turn rollouts: the protocol, the registry and a worker pool.

An environment answers a model turn that ended on one of its `stop_sequences` (a tool call,
a guess): it gets that row's `Episode` (its prompt, the problem's answer, the model turns and
observations so far) and returns a `Reply`: observation text the next turn reads, a reward
contribution and whether the episode is over. It sees only its own row. Environments run in
an `EnvPool` of worker processes with a timeout per call (ebpo_jax.tasks.envs.pool).

Register one like a task family: `@envs.register("mytool") class MyTool: ...`, or name a
built-in in `_REGISTRY`.
"""

from typing import NamedTuple, Protocol

from ebpo_jax.runtime.registry import Registry
from ebpo_jax.schema import ConfigError


class Episode(NamedTuple):
    """One row at a turn boundary: what its environment may read."""

    prompt: str
    answer: str  # the problem's reference answer (hidden from the policy)
    turns: tuple[str, ...]  # the model's turns so far; the last one just ended
    observations: tuple[str, ...]  # the replies to the earlier turns (len(turns) - 1)


class Reply(NamedTuple):
    """An environment's answer to one turn."""

    observation: str = ""  # appended to the row as context (no loss), then the model continues
    reward: float = 0.0  # added to the episode's reward
    done: bool = False  # end the episode here (no further model turn)
    error: bool = False  # a tool error (set by the pool on a crash or a timeout)


class Environment(Protocol):
    """A picklable object (module-level class) the pool's workers call."""

    stop_sequences: tuple[str, ...]  # a model turn ending on one of these calls `step`
    error_observation: str  # what a row reads after a crashed or timed-out call

    def step(self, episode: Episode) -> Reply: ...


_REGISTRY = Registry(
    lambda name, known: ConfigError(f"environment {name!r} is not one of {known}"),
    builtin={
        "calculator": "ebpo_jax.tasks.envs.calculator:Calculator",
        "guess": "ebpo_jax.tasks.envs.guess:GuessNumber",
    },
)


def register(name: str):
    """Class decorator: `@register("mytool") class MyTool: ...` (built with no arguments)."""
    return _REGISTRY.register(name)


def names() -> tuple[str, ...]:
    """Every environment name, built-ins included."""
    return _REGISTRY.names()


def get(name: str) -> Environment:
    """A new instance of environment `name`; ConfigError naming it if unknown."""
    return _REGISTRY.get(name)()
