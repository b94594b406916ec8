"""Exact-answer reward for the synthetic tasks: a jittable array version and a host string version.

A completion earns 1.0 iff its tokens up to (excluding) its first EOS spell the answer exactly
and that EOS lies within the completion's length. A completion without EOS (truncated, or
junk after the answer) earns 0: the policy must learn to stop, or it would be rewarded
for "19" followed by anything cut at max_new_tokens.
"""

from collections.abc import Sequence

import jax.numpy as jnp

from ebpo_jax.tasks.tokenizer import EOS_ID, NUM_SPECIAL, CharTokenizer


def reward_inputs(completion_tokens_BN, completion_lengths_B, answer_tokens_BA, answer_lengths_B):
    """(tokens [B, N], lengths clipped to [0, N], answer [B, A], answer lengths) as int arrays."""
    tok_BN = jnp.asarray(completion_tokens_BN)
    ans_BA = jnp.asarray(answer_tokens_BA)
    if tok_BN.ndim != 2 or ans_BA.ndim != 2 or tok_BN.shape[0] != ans_BA.shape[0]:
        raise ValueError(
            f"expected completion [B, N] and answer [B, A] tokens, got {tok_BN.shape}, {ans_BA.shape}"
        )
    len_B = jnp.clip(jnp.asarray(completion_lengths_B, jnp.int32), 0, tok_BN.shape[1])
    return tok_BN, len_B, ans_BA, jnp.asarray(answer_lengths_B, jnp.int32)


def reward_fn(
    completion_tokens_BN,
    completion_lengths_B,
    answer_tokens_BA,
    answer_lengths_B,
    *,
    eos_id: int = EOS_ID,
    require_eos: bool = True,
    marker_id: int | None = None,
):
    """Rewards [B] float32: 1.0 where the completion's content (before its first EOS within its
    length; after its last `marker_id` when one is given, 0 without one) equals the answer."""
    tok_BN, len_B, ans_BA, ans_len_B = reward_inputs(
        completion_tokens_BN, completion_lengths_B, answer_tokens_BA, answer_lengths_B
    )
    N, A = tok_BN.shape[1], ans_BA.shape[1]
    # Pad so that position A (where the EOS must sit for the longest answer) always exists.
    W = max(N, A + 1)
    tok_BW = jnp.pad(tok_BN, ((0, 0), (0, W - N)))
    pos_W = jnp.arange(W)
    is_eos_BW = (tok_BW == eos_id) & (pos_W[None, :] < len_B[:, None])
    has_eos_B = is_eos_BW.any(-1)
    # Content ends at the first valid EOS, or at the completion's length if there is none.
    content_len_B = jnp.where(has_eos_B, jnp.argmax(is_eos_BW, -1), len_B)
    start_B, ok_B = jnp.zeros_like(len_B), has_eos_B | (not require_eos)
    if marker_id is not None:
        is_marker_BW = (tok_BW == marker_id) & (pos_W[None, :] < content_len_B[:, None])
        start_B = W - jnp.argmax(is_marker_BW[:, ::-1], -1)  # just after the last marker
        ok_B &= is_marker_BW.any(-1)
    # The answer's A slots against the content from its start (a clipped gather: slots past
    # the answer's length are ignored, the length check covers them).
    idx_BA = jnp.clip(start_B[:, None] + jnp.arange(A)[None, :], 0, W - 1)
    got_BA = jnp.take_along_axis(tok_BW, idx_BA, axis=1)
    in_answer_BA = jnp.arange(A)[None, :] < ans_len_B[:, None]
    tokens_match_B = jnp.all(~in_answer_BA | (got_BA == ans_BA), axis=-1)
    ok_B &= tokens_match_B & (content_len_B - start_B == ans_len_B)
    return ok_B.astype(jnp.float32)


def string_reward(
    completion: str, answer: str, *, has_eos: bool, require_eos: bool = True
) -> float:
    """Host reference: 1.0 iff the completion text equals the answer (and ended with EOS)."""
    return float(completion == answer and (has_eos or not require_eos))


def host_reward(
    tokenizer: CharTokenizer,
    completion_ids: Sequence[int],
    answer: str,
    *,
    require_eos: bool = True,
) -> float:
    """Host reward of one completion's ids (already cut at its length), via decoded strings."""
    ids = [int(i) for i in completion_ids]
    has_eos = tokenizer.eos_id in ids
    content = ids[: ids.index(tokenizer.eos_id)] if has_eos else ids
    # Pad/BOS or out-of-alphabet ids inside the content never spell an answer; decode() would
    # silently drop pad/BOS, so reject them here.
    if any(not NUM_SPECIAL <= i < tokenizer.vocab_size for i in content):
        return 0.0
    text = tokenizer.decode(content)
    return string_reward(text, answer, has_eos=has_eos, require_eos=require_eos)


def group_reward_fn(
    completion_tokens_BN,
    completion_lengths_B,
    answer_tokens_PA,
    answer_lengths_P,
    group_size: int,
    **kwargs,
):
    """Rewards [P, G] of P*G prompt-major completions (prompt i's samples are rows i*G..i*G+G-1)."""
    P = answer_tokens_PA.shape[0]
    if completion_tokens_BN.shape[0] != P * group_size:
        raise ValueError(
            f"{completion_tokens_BN.shape[0]} completions != {P} prompts x group_size {group_size}"
        )
    ans_BA = jnp.repeat(jnp.asarray(answer_tokens_PA), group_size, axis=0)
    ans_len_B = jnp.repeat(jnp.asarray(answer_lengths_P), group_size, axis=0)
    r_B = reward_fn(completion_tokens_BN, completion_lengths_B, ans_BA, ans_len_B, **kwargs)
    return r_B.reshape(P, group_size)
