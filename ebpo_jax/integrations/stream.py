"""EBPO for hosts that call a stateless advantage estimator (tunix, verl, TRL).

Such a host calls its estimator once per rollout micro-batch, in training and in evaluation,
and passes no state. `EBPOStream` keeps the EB state between calls and folds rewards into it
only for training, and only once per training step: every micro-batch of a step is scored
against the state at the step's start, and the step's rewards are merged together when the
step's last prompt has been seen (one merge, so `forgetting` decays once per step). With one
call per step it gives exactly `eb_advantage` over the same stream.
"""

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ebpo_jax.advantages import EBState, Welford, eb_advantage, init_eb_state, merge_batch


class EBPOStream:
    """EBPO's carried state between a host framework's estimator calls."""

    def __init__(
        self,
        *,
        prompts_per_step: int | None = None,
        num_clusters: int = 1,
        forgetting: float = 1.0,
        **options: float | str | bool,
    ):
        """`prompts_per_step`: prompts in one training step (None: every call is a step)."""
        if prompts_per_step is not None and prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1 or None, got {prompts_per_step}")
        self.prompts_per_step = prompts_per_step
        self.forgetting = forgetting
        self.options = options  # eb_advantage's keywords: eps, normalize, mu_glob, per_batch
        self.state = init_eb_state(num_clusters)
        self.training = True
        self._pending: list[np.ndarray] = []  # this step's rewards [P_i, G], not yet merged

    def __call__(self, rewards_PG: ArrayLike) -> jax.Array:
        """Advantages `[P, G]` of one micro-batch; training calls fold in at the step's end."""
        rewards_PG = np.asarray(rewards_PG, np.float32)
        adv_PG, state = eb_advantage(
            rewards_PG, self.state, forgetting=self.forgetting, **self.options
        )
        if not self.training:
            return adv_PG
        if self.prompts_per_step is None:
            self.state = state
            return adv_PG
        seen = self.pending_prompts + rewards_PG.shape[0]
        if seen > self.prompts_per_step:
            raise ValueError(
                f"a micro-batch would cross a step: {seen} prompts, "
                f"prompts_per_step={self.prompts_per_step}"
            )
        self._pending.append(rewards_PG)
        if seen == self.prompts_per_step:
            self.end_step()
        return adv_PG

    @property
    def pending_prompts(self) -> int:
        """Prompts of the current step scored but not yet merged into the state."""
        return sum(r.shape[0] for r in self._pending)

    def end_step(self) -> None:
        """Merges the current step's rewards into the state (once), as one batch."""
        if self._pending:
            batch_PG = np.concatenate(self._pending)
            self.state = merge_batch(self.state, batch_PG, forgetting=self.forgetting)
        self._pending = []

    @contextlib.contextmanager
    def evaluating(self) -> Iterator["EBPOStream"]:
        """Within it, calls are scored against the state and leave it untouched."""
        before, self.training = self.training, False
        try:
            yield self
        finally:
            self.training = before

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything to checkpoint, as numpy arrays (np.savez or orbax)."""
        leaves = {
            f"{part}_{field}": np.asarray(x)
            for part, welford in self.state._asdict().items()
            for field, x in welford._asdict().items()
        }
        width = self._pending[0].shape[1] if self._pending else 0
        pending = np.concatenate(self._pending) if self._pending else np.zeros((0, width))
        return leaves | {"pending_rewards": pending.astype(np.float32)}

    def load_state_dict(self, saved: dict[str, ArrayLike]) -> None:
        """Restores what `state_dict` returned."""
        welford = lambda part: Welford(
            *(jnp.asarray(saved[f"{part}_{field}"], jnp.float32) for field in Welford._fields)
        )
        self.state = EBState(*(welford(part) for part in EBState._fields))
        pending = np.asarray(saved["pending_rewards"], np.float32)
        self._pending = [pending] if pending.shape[0] else []
