"""Token selection from logits: greedy, temperature, top-k and top-p (nucleus)."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.models import invariant as invariant_lib


def validate_sampling(temperature, top_p, top_k, eos_id, vocab_size):
    """Checks the sampling arguments; returns eos ids as a tuple of ints."""
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = no top-k), got {top_k!r}")
    if top_k > vocab_size:
        raise ValueError(f"top_k={top_k} exceeds vocab_size={vocab_size}")
    if eos_id is None:
        eos = ()
    elif isinstance(eos_id, (int, np.integer)) and not isinstance(eos_id, bool):
        eos = (int(eos_id),)
    elif isinstance(eos_id, Sequence) and all(
        isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in eos_id
    ):
        eos = tuple(int(e) for e in eos_id)
    else:
        raise ValueError(f"eos_id must be None, an int or a list of ints, got {eos_id!r}")
    bad = [e for e in eos if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"eos_id {bad} outside the vocabulary [0, {vocab_size})")
    return eos


def truncated_logits(logits_BV, *, temperature=1.0, top_k=0, top_p=1.0):
    """Scaled logits with everything outside the top-k / top-p set at -inf.

    Order as in HF: temperature, then top-k, then top-p over the renormalised top-k.
    Ties at the cut-off are all kept.
    """
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    vocab = scaled_BV.shape[-1]
    if top_k == 0 and top_p >= 1.0:
        return scaled_BV
    # One partial sort serves both cuts: top-p only needs the top-k candidates.
    k = top_k if top_k > 0 else vocab
    sorted_BK = jax.lax.top_k(scaled_BV, k)[0]
    if top_p < 1.0:
        probs_BK = jax.nn.softmax(sorted_BK, axis=-1)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        # Smallest prefix with mass >= top_p; the first candidate is always kept.
        num_kept_B = jnp.maximum(jnp.sum(mass_before_BK < top_p, axis=-1), 1)
    else:
        num_kept_B = jnp.full(sorted_BK.shape[:-1], k)
    cutoff_B = jnp.take_along_axis(sorted_BK, (num_kept_B - 1)[..., None], axis=-1)
    return jnp.where(scaled_BV >= cutoff_B, scaled_BV, -jnp.inf)


def select_tokens(keys_B, logits_BV, *, temperature=1.0, top_k=0, top_p=1.0, invariant=False):
    """Chosen tokens [B] and their temperature-1 full-vocabulary log-probs [B].

    keys_B holds one PRNG key per row, so a row's draw does not depend on the batch.
    temperature == 0 is greedy (top_k/top_p ignored). `invariant`: log-probs by fixed row
    blocks (models.invariant), as the trainer computes them in the batch-invariant mode.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    if temperature == 0:
        tokens_B = jnp.argmax(logits_BV, axis=-1)
    else:
        masked_BV = truncated_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
        tokens_B = jax.vmap(jax.random.categorical)(keys_B, masked_BV)
    tokens_B = tokens_B.astype(jnp.int32)
    if invariant:
        return tokens_B, invariant_lib.token_logprobs(logits_BV, tokens_B)
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    logp_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logp_B


def row_keys(rng, row_ids_B, step):
    """Per-row, per-step keys: fold_in(fold_in(rng, row), step); step is one int or [B]."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    row_keys_B = fold(rng, row_ids_B)
    step_axis = 0 if jnp.ndim(step) == 1 else None
    return jax.vmap(jax.random.fold_in, in_axes=(0, step_axis))(row_keys_B, step)
