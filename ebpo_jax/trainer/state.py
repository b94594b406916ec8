"""The train state pytree and the optimizer built from the OptimSpec (its shardings:
trainer/shardings.py)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ebpo_jax.advantages import EBState, init_eb_state
from ebpo_jax.spec import OptimSpec


class TrainState(NamedTuple):
    """Everything a step reads and writes; a checkpoint saves `saved()` of it."""

    params: Any
    opt_state: Any
    eb_state: EBState
    step: jax.Array  # int32 scalar: train steps done
    rng: jax.Array  # raw uint32 key data, so checkpoints hold plain arrays
    ref_params: Any  # frozen reference policy for the KL term; None when kl_coef == 0
    nonfinite_run: jax.Array  # int32: consecutive steps with a skipped (non-finite) update
    generated_tokens: jax.Array  # int32: every generated token so far, kept or dropped
    # LoRA (model.lora.rank > 0): the frozen base weights, `params` being the adapters and
    # the KL reference the base itself; None for full fine-tuning. Not checkpointed.
    base: Any = None

    def saved(self) -> dict:
        """What a checkpoint saves: all but the frozen LoRA base, which every start rebuilds
        from the task's source."""
        return {k: v for k, v in self._asdict().items() if v is not None and k != "base"}


def learning_rate_schedule(opt: OptimSpec) -> optax.Schedule:
    """Linear warm-up over `warmup_steps` train steps, then constant or cosine to the end."""
    per = opt.updates_per_step
    warm = opt.optimizer.warmup_steps * per
    total = max(opt.run.total_steps * per, warm + 1)
    if opt.optimizer.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0,
            opt.optimizer.learning_rate,
            warm,
            total,
            end_value=opt.optimizer.learning_rate * opt.optimizer.final_lr_frac,
        )
    if warm == 0:
        return optax.constant_schedule(opt.optimizer.learning_rate)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, opt.optimizer.learning_rate, warm),
            optax.constant_schedule(opt.optimizer.learning_rate),
        ],
        [warm],
    )


def make_optimizer(opt: OptimSpec) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (clip first, as verl/TRL do)."""
    return optax.chain(
        optax.clip_by_global_norm(opt.optimizer.clip_norm),
        optax.adamw(
            learning_rate_schedule(opt),
            b1=opt.optimizer.b1,
            b2=opt.optimizer.b2,
            weight_decay=opt.optimizer.weight_decay,
        ),
    )


def init_train_state(
    params, optimizer, *, seed: int, num_clusters: int = 1, with_ref: bool = False, base=None
):
    """A fresh TrainState at step 0 around `params` (the adapters when `base` is given)."""
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        # Own buffers per leaf: init_eb_state shares one zeros array, which donation rejects.
        eb_state=jax.tree.map(jnp.copy, init_eb_state(num_clusters)),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
        ref_params=jax.tree.map(jnp.copy, params) if with_ref else None,
        nonfinite_run=jnp.zeros((), jnp.int32),
        generated_tokens=jnp.zeros((), jnp.int32),
        base=base,
    )
