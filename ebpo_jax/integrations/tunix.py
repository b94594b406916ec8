"""EBPO as tunix's "ebpo" advantage estimator (checked with google-tunix 0.1.7).

tunix's GRPO learner calls `get_advantage_estimator(name)(rewards=[P*G], num_generations=G)`
once per rollout micro-batch, in training and in evaluation, with no state and no mode;
`register` puts an `EBPOStream` behind that name, and `track_mode` tells it which calls
are evaluation (from the learner's own `mode` argument), so evaluation never feeds the prior.
"""

import functools

import numpy as np
from jax.typing import ArrayLike
from tunix.rl import function_registry

from ebpo_jax.integrations.stream import EBPOStream


class TunixEstimator:
    """tunix's estimator signature over an `EBPOStream`: flat rewards in, flat advantages out."""

    def __init__(self, stream: EBPOStream):
        """Wraps `stream` (which holds the EB state to checkpoint)."""
        self.stream = stream

    def __call__(self, rewards: ArrayLike, num_generations: int) -> np.ndarray:
        """Advantages `[P*G]` for tunix's prompt-major rewards `[P*G]`."""
        rewards = np.asarray(rewards, np.float32)
        if rewards.ndim != 1 or rewards.size % num_generations:
            raise ValueError(
                f"tunix rewards must be flat [P*G] with G={num_generations}, "
                f"got shape {rewards.shape}"
            )
        return np.asarray(self.stream(rewards.reshape(-1, num_generations))).reshape(-1)


def register(
    name: str = "ebpo",
    *,
    prompts_per_step: int | None = None,
    **options: float | str | bool,
) -> EBPOStream:
    """Registers EBPO under `name` in tunix's registry; returns its state-holding stream.

    `prompts_per_step`: prompts per optimizer step (tunix's `mini_batch_size`); the other
    keywords go to `EBPOStream` (num_clusters, forgetting, eps, normalize, mu_glob).
    """
    stream = EBPOStream(prompts_per_step=prompts_per_step, **options)
    function_registry.register_advantage_estimator(name)(TunixEstimator(stream))
    return stream


def track_mode(learner: object, stream: EBPOStream) -> None:
    """Makes `learner`'s evaluation rollouts score against `stream` without updating it."""
    generate = learner._generate_and_compute_advantage  # tunix 0.1.7's only mode-aware hook

    @functools.wraps(generate)
    def with_mode(training_input, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode")
        if getattr(mode, "value", mode) != "eval":
            return generate(training_input, *args, **kwargs)
        with stream.evaluating():
            return generate(training_input, *args, **kwargs)

    learner._generate_and_compute_advantage = with_mode
