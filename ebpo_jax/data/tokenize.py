"""Prompts to right-padded token arrays with a checkpoint's tokenizer; over-long prompts dropped or fatal."""

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ebpo_jax.data.schemas import DataError

OVERFLOW = ("drop", "error")


class EncodedPrompts(NamedTuple):
    """Right-padded prompts: `tokens[i, :lengths[i]]` is kept prompt i (source item `kept[i]`)."""

    tokens: np.ndarray  # [N, max_length] int32
    lengths: np.ndarray  # [N] int32
    kept: np.ndarray  # [N] int32 indices into the input texts
    num_dropped: int


def load_tokenizer(path: str):
    """A `transformers` tokenizer from a local checkpoint folder (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode_prompts(
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_length: int,
    on_overflow: str = "drop",
    add_special_tokens: bool | None = None,
    pad_id: int = 0,
) -> EncodedPrompts:
    """Token ids of `texts`, right-padded to `max_length`.

    Texts over `max_length` tokens are dropped and counted (`on_overflow="drop"`) or raise
    (`"error"`). `add_special_tokens` defaults to False for chat-formatted texts (the chat
    template already holds BOS) and True otherwise, judged by the text starting with BOS.
    """
    if on_overflow not in OVERFLOW:
        raise ValueError(f"on_overflow must be one of {OVERFLOW}, got {on_overflow!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not texts:
        raise ValueError("no prompts to encode")
    bos = getattr(tokenizer, "bos_token", None)
    if add_special_tokens is None:
        special = [not (bos and t.startswith(bos)) for t in texts]
    else:
        special = [add_special_tokens] * len(texts)
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (False, True):  # one batched (parallel) tokenizer call per setting
        group = [i for i, s in enumerate(special) if s == flag]
        if group:
            out = tokenizer([texts[i] for i in group], add_special_tokens=flag)["input_ids"]
            for i, x in zip(group, out):
                ids[i] = x
    lengths = np.array([len(x) for x in ids], np.int32)
    too_long = np.flatnonzero(lengths > max_length)
    if too_long.size and on_overflow == "error":
        i = int(too_long[0])
        raise DataError(
            f"{too_long.size} of {len(texts)} prompts exceed max_length={max_length} tokens "
            f"(data.max_prompt_len); the first is item {i} ({lengths[i]} tokens): "
            f"{texts[i][:80]!r}..."
        )
    kept = np.flatnonzero(lengths <= max_length).astype(np.int32)
    if kept.size == 0:
        raise DataError(
            f"all {len(texts)} prompts exceed max_length={max_length} tokens "
            f"(data.max_prompt_len; the shortest has {int(lengths.min())}): nothing to train on"
        )
    tokens = np.full((kept.size, max_length), pad_id, np.int32)
    for row, i in enumerate(kept):
        tokens[row, : lengths[i]] = ids[i]
    return EncodedPrompts(tokens, lengths[kept], kept, int(too_long.size))


def decode_completions(tokenizer: Any, tokens_BN, lengths_B) -> list[str]:
    """The text of each completion, cut at its length, special tokens (EOS) dropped."""
    tokens_BN, lengths_B = np.asarray(tokens_BN), np.asarray(lengths_B)
    rows = [row[:n].tolist() for row, n in zip(tokens_BN, lengths_B)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
