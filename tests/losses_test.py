"""Policy losses against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses

_TERMS = set(losses.TokenTerms._fields)


def _policy_loss(logp, old, adv, mask, *, denominator=None, max_tokens=None, **kw):
    """policy_loss from flat keywords: arrays into TokenTerms, knobs into LossOptions."""
    terms = losses.TokenTerms(logp, old, adv, mask, **{k: v for k, v in kw.items() if k in _TERMS})
    opts = {k: v for k, v in kw.items() if k not in _TERMS and v is not None}
    return losses.policy_loss(
        terms, losses.LossOptions(**opts), denominator=denominator, max_tokens=max_tokens
    )


def _np_logsoftmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    B, T, V = 3, 5, 11
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, (B, T))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
    old = _np_logsoftmax(logits)[np.arange(B)[:, None], np.arange(T), targets] + rng.normal(
        0, 0.3, (B, T)
    )
    return logits, targets, mask, old.astype(np.float32), np.array([1.5, -0.7, 2.0], np.float32)


def test_logprobs_and_entropy_match_float64(batch):
    logits, targets, *_ = batch
    lsm = _np_logsoftmax(logits)
    want = np.take_along_axis(lsm, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses.token_logprobs(jnp.asarray(logits), targets), want, atol=1e-5)
    ent = -(np.exp(lsm) * lsm).sum(-1)
    np.testing.assert_allclose(losses.token_entropy(jnp.asarray(logits)), ent, atol=1e-5)
    bf16 = losses.token_logprobs(jnp.asarray(logits, jnp.bfloat16), targets)
    assert bf16.dtype == jnp.float32


def test_chunked_logprobs_equal_full_including_gradient():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 8, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 13)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 13, (2, 8)))
    full = lambda h, w: losses.token_logprobs(h @ w, t)
    chunked = lambda h, w: losses.logprobs_from_hidden(h, w, t, chunk_size=2)
    np.testing.assert_allclose(chunked(h, w), full(h, w), atol=1e-5)
    g_full = jax.grad(lambda h, w: full(h, w).sum(), (0, 1))(h, w)
    g_chunk = jax.grad(lambda h, w: chunked(h, w).sum(), (0, 1))(h, w)
    for a, b in zip(g_full, g_chunk):
        np.testing.assert_allclose(a, b, atol=1e-4)
    _, ent = losses.logprobs_from_hidden(h, w, t, chunk_size=4, with_entropy=True)
    np.testing.assert_allclose(ent, losses.token_entropy(h @ w), atol=1e-5)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        losses.logprobs_from_hidden(h, w, t, chunk_size=3)


def _np_ppo(logp, old, adv, mask, cl, ch, dual=None):
    ratio = np.exp(np.float64(logp) - old)
    a = np.broadcast_to(adv[:, None], logp.shape)
    pg = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - cl, 1 + ch))
    if dual is not None:
        pg = np.where(a < 0, np.minimum(pg, -a * dual), pg)
    return pg, ratio, a


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_policy_loss_aggregations_match_numpy(batch, agg):
    logits, targets, mask, old, adv = batch
    logp = np.asarray(losses.token_logprobs(jnp.asarray(logits), targets))
    pg, ratio, a = _np_ppo(logp, old, adv, mask, 0.2, 0.28)
    x = np.where(mask, pg, 0.0)
    n = mask.sum(-1)
    want = {
        "token-mean": x.sum() / mask.sum(),
        "seq-mean-token-mean": (x.sum(-1)[n > 0] / n[n > 0]).sum() / (n > 0).sum(),
        "seq-mean-token-sum": x.sum() / (n > 0).sum(),
        "seq-mean-token-sum-norm": x.sum() / ((n > 0).sum() * 5),
    }[agg]
    loss, metrics = _policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    low = ((a < 0) & (ratio < 0.8))[mask].mean()
    high = ((a > 0) & (ratio > 1.28))[mask].mean()
    np.testing.assert_allclose(metrics["actor/clip_frac_low"], low, rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/clip_frac_high"], high, rtol=1e-6)


def test_dual_clip_and_gradient_at_ratio_one():
    logp = jnp.array([[3.0, 0.0]])  # ratio e^3 on the first token
    old = jnp.zeros((1, 2))
    adv = jnp.array([-1.0])
    mask = jnp.ones((1, 2), bool)
    plain, _ = _policy_loss(logp, old, adv, mask)
    dual, _ = _policy_loss(logp, old, adv, mask, dual_clip=3.0)
    np.testing.assert_allclose(plain, (np.exp(3.0) + 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(dual, (3.0 + 1.0) / 2, rtol=1e-6)
    # At ratio 1 the gradient of the token-mean loss w.r.t. logp is -A / n_tokens.
    g = jax.grad(lambda lp: _policy_loss(lp, old, jnp.array([2.0]), mask)[0])(old)
    np.testing.assert_allclose(g, [[-1.0, -1.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        _policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_kl_estimators_and_entropy_bonus(batch):
    logits, targets, mask, old, adv = batch
    logp = np.asarray(losses.token_logprobs(jnp.asarray(logits), targets), np.float64)
    ref = np.float64(old)
    lr = logp - ref
    want = {"k1": lr, "k2": 0.5 * lr**2, "k3": np.exp(-lr) + lr - 1}
    for est, w in want.items():
        np.testing.assert_allclose(losses.kl_penalty(logp, ref, est), w, rtol=1e-5, atol=1e-6)
        base, _ = _policy_loss(logp, old, adv, mask)
        loss, m = _policy_loss(logp, old, adv, mask, ref_logp_BT=ref, kl_coef=0.1, kl_estimator=est)
        kl = w[mask].mean()
        np.testing.assert_allclose(m["actor/kl"], kl, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, base + 0.1 * kl, rtol=1e-5)
    ent = losses.token_entropy(jnp.asarray(logits))
    loss, m = _policy_loss(logp, old, adv, mask, entropy_BT=ent, entropy_coef=0.01)
    np.testing.assert_allclose(m["actor/entropy"], np.asarray(ent)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(loss, base - 0.01 * m["actor/entropy"], rtol=1e-5)
    with pytest.raises(ValueError, match="kl_estimator"):
        losses.kl_penalty(logp, ref, "k4")


def test_denominator_makes_microbatches_sum_to_full_batch(batch):
    logits, targets, mask, old, adv = batch
    logp = losses.token_logprobs(jnp.asarray(logits), targets)
    full, _ = _policy_loss(logp, old, adv, mask)
    total = mask.sum()
    parts = [
        _policy_loss(
            logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], denominator=total
        )[0]
        for i in range(3)
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)
    with pytest.raises(ValueError, match="agg must be one of"):
        _policy_loss(logp, old, adv, mask, agg="mean")


# ---------------------------------------------------------------------------
# The surrogate registry against float64 references (values and gradients w.r.t. logp).

BUILTIN = ("ppo", "gspo", "gspo_token", "cispo")


def _np_agg_weights(mask, agg, denominator=None):
    """c[B, T] with loss = sum(c * pg): each aggregation mode as explicit token weights."""
    m = mask.astype(np.float64)
    n_b, T = m.sum(-1), mask.shape[1]
    if agg == "token-mean":
        return m / max(m.sum() if denominator is None else denominator, 1.0)
    n_seq = max((n_b > 0).sum() if denominator is None else denominator, 1.0)
    return {
        "seq-mean-token-mean": m / np.maximum(n_b, 1.0)[:, None] / n_seq,
        "seq-mean-token-sum": m / n_seq,
        "seq-mean-token-sum-norm": m / (n_seq * T),
    }[agg]


def _np_clipped(ratio, a, cl, ch, dual):
    """PPO's term, and where its derivative w.r.t. the ratio is -A (else 0)."""
    u, c = -a * ratio, -a * np.clip(ratio, 1 - cl, 1 + ch)
    pg, live = np.maximum(u, c), u >= c
    if dual is not None:
        capped = (a < 0) & (-a * dual < pg)
        pg, live = np.where(capped, -a * dual, pg), live & ~capped
    return pg, live


def _np_loss_and_grad(name, logp, old, adv, mask, agg, cl, ch, dual, is_w, denominator=None):
    """Float64 loss and d loss / d logp of every built-in surrogate."""
    logp, old = np.float64(logp), np.float64(old)
    a = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape).astype(np.float64)
    c = _np_agg_weights(mask, agg, denominator) * (1.0 if is_w is None else np.float64(is_w))
    if name in ("ppo", "cispo"):
        lr = logp - old
        ratio = np.exp(np.clip(lr, -20, 20))
        inside = np.abs(lr) < 20
        if name == "cispo":
            w = np.clip(ratio, 1 - cl, 1 + ch)
            return (c * -a * w * logp).sum(), c * -a * w
        pg, live = _np_clipped(ratio, a, cl, ch, dual)
        return (c * pg).sum(), c * -a * ratio * live * inside
    n = np.maximum(mask.sum(-1), 1)
    ls = np.clip(np.where(mask, logp - old, 0).sum(-1) / n, -20, 20)
    s = np.broadcast_to(np.exp(ls)[:, None], logp.shape)
    pg, live = _np_clipped(s, a, cl, ch, dual)
    if name == "gspo_token":
        return (c * pg).sum(), c * -a * s * live
    # gspo: every token moves log s_i by 1/n_i, and s_i moves every term of its sequence.
    dloss_ds = (c * -a * live).sum(-1) * np.exp(ls) * (np.abs(ls) < 20)
    return (c * pg).sum(), mask * (dloss_ds / n)[:, None]


@pytest.fixture
def surrogate_batch():
    rng = np.random.default_rng(7)
    B, T = 6, 7
    lengths = np.array([7, 3, 0, 5, 1, 6])
    mask = np.arange(T)[None] < lengths[:, None]
    logp = np.log(rng.uniform(0.05, 1.0, (B, T)))
    # Token noise plus a per-sequence shift, so token and sequence ratios leave the clip range
    # on both sides; row 3 has a ratio near e^1.3 (past dual clip 3) on some of its tokens.
    old = logp + rng.normal(0, 0.3, (B, T)) + rng.normal(0, 0.2, (B, 1))
    old[3] = logp[3] - 1.3 + rng.normal(0, 0.05, T)
    old[0, 2] = logp[0, 2] - 1.4
    adv = np.array([1.3, -0.8, 0.5, -1.1, 2.0, -0.4])
    is_w = rng.uniform(0.3, 2.0, (B, T))
    f32 = lambda x: np.asarray(x, np.float32)
    return f32(logp), f32(old), f32(adv), mask, f32(is_w)


def _loss_and_grad(name, logp, old, adv, mask, **kw):
    fn = lambda lp: _policy_loss(lp, old, adv, mask, name=name, **kw)[0]
    return jax.value_and_grad(fn)(jnp.asarray(logp))


@pytest.mark.parametrize("agg", losses.AGG_MODES)
@pytest.mark.parametrize("name", BUILTIN)
def test_surrogates_match_float64_values_and_gradients(surrogate_batch, name, agg):
    logp, old, adv, mask, is_w = surrogate_batch
    cases = [(None, None, None), (3.0, None, None), (None, is_w, None), (3.0, is_w, 9.0)]
    for dual, w, denom in cases:
        kw = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": dual, "agg": agg, "is_weights_BT": w}
        loss, grad = _loss_and_grad(name, logp, old, adv, mask, denominator=denom, **kw)
        want, want_grad = _np_loss_and_grad(
            name, logp, old, adv, mask, agg, 0.2, 0.28, dual, w, denom
        )
        np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7, err_msg=f"{dual} {denom}")
        np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7, err_msg=f"{dual}")
    # Per-token advantages take the same path.
    adv_BT = adv[:, None] * np.linspace(0.5, 1.5, logp.shape[1])[None].astype(np.float32)
    loss, grad = _loss_and_grad(name, logp, old, adv_BT, mask, agg=agg, clip_high=0.28)
    want, want_grad = _np_loss_and_grad(name, logp, old, adv_BT, mask, agg, 0.2, 0.28, None, None)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)


def test_reference_batch_exercises_every_branch(surrogate_batch):
    # Guards the test above: the inputs must reach both clips, the dual clip and zero grads.
    logp, old, adv, mask, _ = surrogate_batch
    a = np.broadcast_to(adv[:, None], logp.shape)
    ratio = np.exp(np.float64(logp) - old)
    assert ((ratio < 0.8) & (a < 0) & mask).any() and ((ratio > 1.28) & (a > 0) & mask).any()
    assert ((ratio > 3.0) & (a < 0) & mask).any()
    n = np.maximum(mask.sum(-1), 1)
    s = np.exp(np.where(mask, np.float64(logp) - old, 0).sum(-1) / n)
    assert ((s < 0.8) & (adv < 0)).any() and ((s > 1.28) & (adv > 0)).any()
    assert ((s > 3.0) & (adv < 0)).any()


@pytest.mark.parametrize("name", BUILTIN)
def test_microbatches_with_denominator_sum_to_the_full_batch(surrogate_batch, name):
    logp, old, adv, mask, is_w = surrogate_batch
    for agg in losses.AGG_MODES:
        kw = {"agg": agg, "dual_clip": 3.0, "clip_high": 0.28}
        full, g_full = _loss_and_grad(name, logp, old, adv, mask, is_weights_BT=is_w, **kw)
        denom = mask.sum() if agg == "token-mean" else mask.any(-1).sum()
        parts = [
            _loss_and_grad(
                name, logp[i:j], old[i:j], adv[i:j], mask[i:j],
                is_weights_BT=is_w[i:j], denominator=denom, **kw,
            )
            for i, j in ((0, 2), (2, 4), (4, 6))
        ]  # fmt: skip
        np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-5, err_msg=agg)
        g = np.concatenate([p[1] for p in parts])
        np.testing.assert_allclose(g, g_full, rtol=1e-5, atol=1e-8, err_msg=agg)


def test_gspo_token_equals_gspo_for_sequence_advantages(surrogate_batch):
    logp, old, adv, mask, _ = surrogate_batch
    for agg in losses.AGG_MODES:
        a = _loss_and_grad("gspo", logp, old, adv, mask, agg=agg, dual_clip=3.0)
        b = _loss_and_grad("gspo_token", logp, old, adv, mask, agg=agg, dual_clip=3.0)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", [*BUILTIN, "clip_cov", "kl_cov"])
def test_huge_log_ratios_give_finite_loss_and_gradients(name):
    # exp(100) overflows float32; unclamped, A = 0 gives 0 * inf = NaN.
    logp = jnp.array([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    old = logp - jnp.array([[100.0, 0.0, -100.0], [95.0, 90.0, 0.0]])
    mask = jnp.ones((2, 3), bool)
    for adv in (jnp.array([0.0, 0.0]), jnp.array([1.0, -1.0]), jnp.array([-1.0, 1.0])):
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp, a=adv: _policy_loss(lp, old, a, mask, name=name, noise_BT=0.5 * mask),
            has_aux=True,
        )(logp)
        assert np.isfinite(loss) and np.isfinite(grad).all(), (name, adv)
        assert all(np.isfinite(v) for v in metrics.values())


def test_any_estimator_with_any_loss_is_finite():
    from ebpo_jax import advantages

    rng = np.random.default_rng(3)
    P, G, T = 4, 4, 5
    rewards = (rng.random((P, G)) < 0.5).astype(np.float32)
    rewards[0] = 0.0  # an all-fail group
    logp = jnp.asarray(np.log(rng.uniform(0.1, 1.0, (P * G, T))), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.2, (P * G, T)), jnp.float32)
    mask = np.arange(T)[None] < rng.integers(1, T + 1, (P * G, 1))
    state = advantages.init_eb_state()
    adv = {  # jitted: eager dispatch of every estimator costs ~4x more here
        est: jax.jit(lambda r, e=est: advantages.estimate(e, r, state)[0])(rewards).reshape(-1)
        for est in advantages.names()
    }
    noise = jax.random.uniform(jax.random.key(0), logp.shape)
    for name in losses.names():
        fn = lambda lp, a, n=name: _policy_loss(lp, old, a, mask, name=n, noise_BT=noise)[0]
        value_and_grad = jax.jit(jax.value_and_grad(fn))
        for est, adv_B in adv.items():
            loss, grad = value_and_grad(logp, adv_B)
            assert np.isfinite(loss) and np.isfinite(grad).all(), (est, name)
            assert np.abs(grad).sum() > 0, (est, name)


def test_register_your_own_surrogate(surrogate_batch):
    logp, old, adv, mask, _ = surrogate_batch

    @losses.register("reinforce_test")
    def reinforce(logp_BT, old_logp_BT, adv_BT, mask_BT, **_):
        no_clip = jnp.zeros(logp_BT.shape, bool)
        return losses.Surrogate(-adv_BT * logp_BT, no_clip, no_clip)

    try:
        assert "reinforce_test" in losses.names()
        loss, grad = _loss_and_grad("reinforce_test", logp, old, adv, mask)
        c = _np_agg_weights(mask, "token-mean")
        a = np.broadcast_to(np.float64(adv)[:, None], logp.shape)
        np.testing.assert_allclose(loss, (c * -a * logp).sum(), rtol=1e-5)
        np.testing.assert_allclose(grad, c * -a, rtol=1e-5, atol=1e-8)
    finally:
        losses._REGISTRY.entries.pop("reinforce_test")
    with pytest.raises(KeyError, match="known: cispo, clip_cov, gspo, gspo_token, kl_cov, ppo"):
        _policy_loss(logp, old, adv, mask, name="grpo")


def test_a_surrogate_is_given_the_options_it_names(surrogate_batch):
    """The registered form: every option to a surrogate with **kwargs, else those it names."""
    logp, old, adv, mask, _ = surrogate_batch
    seen = {}

    @losses.register("named_test")
    def named(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_high, dual_clip=None):
        seen.update(clip_high=clip_high, dual_clip=dual_clip)
        no_clip = jnp.zeros(logp_BT.shape, bool)
        return losses.Surrogate(-adv_BT * logp_BT, no_clip, no_clip)

    try:
        _policy_loss(logp, old, adv, mask, name="named_test", clip_high=0.3, dual_clip=3.0)
        assert seen == {"clip_high": 0.3, "dual_clip": 3.0}
    finally:
        losses._REGISTRY.entries.pop("named_test")


def test_config_validates_loss_name_and_dual_clip():
    from ebpo_jax import config

    c = config.default_config()
    config.validate(c)
    c.loss.name = "gpso"
    with pytest.raises(config.ConfigError, match=r"loss.name='gpso' is not in the policy-loss"):
        config.validate(c)
    c.loss.name, c.loss.dual_clip = "cispo", 0.5
    with pytest.raises(config.ConfigError, match="loss.dual_clip=0.5"):
        config.validate(c)


# ---------------------------------------------------------------------------
# Clip-Cov and KL-Cov (Cui et al. 2025) against float64 references from the paper's definitions.


def _np_cov(logp, adv, mask):
    """Cov(y_i) = (log pi_i - mean log pi)(A_i - mean A), means over the valid tokens."""
    lp, a = np.float64(logp), np.float64(adv)
    return (lp - lp[mask].mean()) * (a - a[mask].mean())


def _np_clip_cov(logp, old, adv, mask, noise, cl, ch, ratio_share, lb, ub):
    """Float64 Clip-Cov loss (token-mean) and d/d logp; the dropped tokens.

    PPO's term on every valid token, except floor(r N) (at least 1) drawn without replacement
    among the tokens PPO left unclipped with lb < Cov < ub; the draw takes them in the order of
    `noise` (uniform), as a random permutation of the candidates would.
    """
    lp, a = np.float64(logp), np.float64(adv)
    ratio = np.exp(lp - old)
    pg, live = _np_clipped(ratio, a, cl, ch, None)
    clipped = -a * np.clip(ratio, 1 - cl, 1 + ch) > -a * ratio
    cov = _np_cov(logp, adv, mask)
    cand = [i for i in zip(*np.nonzero(mask & ~clipped & (cov > lb) & (cov < ub)))]
    k = max(int(ratio_share * mask.sum()), 1)
    drop = np.zeros(mask.shape, bool)
    for i in sorted(cand, key=lambda i: noise[i])[:k]:
        drop[i] = True
    c = mask / mask.sum()
    keep = ~drop
    return (c * pg * keep).sum(), c * -a * ratio * live * keep, drop


def _np_kl_cov(logp, old, adv, mask, ratio_share, coef):
    """Float64 KL-Cov loss (token-mean) and d/d logp: -A r on every token, plus
    coef |log pi - log pi_old| on the floor(k N) (at least 1) tokens of largest Cov."""
    lp, a = np.float64(logp), np.float64(adv)
    ratio, d = np.exp(lp - old), lp - old
    cov = np.where(mask, _np_cov(logp, adv, mask), -np.inf)
    k = max(int(ratio_share * mask.sum()), 1)
    pick = np.zeros(mask.shape, bool)
    pick.flat[np.argsort(-cov, axis=None, kind="stable")[:k]] = True
    c = mask / mask.sum()
    loss = (c * (-a * ratio + pick * coef * np.abs(d))).sum()
    return loss, c * (-a * ratio + pick * coef * np.sign(d)), pick


@pytest.fixture
def cov_batch():
    # Wide advantages and log-probs, so Cov spans (1, 5) for a good share of the tokens.
    rng = np.random.default_rng(13)
    B, T = 8, 9
    mask = np.arange(T)[None] < rng.integers(2, T + 1, (B, 1))
    logp = np.log(rng.uniform(0.01, 1.0, (B, T)))
    old = logp + rng.normal(0, 0.25, (B, T))
    adv = rng.normal(0, 2.0, (B, T))
    f32 = lambda x: np.asarray(x, np.float32)
    return f32(logp), f32(old), f32(adv), mask


def _cov_opts(**kw):
    return losses.CovOptions(**kw)


@pytest.mark.parametrize("share", [2e-4, 0.05, 0.2, 1.0])
def test_clip_cov_matches_float64_under_a_fixed_key(cov_batch, share):
    logp, old, adv, mask = cov_batch
    noise = np.asarray(jax.random.uniform(jax.random.key(5), logp.shape))
    cov = _cov_opts(clip_ratio=share)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _policy_loss(lp, old, adv, mask, name="clip_cov", noise_BT=noise, cov=cov),
        has_aux=True,
    )(jnp.asarray(logp))
    want, want_grad, drop = _np_clip_cov(logp, old, adv, mask, noise, 0.2, 0.2, share, 1.0, 5.0)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["actor/cov_frac"], drop.sum() / mask.sum(), rtol=1e-6)
    if share < 0.1:  # enough candidates: exactly max(floor(r N), 1) dropped
        assert drop.sum() == max(int(share * mask.sum()), 1)
    # Without the drop it is PPO.
    ppo = _policy_loss(logp, old, adv, mask, name="ppo")[0]
    assert drop.any() and not np.isclose(loss, ppo)


def test_clip_cov_batch_reaches_every_branch(cov_batch):
    # Guards the test above: PPO clips some tokens, and some unclipped ones lie outside (1, 5).
    logp, old, adv, mask = cov_batch
    ratio = np.exp(np.float64(logp) - old)
    clipped = -adv * np.clip(ratio, 0.8, 1.2) > -adv * ratio
    cov = _np_cov(logp, adv, mask)
    inside = mask & ~clipped & (cov > 1) & (cov < 5)
    assert (mask & clipped).any() and inside.sum() >= 5
    assert (mask & ~clipped & (cov > 5)).any() and (mask & ~clipped & (cov < 1)).any()
    assert (mask & clipped & (cov > 1) & (cov < 5)).any()  # excluded although in the band


def test_clip_cov_draws_uniformly_among_the_candidates(cov_batch):
    """Over many keys each candidate is dropped k / n_candidates of the time, no other ever."""
    logp, old, adv, mask = cov_batch
    cov = _cov_opts(clip_ratio=0.05)
    _, _, drop0 = _np_clip_cov(logp, old, adv, mask, np.zeros(logp.shape), 0.2, 0.2, 1.0, 1, 5)
    k, n = max(int(0.05 * mask.sum()), 1), drop0.sum()  # drop0: every candidate
    keys = jax.random.split(jax.random.key(0), 2000)

    @jax.jit
    @jax.vmap
    def dropped(key):
        noise = jax.random.uniform(key, logp.shape)
        fn = lambda lp: _policy_loss(lp, old, adv, mask, name="clip_cov", noise_BT=noise, cov=cov)
        return jax.grad(lambda lp: fn(lp)[0])(jnp.asarray(logp)) == 0

    freq = np.asarray(dropped(keys)).mean(0)
    ppo_grad = jax.grad(lambda lp: _policy_loss(lp, old, adv, mask, name="ppo")[0])(logp)
    live = mask & (np.asarray(ppo_grad) != 0)  # tokens whose zero gradient means "dropped"
    assert set(zip(*np.nonzero(live & (freq > 0)))) <= set(zip(*np.nonzero(drop0)))
    p = k / n
    np.testing.assert_allclose(freq[drop0], p, atol=4 * np.sqrt(p * (1 - p) / len(keys)))


@pytest.mark.parametrize("share,coef", [(2e-4, 0.1), (0.1, 1.0), (0.5, 0.3)])
def test_kl_cov_matches_float64(cov_batch, share, coef):
    logp, old, adv, mask = cov_batch
    cov = _cov_opts(kl_ratio=share, kl_coef=coef)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: _policy_loss(lp, old, adv, mask, name="kl_cov", cov=cov), has_aux=True
    )(jnp.asarray(logp))
    want, want_grad, pick = _np_kl_cov(logp, old, adv, mask, share, coef)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["actor/cov_frac"], pick.sum() / mask.sum(), rtol=1e-6)
    assert metrics["actor/clip_frac_low"] == 0 and metrics["actor/clip_frac_high"] == 0


def test_clip_cov_needs_noise_and_config_checks_its_knobs(cov_batch):
    from ebpo_jax import config

    logp, old, adv, mask = cov_batch
    with pytest.raises(ValueError, match="clip_cov draws tokens at random: pass TokenTerms"):
        _policy_loss(logp, old, adv, mask, name="clip_cov")
    assert losses.draws("clip_cov") and not losses.draws("kl_cov") and not losses.draws("ppo")
    c = config.default_config()
    c.loss.name, c.loss.clip_cov_lb, c.loss.clip_cov_ub = "clip_cov", 5.0, 1.0
    with pytest.raises(config.ConfigError, match="loss.clip_cov_lb=5.0 must be below"):
        config.validate(c)
    c.loss.clip_cov_lb, c.loss.kl_cov_ratio = 1.0, 0.0
    with pytest.raises(config.ConfigError, match=r"loss.kl_cov_ratio=0.0 must be in \(0, 1\]"):
        config.validate(c)
