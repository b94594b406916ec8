"""Token selection: distribution (chi-square), truncation sets, greedy, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax.sampler import selection as sampling

LOGITS_V = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def reference_probs(logits_V, temperature, top_k, top_p):
    """HF's order in float64: temperature, top-k, then top-p on the renormalised rest."""
    z = np.asarray(logits_V, np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(z.shape, bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum_before = np.cumsum(p[order]) - p[order]
        keep_sorted = cum_before < top_p
        keep_sorted[0] = True
        keep = np.zeros(z.shape, bool)
        keep[order[keep_sorted]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def chi2_pvalue(counts, probs):
    """Pearson chi-square p-value over the support of probs; inf if mass falls outside."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = n * probs[support]
    stat = np.sum((counts[support] - expected) ** 2 / expected)
    df = support.sum() - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


def draw(n, temperature, top_k, top_p, seed=0):
    logits_BV = jnp.broadcast_to(jnp.asarray(LOGITS_V, jnp.float32), (n, len(LOGITS_V)))
    keys_B = sampling.row_keys(jax.random.key(seed), jnp.arange(n), 0)
    fn = jax.jit(
        lambda k, x: sampling.select_tokens(k, x, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    tokens_B, logp_B = fn(keys_B, logits_BV)
    return np.asarray(tokens_B), np.asarray(logp_B)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.7)],
)
def test_chi_square(temperature, top_k, top_p):
    n = 20_000
    tokens, logp = draw(n, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=len(LOGITS_V))
    probs = reference_probs(LOGITS_V, temperature, top_k, top_p)
    assert chi2_pvalue(counts, probs) > 1e-4
    # The test has power: the untruncated temperature-1 law is rejected whenever
    # the sampling law differs from it.
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert chi2_pvalue(counts, reference_probs(LOGITS_V, 1.0, 0, 1.0)) < 1e-6
    # Log-probs are temperature-1, full-vocab, whatever the sampling law.
    full_logp = jax.nn.log_softmax(jnp.asarray(LOGITS_V, jnp.float32))
    np.testing.assert_allclose(logp, np.asarray(full_logp)[tokens], rtol=0, atol=1e-6)


def test_truncation_sets():
    logits = jnp.asarray(LOGITS_V, jnp.float32)[None]
    for top_k, top_p in [(3, 1.0), (0, 0.5), (0, 0.9), (4, 0.6), (1, 1.0), (0, 1e-9)]:
        masked = sampling.truncated_logits(logits, top_k=top_k, top_p=top_p)
        kept = np.isfinite(np.asarray(masked))[0]
        np.testing.assert_array_equal(kept, reference_probs(LOGITS_V, 1.0, top_k, top_p) > 0)


def test_greedy_ignores_truncation_and_keys():
    logits_BV = jax.random.normal(jax.random.key(1), (16, 50))
    keys_B = sampling.row_keys(jax.random.key(2), jnp.arange(16), 3)
    tokens_B, logp_B = sampling.select_tokens(
        keys_B, logits_BV, temperature=0.0, top_k=5, top_p=0.3
    )
    np.testing.assert_array_equal(tokens_B, np.argmax(logits_BV, -1))
    np.testing.assert_allclose(logp_B, np.max(jax.nn.log_softmax(logits_BV), -1), atol=1e-6)


def test_row_keys_depend_on_row_and_step_only():
    a = sampling.row_keys(jax.random.key(0), jnp.array([0, 1, 2, 3]), 5)
    b = sampling.row_keys(jax.random.key(0), jnp.array([2, 3]), 5)
    c = sampling.row_keys(jax.random.key(0), jnp.array([2, 3]), 6)
    np.testing.assert_array_equal(jax.random.key_data(a[2:]), jax.random.key_data(b))
    assert not np.array_equal(jax.random.key_data(b), jax.random.key_data(c))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 100}, "top_k"),
        ({"eos_id": 1.5}, "eos_id"),
        ({"eos_id": [1, 99]}, "eos_id"),
    ],
)
def test_validate_sampling_errors(kwargs, match):
    args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos_id": None, "vocab_size": 50} | kwargs
    with pytest.raises(ValueError, match=match):
        sampling.validate_sampling(**args)


def test_validate_sampling_eos_forms():
    check = sampling.validate_sampling
    assert check(1.0, 1.0, 0, None, 50) == ()
    assert check(1.0, 1.0, 0, 7, 50) == (7,)
    assert check(1.0, 1.0, 0, [7, 3], 50) == (7, 3)
    assert check(1.0, 1.0, 0, np.int32(4), 50) == (4,)
