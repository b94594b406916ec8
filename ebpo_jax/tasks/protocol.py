"""The task protocol: what a run trains on, and the registry of task families.

A family is a function `build(spec: TaskSpec, *, mesh, log) -> Task` registered under a name
(`task.family` in the config; "" picks `math` when `data.path` is set, else `arithmetic`).
Adding one is one new module plus a built-in entry in `_REGISTRY` (or `@register` in user code).
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ebpo_jax import models
from ebpo_jax.runtime.registry import Registry
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import TaskSpec
from ebpo_jax.tasks import envs, episodes


class Reward(NamedTuple):
    """A task's reward: jittable `(tokens, lengths, answers, answer_lengths) -> [B]`, or a host
    function `(rollout with host arrays) -> rewards [P, G]` (then steps run jit -> host -> jit)."""

    fn: Callable
    jittable: bool


class Task(NamedTuple):
    """Everything the trainer needs to know about the policy and its data."""

    tokenizer: Any
    model_config: models.ModelConfig
    params: Any  # the initial policy
    source: Any  # prompt batches: next_batches(k), state(), restore()
    reward: Reward
    cluster_ids: Callable[[Any], Any]  # jittable PromptBatch -> [P] int32 EB cluster ids
    num_clusters: int  # EB priors
    stop_ids: int | tuple[int, ...]  # the sampler stops on any of these; they end a response
    evaluate: Callable[[Any], dict[str, float]] | None  # params -> {set name: pass@1}
    close: Callable[[], None] = lambda: None  # stops reward worker processes
    base_source: str = ""  # what `params` came from (HF folder, SFT cache file, seeded init)
    base_sha256: str = ""  # the initial policy's digest (synthetic families: sft.params_digest)
    env: Any = None  # an envs.Environment: multi-turn episodes (trainer/multiturn.py)


# Built-in families, imported on first use: "module:function".
_REGISTRY = Registry(
    lambda name, known: ConfigError(f"task.family={name!r} is not one of {known}"),
    builtin={
        "arithmetic": "ebpo_jax.tasks.families.arithmetic:build",
        "calculator": "ebpo_jax.tasks.families.multiturn:build_calculator",
        "guess": "ebpo_jax.tasks.families.multiturn:build_guess",
        "math": "ebpo_jax.tasks.families.math_data:build",
        "reasoning": "ebpo_jax.tasks.families.reasoning:build",
    },
)


def register(name: str):
    """Decorator: `@register("mytask") def build(spec, *, mesh=None, log=print) -> Task`."""
    return _REGISTRY.register(name)


def families() -> tuple[str, ...]:
    """Every family name, built-ins included."""
    return _REGISTRY.names()


def get(name: str) -> Callable[..., Task]:
    """The builder of family `name`; ConfigError naming `task.family` if unknown."""
    return _REGISTRY.get(name)


def build_task(spec: TaskSpec, *, mesh=None, log=print, reward: Reward | None = None) -> Task:
    """The Task `spec` describes; `reward` (a caller's) replaces its family's when given."""
    task = get(spec.family)(spec, mesh=mesh, log=log)
    if reward is not None:
        task = task._replace(reward=reward)
    if spec.task.env:  # episodes with this environment, whatever the family
        task = task._replace(env=_checked_env(spec.task.env, task.tokenizer))
    return task


def _checked_env(name: str, tokenizer):
    """Environment `name`, once the task's tokenizer can write each of its stop sequences."""
    env = envs.get(name)
    for stop in env.stop_sequences:
        try:
            ids = episodes.encode_text(tokenizer, stop)
        except ValueError as e:
            ids, why = [], f" ({e})"
        else:
            why = ""
        if not ids:
            raise ConfigError(
                f"task.env={name!r}: the task's tokenizer cannot write its stop sequence "
                f"{stop!r}{why}"
            )
    return env


def model_config_from(model_spec, vocab_size: int) -> models.ModelConfig:
    """The policy's ModelConfig: the preset, the vocabulary size, `model.batch_invariant`, then
    `model.overrides`."""
    overrides = model_spec.overrides.to_dict()
    fields = {"vocab_size": vocab_size, "batch_invariant": model_spec.batch_invariant}
    return models.get_config(model_spec.preset, **{**fields, **overrides})


def tokenizer_vocab(tokenizer) -> int:
    """An HF tokenizer's len() (its vocab_size leaves out added chat tokens), else vocab_size."""
    return len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size


VALIDATION = "validation"  # the eval set that picks hyperparameters: never in eval/pass@1


def mean_pass(per_set: dict[str, float]) -> float:
    """The test sets' mean pass@1, without the validation set and the bands ("<set>/<band>",
    views of a set's problems) (NaN with no test set)."""
    test = [v for name, v in per_set.items() if name != VALIDATION and "/" not in name]
    return float(sum(test) / len(test)) if test else math.nan
