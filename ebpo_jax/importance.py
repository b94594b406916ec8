"""Sampler-vs-trainer mismatch: metrics, and truncated / masked importance sampling (TIS, MIS).

The sampler's log-probs (bfloat16, another mesh, or a stale policy) differ from the trainer's
for the same tokens. With `loss.recompute_old_logprobs` the trainer recomputes the old
log-probs with its own forward; the weights here then correct the policy gradient for
having sampled from the sampler's distribution, as verl's rollout correction does.

Levels, as verl's `rollout_is_level`: "token" uses each token's ratio; "sequence" the
product of the valid tokens' ratios, exp(sum of log-ratios) (unbiased, high variance);
"geometric" their geometric mean, exp(mean of log-ratios). All functions are pure and
jittable; weights carry no gradient.
"""

import jax
import jax.numpy as jnp

IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence", "geometric")
# exp(20) ~ 4.9e8: weights stay finite in float32 (verl's SAFETY_BOUND).
_LOG_BOUND = 20.0
_RATIO_BAND = 2.0  # mismatch/ratio_out_frac counts ratios outside [1/2, 2]


def _masked_mean(x_BT, mask_BT):
    w_BT = mask_BT.astype(jnp.float32)
    return jnp.where(mask_BT, x_BT, 0.0).sum() / jnp.maximum(w_BT.sum(), 1.0)


def mismatch_metrics(
    sampler_logp_BT: jax.Array, trainer_logp_BT: jax.Array, mask_BT: jax.Array
) -> dict[str, jax.Array]:
    """How far the sampler's log-probs are from the trainer's on the valid tokens.

    `mismatch/k3_kl` estimates KL(sampler || trainer) from the sampled tokens
    (E[r - log r - 1], r = pi_trainer / pi_sampler), as verl's `mismatch_k3_kl`.
    """
    mask_BT = mask_BT.astype(bool)
    log_r_BT = jnp.where(mask_BT, trainer_logp_BT - sampler_logp_BT, 0.0).astype(jnp.float32)
    abs_BT = jnp.abs(log_r_BT)
    clamped_BT = jnp.clip(log_r_BT, -_LOG_BOUND, _LOG_BOUND)
    k3_BT = jnp.exp(clamped_BT) - clamped_BT - 1.0
    return {
        "mismatch/abs_diff_mean": _masked_mean(abs_BT, mask_BT),
        "mismatch/abs_diff_max": abs_BT.max(),  # masked entries are 0
        "mismatch/k3_kl": _masked_mean(k3_BT, mask_BT),
        "mismatch/ratio_out_frac": _masked_mean(abs_BT > jnp.log(_RATIO_BAND), mask_BT),
    }


def _log_weights(log_r_BT, mask_BT, level):
    """The log importance ratio at `level`, one value per token `[B, T]`."""
    if level == "token":
        return log_r_BT
    sum_B1 = log_r_BT.sum(-1, keepdims=True)  # masked entries are 0
    if level == "geometric":
        sum_B1 = sum_B1 / jnp.maximum(mask_BT.sum(-1, keepdims=True), 1)
    return jnp.broadcast_to(sum_B1, log_r_BT.shape)


def _check(mode, level, cap, low, high):
    if mode not in IS_MODES:
        raise ValueError(f"is_correction mode must be one of {IS_MODES}, got {mode!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"is_correction level must be one of {IS_LEVELS}, got {level!r}")
    if mode == "tis" and not cap >= 1.0:
        raise ValueError(f"TIS cap must be >= 1, got {cap}")
    if mode == "mis" and not 0.0 < low <= 1.0 <= high:
        raise ValueError(f"MIS band needs 0 < low <= 1 <= high, got [{low}, {high}]")


def is_correction(
    trainer_old_logp_BT: jax.Array,
    sampler_logp_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    mode: str = "none",
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Importance weights for tokens sampled from the sampler: (weights_BT, mask_BT, metrics).

    "tis": weight min(pi_trainer / pi_sampler, cap), the mask unchanged. "mis": the mask
    drops the tokens (token level) or whole sequences (sequence levels) whose ratio leaves
    [low, high]; the kept ones are weighted by their ratio. "none": weights 1. Weights are 0
    wherever the returned mask is; use that mask as the loss mask (and for the denominators).
    """
    _check(mode, level, cap, low, high)
    mask_BT = mask_BT.astype(bool)
    log_r_BT = jnp.where(mask_BT, trainer_old_logp_BT - sampler_logp_BT, 0.0)
    log_w_BT = jax.lax.stop_gradient(_log_weights(log_r_BT.astype(jnp.float32), mask_BT, level))
    ratio_BT = jnp.exp(jnp.clip(log_w_BT, -_LOG_BOUND, _LOG_BOUND))
    keep_BT = mask_BT
    if mode == "none":
        ratio_BT = jnp.ones_like(ratio_BT)
    elif mode == "tis":
        ratio_BT = jnp.minimum(ratio_BT, cap)
    else:  # In log space, before the bound, so a huge sequence ratio is still rejected.
        in_band_BT = (log_w_BT >= jnp.log(low)) & (log_w_BT <= jnp.log(high))
        keep_BT = mask_BT & in_band_BT
    weights_BT = jnp.where(keep_BT, ratio_BT, 0.0)
    metrics = {
        "is/weight_mean": _masked_mean(weights_BT, keep_BT),
        "is/weight_max": weights_BT.max(),
        "is/truncated_frac": _masked_mean((mode == "tis") & (log_w_BT > jnp.log(cap)), mask_BT),
        "is/masked_frac": _masked_mean(mask_BT & ~keep_BT, mask_BT),
    }
    return weights_BT, keep_BT, metrics
