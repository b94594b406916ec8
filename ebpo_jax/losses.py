"""Policy-gradient losses: token log-probs, a registry of surrogates, aggregation, KL, entropy.

All functions are pure. Logits may be bf16; softmax math runs in float32, never in
float64, and targets are gathered by index (no one-hot of the vocabulary).

Surrogates (`ppo`, `gspo`, `gspo_token`, `cispo`, `clip_cov`, `kl_cov`, or your own via
`@register(name)`) map per-token log-probs to a per-token policy-gradient term; `policy_loss`
picks one by name and adds IS weights, aggregation, KL and entropy (`TokenTerms`,
`LossOptions`), so any advantage estimator fits any surrogate.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ebpo_jax import schema
from ebpo_jax.runtime.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """log p(target) under softmax(logits), float32 `[B, T]`."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return picked_BT - lse_BT


def token_entropy(logits_BTV: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position, float32 `[B, T]`."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)


def logprobs_from_hidden(
    hidden_BTD: jax.Array,
    w_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Token log-probs (and entropy) from final hidden states, `chunk_size` positions at a time.

    Only a `[B, chunk, V]` slice of logits exists at once, so long sequences with large
    vocabularies fit; gradients recompute each chunk (jax.checkpoint).
    """
    B, T, D = hidden_BTD.shape
    chunk = T if chunk_size is None else min(chunk_size, T)
    if T % chunk:
        raise ValueError(f"sequence length {T} is not a multiple of chunk_size {chunk}")

    @jax.checkpoint
    def one_chunk(args):
        h_BCD, t_BC = args
        logits_BCV = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV, preferred_element_type=jnp.float32)
        logp_BC = token_logprobs(logits_BCV, t_BC)
        ent_BC = token_entropy(logits_BCV) if with_entropy else jnp.zeros_like(logp_BC)
        return logp_BC, ent_BC

    h_NBCD = hidden_BTD.reshape(B, T // chunk, chunk, D).swapaxes(0, 1)
    t_NBC = targets_BT.reshape(B, T // chunk, chunk).swapaxes(0, 1)
    logp_NBC, ent_NBC = jax.lax.map(one_chunk, (h_NBCD, t_NBC))
    unchunk = lambda x_NBC: x_NBC.swapaxes(0, 1).reshape(B, T)
    return (unchunk(logp_NBC), unchunk(ent_NBC)) if with_entropy else unchunk(logp_NBC)


def kl_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio_BT = logp_BT - ref_logp_BT
    if estimator == "k1":
        return log_ratio_BT
    if estimator == "k2":
        return 0.5 * log_ratio_BT**2
    if estimator == "k3":
        # Clamped as verl's low_var_kl does: exp of a large ratio would blow up the loss.
        neg_BT = jnp.clip(-log_ratio_BT, -20.0, 20.0)
        return jnp.clip(jnp.exp(neg_BT) - neg_BT - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate(
    x_BT: jax.Array,
    mask_BT: jax.Array,
    mode: str = "token-mean",
    *,
    max_tokens: int | None = None,
    denominator: ArrayLike | None = None,
) -> jax.Array:
    """Reduce a per-token quantity to a scalar.

    `denominator` overrides the local normaliser (valid tokens for token-mean, non-empty
    sequences for the seq-mean modes) so that gradient accumulation over micro-batches
    equals one step on the full batch. `max_tokens` is Dr. GRPO's constant (default T):
    seq-mean-token-sum-norm divides the token sum by n_seq * T as TRL's dr_grpo loss does
    (verl's mode of that name divides by T alone, a factor n_seq larger).
    """
    w_BT = mask_BT.astype(jnp.float32)
    x_BT = jnp.where(mask_BT, x_BT, 0.0)
    if mode == "token-mean":
        denom = w_BT.sum() if denominator is None else denominator
        return x_BT.sum() / jnp.maximum(denom, 1.0)
    n_B = w_BT.sum(-1)
    denom = (n_B > 0).sum() if denominator is None else denominator
    denom = jnp.maximum(denom, 1.0)
    if mode == "seq-mean-token-mean":
        return (x_BT.sum(-1) / jnp.maximum(n_B, 1.0)).sum() / denom
    if mode == "seq-mean-token-sum":
        return x_BT.sum() / denom
    if mode == "seq-mean-token-sum-norm":
        horizon = x_BT.shape[-1] if max_tokens is None else max_tokens
        return x_BT.sum() / (denom * horizon)
    raise ValueError(f"agg must be one of {AGG_MODES}, got {mode!r}")


# Exp of a log-ratio above ~88 overflows float32 (then A = 0 gives 0 * inf = NaN); verl
# clamps at the same bound. The gradient is zero beyond it.
LOG_RATIO_CLAMP = 20.0


class Surrogate(NamedTuple):
    """A surrogate's per-token output: the loss term and where its ratio was clipped."""

    pg_BT: jax.Array  # float32 [B, T], minimised; aggregated by policy_loss
    clipped_low_BT: jax.Array  # bool [B, T], token-averaged into actor/clip_frac_low
    clipped_high_BT: jax.Array  # bool [B, T], token-averaged into actor/clip_frac_high
    selected_BT: jax.Array | None = None  # bool: Clip-/KL-Cov's chosen tokens (actor/cov_frac)


_config = schema.default_of(schema.Loss)  # the defaults are the config's, declared once

# CovOptions field -> its `loss.*` setting.
_COV_SETTINGS = {
    "clip_ratio": "clip_cov_ratio",
    "clip_lb": "clip_cov_lb",
    "clip_ub": "clip_cov_ub",
    "kl_ratio": "kl_cov_ratio",
    "kl_coef": "kl_cov_coef",
}


@dataclasses.dataclass(frozen=True)
class CovOptions:
    """Clip-Cov / KL-Cov knobs (Cui et al. 2025), with verl's `policy_loss.*` defaults."""

    clip_ratio: float = _config("clip_cov_ratio")  # Clip-Cov: share of tokens whose grad drops
    clip_lb: float = _config("clip_cov_lb")  # Clip-Cov: candidates have clip_lb < Cov < clip_ub
    clip_ub: float = _config("clip_cov_ub")
    kl_ratio: float = _config("kl_cov_ratio")  # KL-Cov: share of tokens (largest Cov) penalised
    kl_coef: float = _config("kl_cov_coef")  # KL-Cov: weight of |log pi - log pi_old| on them


_REGISTRY = Registry(
    lambda name, known: KeyError(f"unknown policy loss {name!r}; known: {', '.join(known)}")
)


def register(name: str, *, draws: bool = False) -> Callable[[Callable], Callable]:
    """Decorator adding a surrogate to the registry under `name`.

    A surrogate is `fn(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_low, clip_high,
    dual_clip, cov, noise_BT) -> Surrogate`; `dual_clip` is None when off, `cov` a
    CovOptions, `noise_BT` uniform [0, 1) draws (None unless `draws`: the surrogate samples).
    It is given the keyword options it names (every one when it takes `**kwargs`).
    """

    return _REGISTRY.register(name, *(("draws",) if draws else ()))


def draws(name: str) -> bool:
    """Whether surrogate `name` picks tokens at random (its TokenTerms need noise_BT)."""
    return _REGISTRY.marked(name, "draws")


def names() -> tuple[str, ...]:
    """All registered surrogate names."""
    return _REGISTRY.names()


def get(name: str) -> Callable[..., Surrogate]:
    """The surrogate registered as `name`."""
    return _REGISTRY.get(name)


@functools.cache
def _named_options(fn: Callable) -> frozenset[str] | None:
    """The keyword options surrogate `fn` names; None when it takes `**kwargs` (all of them)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def _call(surrogate: Callable, arrays: tuple, options: dict) -> Surrogate:
    """`surrogate(*arrays, **options)` with only the options it names."""
    named = _named_options(surrogate)
    return surrogate(*arrays, **{k: v for k, v in options.items() if named is None or k in named})


def _clipped_pg(ratio_BT, adv_BT, clip_low, clip_high, dual_clip):
    """PPO's pessimistic clipped term, with the dual clip on negative advantages."""
    pg_BT = jnp.maximum(
        -adv_BT * ratio_BT, -adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    )
    if dual_clip is not None:
        # Bounds the loss of a negative-advantage token whose ratio has exploded.
        pg_BT = jnp.where(adv_BT < 0, jnp.minimum(pg_BT, -adv_BT * dual_clip), pg_BT)
    return pg_BT


def _ppo_clip_flags(ratio_BT, adv_BT, clip_low, clip_high):
    return (adv_BT < 0) & (ratio_BT < 1.0 - clip_low), (adv_BT > 0) & (ratio_BT > 1.0 + clip_high)


def _token_log_ratio(logp_BT, old_logp_BT):
    return jnp.clip(logp_BT - old_logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_log_ratio(logp_BT, old_logp_BT, mask_BT):
    """log s_i = mean over the valid tokens of log(pi / pi_old), clamped; `[B]`."""
    n_B = mask_BT.sum(-1)
    sum_B = jnp.where(mask_BT, logp_BT - old_logp_BT, 0.0).sum(-1)
    return jnp.clip(sum_B / jnp.maximum(n_B, 1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register("ppo")
def ppo(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    clip_low: float, clip_high: float, dual_clip: float | None = None,
) -> Surrogate:
    """PPO: token ratio pi/pi_old, clipped to [1 - clip_low, 1 + clip_high] (clip-higher)."""
    del mask_BT
    ratio_BT = jnp.exp(_token_log_ratio(logp_BT, old_logp_BT))
    pg_BT = _clipped_pg(ratio_BT, adv_BT, clip_low, clip_high, dual_clip)
    return Surrogate(pg_BT, *_ppo_clip_flags(ratio_BT, adv_BT, clip_low, clip_high))


@register("gspo")
def gspo(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    clip_low: float, clip_high: float, dual_clip: float | None = None,
) -> Surrogate:
    """GSPO (Zheng et al. 2025): the sequence ratio s_i (geometric mean of the token ratios)
    clipped per sequence, its term repeated on every token of the sequence.

    The paper averages over sequences: use agg="seq-mean-token-mean" for its objective.
    `dual_clip` bounds a negative-advantage sequence as PPO's does a token (verl's GSPO has
    no dual clip: set it off to match).
    """
    s_BT = jnp.broadcast_to(
        jnp.exp(_seq_log_ratio(logp_BT, old_logp_BT, mask_BT))[:, None], logp_BT.shape
    )
    pg_BT = _clipped_pg(s_BT, adv_BT, clip_low, clip_high, dual_clip)
    return Surrogate(pg_BT, *_ppo_clip_flags(s_BT, adv_BT, clip_low, clip_high))


@register("gspo_token")
def gspo_token(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    clip_low: float, clip_high: float, dual_clip: float | None = None,
) -> Surrogate:
    """GSPO-token: per-token ratio sg[s_i] * pi / sg[pi], so each token carries its own
    advantage; with one advantage per sequence it equals `gspo` in value and gradient.

    verl's `gspo` loss is this form (its log-ratio clamp is 10, here 20).
    """
    log_s_B = jax.lax.stop_gradient(_seq_log_ratio(logp_BT, old_logp_BT, mask_BT))
    # logp - sg(logp) is exactly 0 in value, so the ratio's value is s_i to the last bit.
    ratio_BT = jnp.exp(logp_BT - jax.lax.stop_gradient(logp_BT) + log_s_B[:, None])
    pg_BT = _clipped_pg(ratio_BT, adv_BT, clip_low, clip_high, dual_clip)
    return Surrogate(pg_BT, *_ppo_clip_flags(ratio_BT, adv_BT, clip_low, clip_high))


@register("cispo")
def cispo(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    clip_low: float, clip_high: float,
) -> Surrogate:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi.

    Clipped tokens keep their gradient (PPO drops it). The weight is already at most
    1 + clip_high, so `dual_clip` does not apply. MiniMax-M1 sets no lower bound
    (clip_low = 1); the clip fractions count clipped weights whatever the advantage's sign.
    """
    del mask_BT
    ratio_BT = jnp.exp(_token_log_ratio(logp_BT, old_logp_BT))
    w_BT = jax.lax.stop_gradient(jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high))
    return Surrogate(
        -adv_BT * w_BT * logp_BT, ratio_BT < 1.0 - clip_low, ratio_BT > 1.0 + clip_high
    )


def _token_cov(logp_BT, adv_BT, mask_BT):
    """Cov(y_i) = (A_i - mean A) (log pi_i - mean log pi) over the valid tokens (stop-gradient)."""
    logp_BT = jax.lax.stop_gradient(logp_BT)
    n = jnp.maximum(mask_BT.sum(), 1)
    mean = lambda x_BT: jnp.where(mask_BT, x_BT, 0.0).sum() / n
    return (adv_BT - mean(adv_BT)) * (logp_BT - mean(logp_BT))


def _count(share: float, mask_BT) -> jax.Array:
    """max(floor(share * valid tokens), 1), as verl sizes the Clip-/KL-Cov token sets."""
    return jnp.maximum(jnp.floor(share * mask_BT.sum().astype(jnp.float32)), 1.0)


def _first(k, score_BT, eligible_BT):
    """bool [B, T]: the k eligible tokens with the smallest scores (ties: the earlier token)."""
    flat = jnp.where(eligible_BT, score_BT, jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return eligible_BT & (rank.reshape(score_BT.shape) < k)


@register("clip_cov", draws=True)
def clip_cov(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    clip_low: float, clip_high: float, dual_clip: float | None = None,
    cov: CovOptions,
    noise_BT: jax.Array | None,
) -> Surrogate:
    """Clip-Cov (Cui et al. 2025, verl's `clip_cov`): PPO's clipped term, with the gradient of
    max(1, floor(clip_ratio * n)) tokens dropped, drawn uniformly (by `noise_BT`) among the
    tokens PPO did not clip whose Cov lies in (clip_lb, clip_ub).

    Cov and n are over this call's valid tokens (verl: per micro-batch). verl's version has no
    dual clip: leave it off to match.
    """
    if noise_BT is None:
        raise ValueError(
            "loss clip_cov draws tokens at random: pass TokenTerms.noise_BT (uniform [0, 1))"
        )
    ratio_BT = jnp.exp(_token_log_ratio(logp_BT, old_logp_BT))
    clipped_BT = (-adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)) > (
        -adv_BT * ratio_BT
    )
    cov_BT = _token_cov(logp_BT, adv_BT, mask_BT)
    eligible_BT = mask_BT & ~clipped_BT & (cov_BT > cov.clip_lb) & (cov_BT < cov.clip_ub)
    drop_BT = _first(_count(cov.clip_ratio, mask_BT), noise_BT, eligible_BT)
    pg_BT = jnp.where(drop_BT, 0.0, _clipped_pg(ratio_BT, adv_BT, clip_low, clip_high, dual_clip))
    return Surrogate(pg_BT, *_ppo_clip_flags(ratio_BT, adv_BT, clip_low, clip_high), drop_BT)


@register("kl_cov")
def kl_cov(
    logp_BT: jax.Array, old_logp_BT: jax.Array, adv_BT: jax.Array, mask_BT: jax.Array,
    *,
    cov: CovOptions,
) -> Surrogate:
    """KL-Cov (Cui et al. 2025, verl's `kl_cov`): the unclipped term -A * ratio, plus
    kl_coef * |log pi - log pi_old| on the max(1, floor(kl_ratio * n)) valid tokens of
    largest Cov.

    No ratio clip (the penalty replaces it), so `clip_low`, `clip_high` and `dual_clip` are
    unused and the clip fractions are 0.
    """
    log_ratio_BT = _token_log_ratio(logp_BT, old_logp_BT)
    cov_BT = _token_cov(logp_BT, adv_BT, mask_BT)
    pick_BT = _first(_count(cov.kl_ratio, mask_BT), -cov_BT, mask_BT)
    pg_BT = -adv_BT * jnp.exp(log_ratio_BT) + jnp.where(
        pick_BT, cov.kl_coef * jnp.abs(log_ratio_BT), 0.0
    )
    never_BT = jnp.zeros(logp_BT.shape, bool)
    return Surrogate(pg_BT, never_BT, never_BT, pick_BT)


class TokenTerms(NamedTuple):
    """The per-token arrays of a policy loss ([B, T]; `adv_B` one per sequence or [B, T])."""

    logp_BT: jax.Array  # log-probs under the policy being trained
    old_logp_BT: jax.Array  # log-probs under the policy that sampled
    adv_B: jax.Array
    mask_BT: jax.Array  # bool: tokens in the loss
    ref_logp_BT: jax.Array | None = None  # the KL reference's (None: no KL term)
    entropy_BT: jax.Array | None = None  # None: no entropy term or metric
    is_weights_BT: jax.Array | None = None  # importance weights (stop-gradient), or None
    noise_BT: jax.Array | None = None  # uniform [0, 1) draws, for a surrogate that samples


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The knobs of `policy_loss`, named as the config's `loss.*` fields."""

    name: str = _config("name")  # a registered surrogate
    clip_low: float = _config("clip_low")
    clip_high: float = _config("clip_high")
    dual_clip: float = _config("dual_clip")  # > 1 bounds a negative-advantage token's loss
    agg: str = _config("agg")  # one of AGG_MODES
    kl_coef: float = _config("kl_coef")
    kl_estimator: str = _config("kl_estimator")
    entropy_coef: float = _config("entropy_coef")
    cov: CovOptions = CovOptions()  # clip_cov / kl_cov only

    def __post_init__(self):
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0: off), got {self.dual_clip}")

    @classmethod
    def from_config(cls, loss: schema.Loss) -> "LossOptions":
        """The options the config's `loss` section gives; its other fields (`UNCARRIED`) are
        the update's, not the loss function's."""
        own = {f.name: getattr(loss, f.name) for f in dataclasses.fields(cls) if f.name != "cov"}
        cov = CovOptions(**{f: getattr(loss, name) for f, name in _COV_SETTINGS.items()})
        return cls(**own, cov=cov)


# `loss.*` fields `policy_loss` does not read: the update's batching, packing, old log-probs
# and importance weights (trainer/update.py, ebpo_jax.importance).
UNCARRIED = (
    "ppo_epochs",
    "num_minibatches",
    "num_microbatches",
    "logits_chunk",
    "recompute_old_logprobs",
    "is_correction",
    "is_level",
    "is_cap",
    "is_low",
    "is_high",
    "tokens_per_microbatch",
    "pack_row_len",
)


DEFAULT_OPTIONS = LossOptions()


def policy_loss(
    terms: TokenTerms,
    opts: LossOptions = DEFAULT_OPTIONS,
    *,
    denominator: ArrayLike | None = None,
    max_tokens: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The surrogate registered as `opts.name`, plus KL and entropy terms.

    `terms.is_weights_BT` (stop-gradient) multiplies each token's policy-gradient term, as
    verl applies `rollout_is_weights` (see `ebpo_jax.importance`). `denominator` and
    `max_tokens` go to `aggregate`. Returns `(loss, metrics)`; metric names match the
    trainer's fixed metric names.
    """
    logp_BT, mask_BT, adv_B = terms.logp_BT, terms.mask_BT, terms.adv_B
    surrogate = get(opts.name)
    adv_BT = adv_B[:, None] if adv_B.ndim == 1 else adv_B
    adv_BT = jnp.broadcast_to(adv_BT, logp_BT.shape).astype(jnp.float32)
    reduce = lambda x_BT: aggregate(
        x_BT, mask_BT, opts.agg, max_tokens=max_tokens, denominator=denominator
    )
    token_mean = lambda x_BT: aggregate(x_BT.astype(jnp.float32), mask_BT, "token-mean")

    options = {
        "clip_low": opts.clip_low,
        "clip_high": opts.clip_high,
        "dual_clip": opts.dual_clip if opts.dual_clip else None,
        "cov": opts.cov,
        "noise_BT": terms.noise_BT,
    }
    out = _call(surrogate, (logp_BT, terms.old_logp_BT, adv_BT, mask_BT), options)
    pg_BT = out.pg_BT
    if terms.is_weights_BT is not None:
        pg_BT = pg_BT * jax.lax.stop_gradient(terms.is_weights_BT)
    pg_loss = reduce(pg_BT)
    metrics = {
        "actor/pg_loss": pg_loss,
        "actor/clip_frac_low": token_mean(out.clipped_low_BT),
        "actor/clip_frac_high": token_mean(out.clipped_high_BT),
    }
    if out.selected_BT is not None:
        metrics["actor/cov_frac"] = token_mean(out.selected_BT)
    loss = pg_loss
    if terms.ref_logp_BT is not None:
        kl = reduce(kl_penalty(logp_BT, terms.ref_logp_BT, opts.kl_estimator))
        loss = loss + opts.kl_coef * kl
        metrics["actor/kl"] = kl
    if terms.entropy_BT is not None:
        entropy = reduce(terms.entropy_BT)
        loss = loss - opts.entropy_coef * entropy
        metrics["actor/entropy"] = entropy
    return loss, metrics
