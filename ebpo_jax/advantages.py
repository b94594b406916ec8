"""Group-relative advantage estimators: EBPO and its baselines, behind one registry.

Every estimator takes rewards `[P, G]` (P prompts, G samples each) and an optional
mask `[P, G]` (True = valid sample). Masked entries get advantage 0 and never touch
any statistic. All functions are pure, jit- and vmap-able, with no Python control
flow on array values.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ebpo_jax.runtime.registry import Registry


class Welford(NamedTuple):
    """Per-cluster running (count, mean, M2) accumulators, each `[K]`."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array


class EBState(NamedTuple):
    """EBPO's carried state: Welford stats of individual rewards and of group means."""

    reward: Welford
    group: Welford


def _zeros_welford(num_clusters: int) -> Welford:
    # Three distinct buffers, so a trainer can donate the state.
    return Welford(*(jnp.zeros((num_clusters,), jnp.float32) for _ in range(3)))


def init_eb_state(num_clusters: int = 1) -> EBState:
    """Empty accumulators for `num_clusters` priors (1 = one global prior)."""
    if num_clusters < 1:
        raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
    return EBState(_zeros_welford(num_clusters), _zeros_welford(num_clusters))


# ---------------------------------------------------------------------------
# Input checks (trace time: shapes are static, so these run before compiling).


def _check_state(state) -> int:
    """The EBState's number of clusters K; one line naming the fault otherwise."""
    leaves = jax.tree.leaves(state)
    if not isinstance(state, EBState) or len(leaves) != 6:
        raise TypeError(f"state must be an EBState (init_eb_state), got {type(state).__name__}")
    shapes = {jnp.shape(x) for x in leaves}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"state's accumulators must all be [K], got shapes {sorted(shapes)}")
    if not all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
        dtypes = sorted({str(jnp.result_type(x)) for x in leaves})
        raise TypeError(f"state's accumulators must be floating point, got dtypes {dtypes}")
    return next(iter(shapes))[0]


def _check_inputs(rewards, mask, cluster_ids=None, num_clusters=None):
    """Validate ranks/shapes; returns (rewards f32 [P,G], mask bool [P,G])."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    if not jnp.issubdtype(rewards.dtype, jnp.number) and rewards.dtype != jnp.bool_:
        raise TypeError(f"rewards must be numeric, got dtype {rewards.dtype}")
    if mask is None:
        mask = jnp.ones(rewards.shape, bool)
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.integer):
        raise TypeError(f"mask must be bool (True = valid sample), got dtype {mask.dtype}")
    if mask.shape != rewards.shape:
        raise ValueError(f"mask shape {mask.shape} does not match rewards shape {rewards.shape}")
    if cluster_ids is not None:
        cluster_ids = jnp.asarray(cluster_ids)
        if cluster_ids.shape != rewards.shape[:1]:
            raise ValueError(
                f"cluster_ids must be [P]={rewards.shape[:1]}, got shape {cluster_ids.shape}"
            )
        if not jnp.issubdtype(cluster_ids.dtype, jnp.integer):
            raise TypeError(f"cluster_ids must be integers, got dtype {cluster_ids.dtype}")
        if not isinstance(cluster_ids, jax.core.Tracer):  # range is checkable eagerly only
            ids = np.asarray(cluster_ids)
            if ids.size and (ids.min() < 0 or ids.max() >= num_clusters):
                raise ValueError(
                    f"cluster_ids must lie in [0, {num_clusters}) (the EBState has "
                    f"{num_clusters} clusters), got range [{ids.min()}, {ids.max()}]"
                )
    return rewards.astype(jnp.float32), mask.astype(bool)


# ---------------------------------------------------------------------------
# Welford accumulators.


def _merge(a: Welford, b: Welford) -> Welford:
    """Chan et al.'s parallel merge; stable when a.count >> b.count."""
    n_K = a.count + b.count
    safe_n_K = jnp.where(n_K > 0, n_K, 1.0)
    delta_K = b.mean - a.mean
    mean_K = a.mean + delta_K * (b.count / safe_n_K)
    m2_K = a.m2 + b.m2 + delta_K**2 * (a.count * (b.count / safe_n_K))
    return Welford(n_K, mean_K, m2_K)


def _dot(a, b):
    """An exact one-hot gather / per-cluster sum: TPUs run DEFAULT float32 matmuls as one
    bfloat16 pass (GPUs may use TF32), which would round mu_glob to ~3 significant digits."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _cluster_welford(n_P, mean_P, m2_P, onehot_PK) -> Welford:
    """Per-cluster (count, mean, M2) from per-row ones (the exact two-level decomposition)."""
    count_K = _dot(n_P, onehot_PK)
    # Shifted by one member's mean per cluster, so equal means average to exactly that value.
    member_PK = onehot_PK * (n_P > 0)[:, None]
    ref_K = jnp.where(count_K > 0, mean_P[jnp.argmax(member_PK, axis=0)], 0.0)
    dev_P = mean_P - _dot(onehot_PK, ref_K)
    mean_K = ref_K + _dot(n_P * dev_P, onehot_PK) / jnp.where(count_K > 0, count_K, 1.0)
    between_P = n_P * (mean_P - _dot(onehot_PK, mean_K)) ** 2
    return Welford(count_K, mean_K, _dot(m2_P + between_P, onehot_PK))


def _population_var(w: Welford) -> jax.Array:
    """M2 / count, defined as 0 below two observations."""
    return jnp.where(w.count >= 2, w.m2 / jnp.where(w.count > 0, w.count, 1.0), 0.0)


def _first_valid(x, mask, axis):
    """The first valid entry along `axis` (None = all), keeping dims; 0 where none is valid."""
    if axis is None:
        x0 = x.reshape(-1)[jnp.argmax(mask.reshape(-1))].reshape((1,) * x.ndim)
        return jnp.where(mask.any(), x0, 0.0)
    idx = jnp.expand_dims(jnp.argmax(mask, axis=axis), axis)
    return jnp.where(mask.any(axis, keepdims=True), jnp.take_along_axis(x, idx, axis), 0.0)


def _shifted_moments(x, mask, axis):
    """Masked (count, mean, M2) about the first valid entry (keepdims).

    The shift makes equal values give a mean equal to that value and an M2 of exactly 0;
    unshifted float32 sums of 8 equal values leave an M2 around 1e-15, whose square root
    then divides advantages into the 1e5 range.
    """
    x0 = _first_valid(x, mask, axis)
    d = jnp.where(mask, x - x0, 0.0)
    n = mask.astype(jnp.float32).sum(axis=axis, keepdims=True)
    mean_d = d.sum(axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
    m2 = jnp.where(mask, (d - mean_d) ** 2, 0.0).sum(axis=axis, keepdims=True)
    return n, x0 + mean_d, m2


def _row_stats(rewards_PG, mask_PG):
    """Valid count, mean and M2 of each row (0 for empty rows)."""
    n_P1, mean_P1, m2_P1 = _shifted_moments(rewards_PG, mask_PG, -1)
    return n_P1[:, 0], mean_P1[:, 0], m2_P1[:, 0]


def _onehot(cluster_ids, num_prompts, num_clusters):
    if cluster_ids is None:
        cluster_ids = jnp.zeros((num_prompts,), jnp.int32)
    return jax.nn.one_hot(cluster_ids, num_clusters, dtype=jnp.float32)


class _Batch(NamedTuple):
    rewards_PG: jax.Array
    mask_PG: jax.Array
    onehot_PK: jax.Array
    n_P: jax.Array
    mean_P: jax.Array
    m2_P: jax.Array


def _prepare(state: EBState, rewards, mask, cluster_ids) -> _Batch:
    num_clusters = _check_state(state)
    rewards_PG, mask_PG = _check_inputs(rewards, mask, cluster_ids, num_clusters)
    onehot_PK = _onehot(cluster_ids, rewards_PG.shape[0], num_clusters)
    return _Batch(rewards_PG, mask_PG, onehot_PK, *_row_stats(rewards_PG, mask_PG))


def _merge_prepared(state: EBState, b: _Batch, forgetting) -> EBState:
    batch_reward = _cluster_welford(b.n_P, b.mean_P, b.m2_P, b.onehot_PK)
    valid_P = (b.n_P > 0).astype(jnp.float32)
    batch_group = _cluster_welford(valid_P, b.mean_P, jnp.zeros_like(b.m2_P), b.onehot_PK)
    decay = lambda w: Welford(w.count * forgetting, w.mean, w.m2 * forgetting)
    return EBState(
        _merge(decay(state.reward), batch_reward), _merge(decay(state.group), batch_group)
    )


def merge_batch(
    state: EBState,
    rewards: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    cluster_ids: ArrayLike | None = None,
    forgetting: float = 1.0,
) -> EBState:
    """Merges one batch of rewards into the accumulators; returns the new EBState.

    `forgetting` < 1 down-weights the history before the merge (an exponentially
    weighted Welford), for a non-stationary policy.
    """
    return _merge_prepared(state, _prepare(state, rewards, mask, cluster_ids), forgetting)


# ---------------------------------------------------------------------------
# EBPO.


MU_GLOB = ("all_rewards", "group_means")


def _posterior(state: EBState, b: _Batch, eps, mu_glob="all_rewards") -> dict:
    if mu_glob not in MU_GLOB:
        raise ValueError(f"mu_glob must be one of {MU_GLOB}, got {mu_glob!r}")
    # The paper's mu_glob is the mean of every reward; the authors' released code takes the
    # mean of the group means (they differ when masks leave groups of different sizes).
    mu_K = state.reward.mean if mu_glob == "all_rewards" else state.group.mean
    sigma2_K = _population_var(state.reward)
    tau2_K = _population_var(state.group)
    mu_P, sigma2_P, tau2_P = (_dot(b.onehot_PK, x_K) for x_K in (mu_K, sigma2_K, tau2_K))
    noise_P = sigma2_P / jnp.where(b.n_P > 0, b.n_P, 1.0)
    denom_P = noise_P + tau2_P
    # A (numerically) zero denominator means no evidence of spread at all: trust the prior.
    shrink_P = jnp.where(denom_P > eps, noise_P / jnp.where(denom_P > eps, denom_P, 1.0), 1.0)
    return {
        "shrinkage": shrink_P,
        "baseline": (1.0 - shrink_P) * b.mean_P + shrink_P * mu_P,
        "group_mean": b.mean_P,
        "group_size": b.n_P,
        "mu_glob": mu_K,
        "sigma2": sigma2_K,
        "tau2": tau2_K,
    }


def eb_diagnostics(
    rewards: ArrayLike,
    state: EBState,
    *,
    mask: ArrayLike | None = None,
    cluster_ids: ArrayLike | None = None,
    eps: float = 1e-6,
    mu_glob: str = "all_rewards",
) -> dict[str, jax.Array]:
    """Posterior quantities from an (already merged) state, for logging.

    Returns a dict: `shrinkage` [P], `baseline` [P], `group_mean` [P], `group_size` [P],
    and the per-cluster `mu_glob`, `sigma2`, `tau2` [K].
    """
    return _posterior(state, _prepare(state, rewards, mask, cluster_ids), eps, mu_glob)


def _masked_mean_std(x_PG, mask_PG, axis=None):
    """Masked mean and unbiased (ddof=1) std; std is 0 with fewer than two entries.

    Equal values give a std of exactly 0 (see `_shifted_moments`).
    """
    n, mean, m2 = _shifted_moments(x_PG, mask_PG, axis)
    return mean, jnp.sqrt(m2 / jnp.maximum(n - 1.0, 1.0)), n


def _normalize(adv_PG, mask_PG, how: str, eps: float, fallback_std_P=None):
    if how == "none":
        return adv_PG
    if how == "batch":
        mean, std, _ = _masked_mean_std(adv_PG, mask_PG)
        return (adv_PG - mean) / (std + eps)
    if how == "group":
        # Scale by the group's own std but keep the shrunk baseline (subtracting the
        # group mean would turn EBPO back into GRPO). A constant group has std 0: it
        # falls back to the prior's within-prompt std instead of dividing by eps.
        _, std_P1, _ = _masked_mean_std(adv_PG, mask_PG, axis=-1)
        std_P1 = jnp.where(std_P1 > 0, std_P1, fallback_std_P[:, None])
        return adv_PG / (std_P1 + eps)
    raise ValueError(f"normalize must be 'batch', 'group' or 'none', got {how!r}")


class EBOptions(NamedTuple):
    """EBPO's options and their defaults (`eb_advantage` documents them)."""

    eps: float = 1e-6
    per_batch: bool = False
    forgetting: float = 1.0
    normalize: str = "batch"
    mu_glob: str = "all_rewards"


_EB = EBOptions()


def _eb(rewards, state, mask, cluster_ids, opts: EBOptions):
    """EBPO core: (advantages, merged state, posterior diagnostics, prepared batch)."""
    if not 0.0 < opts.forgetting <= 1.0:
        raise ValueError(f"forgetting must be in (0, 1], got {opts.forgetting}")
    if opts.per_batch:
        state = jax.tree.map(jnp.zeros_like, state)
    b = _prepare(state, rewards, mask, cluster_ids)
    new_state = _merge_prepared(state, b, opts.forgetting)
    diag = _posterior(new_state, b, opts.eps, opts.mu_glob)
    adv_PG = jnp.where(b.mask_PG, b.rewards_PG - diag["baseline"][:, None], 0.0)
    prior_std_P = _dot(b.onehot_PK, jnp.sqrt(diag["sigma2"]))
    adv_PG = _normalize(adv_PG, b.mask_PG, opts.normalize, opts.eps, prior_std_P)
    return jnp.where(b.mask_PG, adv_PG, 0.0), new_state, diag, b


def eb_advantage(
    rewards: ArrayLike,
    state: EBState,
    *,
    mask: ArrayLike | None = None,
    cluster_ids: ArrayLike | None = None,
    eps: float = _EB.eps,
    per_batch: bool = _EB.per_batch,
    forgetting: float = _EB.forgetting,
    normalize: str = _EB.normalize,
    mu_glob: str = _EB.mu_glob,
) -> tuple[jax.Array, EBState]:
    """EBPO advantages `[P, G]` and the updated EBState (see PAPER.md).

    The batch is merged into the accumulators first, then each prompt's baseline is
    shrunk toward its cluster's running mean. `per_batch=True` resets the statistics
    every call and `mu_glob="group_means"` shrinks toward the mean of the group means:
    both together are the authors' released code; `forgetting` < 1 decays the history.
    """
    opts = EBOptions(eps, per_batch, forgetting, normalize, mu_glob)
    adv_PG, new_state, _, _ = _eb(rewards, state, mask, cluster_ids, opts)
    return adv_PG, new_state


# ---------------------------------------------------------------------------
# Baselines. Singleton groups follow verl: group mean 0 and std 1, so A = r.


def _group_baseline(rewards, mask):
    rewards_PG, mask_PG = _check_inputs(rewards, mask)
    mean_P1, std_P1, n_P1 = _masked_mean_std(rewards_PG, mask_PG, axis=-1)
    single_P1 = n_P1 <= 1
    mean_P1 = jnp.where(single_P1, 0.0, mean_P1)
    std_P1 = jnp.where(single_P1, 1.0, std_P1)
    return rewards_PG, mask_PG, mean_P1, std_P1, n_P1


def grpo_advantage(
    rewards: ArrayLike, *, mask: ArrayLike | None = None, eps: float = 1e-6
) -> jax.Array:
    """GRPO: (r - group mean) / (group unbiased std + eps).

    The numerics are verl's (eps 1e-6; a singleton group has mean 0 and std 1, so A = r);
    TRL adds eps 1e-4 and gives singleton groups A = 0.
    """
    r_PG, m_PG, mean_P1, std_P1, _ = _group_baseline(rewards, mask)
    return jnp.where(m_PG, (r_PG - mean_P1) / (std_P1 + eps), 0.0)


def dr_grpo_advantage(rewards: ArrayLike, *, mask: ArrayLike | None = None) -> jax.Array:
    """Dr. GRPO: r - group mean, no std division."""
    r_PG, m_PG, mean_P1, _, _ = _group_baseline(rewards, mask)
    return jnp.where(m_PG, r_PG - mean_P1, 0.0)


def rloo_advantage(rewards: ArrayLike, *, mask: ArrayLike | None = None) -> jax.Array:
    """RLOO: r minus the mean of the other valid samples of its group."""
    r_PG, m_PG, mean_P1, _, n_P1 = _group_baseline(rewards, mask)
    # r - (sum - r)/(n - 1) == n/(n - 1) * (r - mean); singletons keep A = r.
    scale_P1 = jnp.where(n_P1 > 1, n_P1 / jnp.maximum(n_P1 - 1.0, 1.0), 1.0)
    return jnp.where(m_PG, scale_P1 * (r_PG - mean_P1), 0.0)


def reinforce_pp_baseline_advantage(
    rewards: ArrayLike, *, mask: ArrayLike | None = None, eps: float = 1e-6
) -> jax.Array:
    """REINFORCE++ with baseline: r - group mean, then standardised over the batch.

    One value per sequence is standardised (every valid sample counts once); verl whitens
    the token-level advantages over the response mask, so long responses weigh more there.
    """
    adv_PG = dr_grpo_advantage(rewards, mask=mask)
    _, m_PG = _check_inputs(rewards, mask)
    return jnp.where(m_PG, _normalize(adv_PG, m_PG, "batch", eps), 0.0)


# ---------------------------------------------------------------------------
# Registry.

_REGISTRY = Registry(
    lambda name, known: KeyError(f"unknown advantage estimator {name!r}; known: {', '.join(known)}")
)
_REGISTRY.add("ebpo", eb_advantage, "stateful")
_REGISTRY.add("grpo", grpo_advantage)
_REGISTRY.add("dr_grpo", dr_grpo_advantage)
_REGISTRY.add("rloo", rloo_advantage)
_REGISTRY.add("reinforce_pp_baseline", reinforce_pp_baseline_advantage)


def register(name: str, *, stateful: bool = False) -> Callable[[Callable], Callable]:
    """Decorator adding an estimator to the registry under `name`."""
    return _REGISTRY.register(name, *(("stateful",) if stateful else ()))


def names() -> tuple[str, ...]:
    """All registered estimator names."""
    return _REGISTRY.names()


def get(name: str) -> Callable:
    """The estimator registered as `name`."""
    return _REGISTRY.get(name)


def estimate(
    name: str,
    rewards: ArrayLike,
    state: EBState,
    *,
    mask: ArrayLike | None = None,
    cluster_ids: ArrayLike | None = None,
    **options: float | str | bool | None,
) -> tuple[jax.Array, EBState, dict[str, jax.Array]]:
    """Uniform trainer entry: (advantages [P,G], new_state, metrics dict of scalars).

    Stateless estimators return `state` unchanged; EBPO's metrics are averaged over the
    batch's non-empty prompts.
    """
    fn = get(name)
    # None = the estimator's default (config.estimator_options declares every option as None).
    options = {k: v for k, v in options.items() if v is not None}
    if not _REGISTRY.marked(name, "stateful"):
        return fn(rewards, mask=mask, **options), state, {}
    if fn is not eb_advantage:
        adv_PG, new_state = fn(rewards, state, mask=mask, cluster_ids=cluster_ids, **options)
        return adv_PG, new_state, {}
    adv_PG, new_state, diag, b = _eb(rewards, state, mask, cluster_ids, EBOptions(**options))
    valid_P = (b.n_P > 0).astype(jnp.float32)
    row_mean = lambda x_P: (valid_P * x_P).sum() / jnp.maximum(valid_P.sum(), 1.0)
    metrics = {
        "eb/shrinkage_mean": row_mean(diag["shrinkage"]),
        "eb/mu_glob": row_mean(_dot(b.onehot_PK, diag["mu_glob"])),
        "eb/sigma2": row_mean(_dot(b.onehot_PK, diag["sigma2"])),
        "eb/tau2": row_mean(_dot(b.onehot_PK, diag["tau2"])),
    }
    return adv_PG, new_state, metrics
