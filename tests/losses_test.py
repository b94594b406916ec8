"""Policy losses against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses


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
    loss, metrics = losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg)
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
    plain, _ = losses.policy_loss(logp, old, adv, mask)
    dual, _ = losses.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    np.testing.assert_allclose(plain, (np.exp(3.0) + 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(dual, (3.0 + 1.0) / 2, rtol=1e-6)
    # At ratio 1 the gradient of the token-mean loss w.r.t. logp is -A / n_tokens.
    g = jax.grad(lambda lp: losses.policy_loss(lp, old, jnp.array([2.0]), mask)[0])(old)
    np.testing.assert_allclose(g, [[-1.0, -1.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_kl_estimators_and_entropy_bonus(batch):
    logits, targets, mask, old, adv = batch
    logp = np.asarray(losses.token_logprobs(jnp.asarray(logits), targets), np.float64)
    ref = np.float64(old)
    lr = logp - ref
    want = {"k1": lr, "k2": 0.5 * lr**2, "k3": np.exp(-lr) + lr - 1}
    for est, w in want.items():
        np.testing.assert_allclose(losses.kl_penalty(logp, ref, est), w, rtol=1e-5, atol=1e-6)
        base, _ = losses.policy_loss(logp, old, adv, mask)
        loss, m = losses.policy_loss(
            logp, old, adv, mask, ref_logp_BT=ref, kl_coef=0.1, kl_estimator=est
        )
        kl = w[mask].mean()
        np.testing.assert_allclose(m["actor/kl"], kl, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, base + 0.1 * kl, rtol=1e-5)
    ent = losses.token_entropy(jnp.asarray(logits))
    loss, m = losses.policy_loss(logp, old, adv, mask, entropy_BT=ent, entropy_coef=0.01)
    np.testing.assert_allclose(m["actor/entropy"], np.asarray(ent)[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(loss, base - 0.01 * m["actor/entropy"], rtol=1e-5)
    with pytest.raises(ValueError, match="kl_estimator"):
        losses.kl_penalty(logp, ref, "k4")


def test_denominator_makes_microbatches_sum_to_full_batch(batch):
    logits, targets, mask, old, adv = batch
    logp = losses.token_logprobs(jnp.asarray(logits), targets)
    full, _ = losses.policy_loss(logp, old, adv, mask)
    total = mask.sum()
    parts = [
        losses.policy_loss(
            logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], denominator=total
        )[0]
        for i in range(3)
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)
    with pytest.raises(ValueError, match="agg must be one of"):
        losses.policy_loss(logp, old, adv, mask, agg="mean")
