"""A character-level tokenizer for the synthetic tasks: pad=0, bos=1, eos=2, then one id per character."""

from collections.abc import Sequence

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
DEFAULT_ALPHABET = "0123456789+-*%?=<> "


class CharTokenizer:
    """Maps each character of a fixed alphabet to one id; special ids come first."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._to_id = {c: i + NUM_SPECIAL for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + NUM_SPECIAL

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS/EOS."""
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} in {text!r} is not in the alphabet"
            ) from None
        return [BOS_ID] * add_bos + ids + [EOS_ID] * add_eos

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """The text of `ids`, skipping pad/bos and (by default) stopping at the first EOS."""
        out = []
        for i in (int(i) for i in ids):
            if i == EOS_ID and stop_at_eos:
                break
            if i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            if not NUM_SPECIAL <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside vocab of size {self.vocab_size}")
            out.append(self.alphabet[i - NUM_SPECIAL])
        return "".join(out)

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        add_bos: bool = False,
        add_eos: bool = False,
        length: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded int32 tokens [B, length] and int32 lengths [B]."""
        seqs = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        lengths = np.array([len(s) for s in seqs], np.int32)
        longest = int(lengths.max(initial=0))
        length = longest if length is None else length
        if longest > length:
            raise ValueError(f"text of {longest} tokens does not fit length={length}")
        tokens = np.full((len(seqs), length), PAD_ID, np.int32)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)] = s
        return tokens, lengths

    def decode_batch(self, tokens: np.ndarray, lengths: np.ndarray | None = None) -> list[str]:
        """Texts of the rows of `tokens`, each cut at its length (if given) and first EOS."""
        tokens = np.asarray(tokens)
        if lengths is None:
            return [self.decode(row) for row in tokens]
        return [self.decode(row[:n]) for row, n in zip(tokens, np.asarray(lengths))]
