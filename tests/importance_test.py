"""Mismatch metrics and TIS / MIS importance weights against float64 numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import config, importance, losses


def _np_is(trainer, sampler, mask, mode, level, cap=2.0, low=0.5, high=2.0):
    """Float64 weights and mask, written from the definitions (verl's rollout correction)."""
    lr = np.where(mask, np.float64(trainer) - np.float64(sampler), 0.0)
    if level == "token":
        log_w = lr
    else:
        total = lr.sum(-1, keepdims=True)
        n = np.maximum(mask.sum(-1, keepdims=True), 1)
        log_w = np.broadcast_to(total if level == "sequence" else total / n, lr.shape)
    ratio = np.exp(np.clip(log_w, -20, 20))
    keep = mask.copy()
    if mode == "none":
        ratio = np.ones_like(ratio)
    elif mode == "tis":
        ratio = np.minimum(ratio, cap)
    else:
        keep = mask & (np.exp(np.float64(log_w)) >= low) & (np.exp(np.float64(log_w)) <= high)
    return np.where(keep, ratio, 0.0), keep


@pytest.fixture
def logps():
    rng = np.random.default_rng(11)
    B, T = 8, 6
    lengths = np.array([6, 4, 0, 1, 6, 3, 5, 2])
    mask = np.arange(T)[None] < lengths[:, None]
    sampler = np.log(rng.uniform(0.02, 1.0, (B, T)))
    # Small bf16-like noise on most rows, a drifted row or two, and garbage under the mask.
    trainer = sampler + rng.normal(0, 0.05, (B, T))
    trainer[1] += rng.normal(0, 1.0, T)
    trainer[4] += 0.2  # sequence product e^1.2 > 2, geometric mean e^0.2 inside the band
    trainer[6, 0] += 30.0  # a token ratio past the exp bound
    trainer[~mask] = np.nan
    f32 = lambda x: np.asarray(x, np.float32)
    return f32(trainer), f32(sampler), mask


@pytest.mark.parametrize("level", importance.IS_LEVELS)
@pytest.mark.parametrize("mode", importance.IS_MODES)
def test_is_correction_matches_float64(logps, mode, level):
    trainer, sampler, mask = logps
    fn = functools.partial(importance.is_correction, mode=mode, level=level, cap=1.5, low=0.6)
    w, keep, metrics = jax.jit(fn)(trainer, sampler, mask)
    want_w, want_keep = _np_is(trainer, sampler, mask, mode, level, cap=1.5, low=0.6)
    np.testing.assert_array_equal(keep, want_keep)
    np.testing.assert_allclose(w, want_w, rtol=1e-5)
    assert np.isfinite(w).all()
    np.testing.assert_allclose(metrics["is/masked_frac"], (mask & ~want_keep).sum() / mask.sum())
    np.testing.assert_allclose(metrics["is/weight_mean"], want_w[want_keep].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["is/weight_max"], want_w.max(), rtol=1e-5)
    if mode == "mis":  # the inputs must put something outside the band at every level
        assert 0 < metrics["is/masked_frac"] < 1
    if mode == "tis":
        np.testing.assert_allclose(
            metrics["is/truncated_frac"], (want_w[mask] == 1.5).mean(), rtol=1e-6
        )
        assert metrics["is/truncated_frac"] > 0


def test_sequence_levels_reject_whole_sequences(logps):
    trainer, sampler, mask = logps
    _, keep, _ = importance.is_correction(trainer, sampler, mask, mode="mis", level="sequence")
    assert not keep[4].any()  # product e^1.2 > 2
    _, keep, _ = importance.is_correction(trainer, sampler, mask, mode="mis", level="geometric")
    np.testing.assert_array_equal(keep[4], mask[4])  # mean e^0.2 inside [1/2, 2]
    _, keep, _ = importance.is_correction(trainer, sampler, mask, mode="mis", level="token")
    assert keep[6, 1:5].all() and not keep[6, 0]  # only the exploded token goes


def test_weights_carry_no_gradient_and_scale_the_policy_term(logps):
    trainer, sampler, mask = logps
    g = jax.grad(
        lambda t: importance.is_correction(t, sampler, mask, mode="tis", level="token")[0].sum()
    )(jnp.asarray(trainer))
    np.testing.assert_array_equal(g, 0.0)
    w, keep, _ = importance.is_correction(trainer, sampler, mask, mode="tis")
    logp = jnp.asarray(np.where(mask, sampler, 0.0))
    adv = jnp.linspace(-1.0, 1.0, mask.shape[0])
    loss_fn = lambda lp, w=None: losses.policy_loss(
        losses.TokenTerms(lp, lp, adv, keep, is_weights_BT=w)
    )[0]
    # At ratio 1 PPO's token gradient is -A / n_tokens; the weight multiplies it.
    g_plain = jax.grad(loss_fn)(logp)
    g_w = jax.grad(functools.partial(loss_fn, w=w))(logp)
    np.testing.assert_allclose(g_w, np.asarray(g_plain) * np.asarray(w), rtol=1e-6)


def test_mismatch_metrics_match_float64(logps):
    trainer, sampler, mask = logps
    m = jax.jit(importance.mismatch_metrics)(sampler, trainer, mask)
    d = (np.float64(trainer) - sampler)[mask]
    dc = np.clip(d, -20, 20)
    want = {
        "mismatch/abs_diff_mean": np.abs(d).mean(),
        "mismatch/abs_diff_max": np.abs(d).max(),
        "mismatch/k3_kl": (np.exp(dc) - dc - 1).mean(),
        "mismatch/ratio_out_frac": ((d < -np.log(2)) | (d > np.log(2))).mean(),
    }
    assert set(m) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(m[k], v, rtol=1e-5, err_msg=k)
    same = importance.mismatch_metrics(sampler, sampler, mask)
    for k, v in same.items():
        assert v == 0.0, k


def test_bad_arguments_and_config_fields():
    x = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), bool)
    with pytest.raises(ValueError, match="mode must be one of"):
        importance.is_correction(x, x, mask, mode="clip")
    with pytest.raises(ValueError, match="level must be one of"):
        importance.is_correction(x, x, mask, mode="tis", level="seq")
    with pytest.raises(ValueError, match="MIS band"):
        importance.is_correction(x, x, mask, mode="mis", low=1.5, high=2.0)
    c = config.default_config()
    bad = [
        ({"is_correction": "tis"}, "needs loss.recompute_old_logprobs=True"),
        ({"is_correction": "TIS", "recompute_old_logprobs": True}, "loss.is_correction='TIS'"),
        ({"is_level": "seq"}, "loss.is_level='seq'"),
        ({"is_cap": 0.5}, "loss.is_cap must be >= 1 .*, got 0.5"),
        ({"is_low": 1.2}, "loss.is_low=1.2"),
        ({"is_high": 0.9}, "loss.is_high=0.9"),
    ]
    for fields, msg in bad:
        c = config.default_config()
        c.loss.update(fields)
        with pytest.raises(config.ConfigError, match=msg.replace("(", r"\(")):
            config.validate(c)
    c = config.default_config()
    c.loss.update({"is_correction": "mis", "is_level": "geometric", "recompute_old_logprobs": True})
    config.validate(c)
