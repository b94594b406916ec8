"""Problems as arrays: a resumable prompt source for RL and supervised sequences for the SFT warm start."""

import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ebpo_jax.data.order import ORDERS, RecordOrder  # noqa: F401  (ORDERS re-exported)
from ebpo_jax.tasks.arithmetic import Problem, max_lengths
from ebpo_jax.tasks.tokenizer import CharTokenizer


class PromptBatch(NamedTuple):
    """P problems as right-padded int32 arrays (a pytree, so it can be stacked and scanned)."""

    prompt_tokens: np.ndarray  # [P, Lp], BOS + prompt
    prompt_lengths: np.ndarray  # [P]
    answer_tokens: np.ndarray  # [P, La], answer only (no BOS/EOS)
    answer_lengths: np.ndarray  # [P]
    topic_ids: np.ndarray  # [P]
    difficulty: np.ndarray  # [P]
    index: np.ndarray  # [P], position of the problem in the source's list


class SFTBatch(NamedTuple):
    """BOS + prompt + answer + EOS, right-padded; `loss_mask` is True on the answer and EOS tokens.

    The mask is aligned with `tokens`: train on logits[:, :-1] against tokens[:, 1:] with
    loss_mask[:, 1:].
    """

    tokens: np.ndarray  # [B, T]
    loss_mask: np.ndarray  # [B, T] bool
    lengths: np.ndarray  # [B]


def encode_problems(
    problems: Sequence[Problem],
    tokenizer: CharTokenizer,
    *,
    prompt_len: int | None = None,
    answer_len: int | None = None,
) -> PromptBatch:
    """All `problems` as one PromptBatch (e.g. the whole test split for evaluation)."""
    prompt_tokens, prompt_lengths = tokenizer.encode_batch(
        [p.prompt for p in problems], add_bos=True, length=prompt_len
    )
    answer_tokens, answer_lengths = tokenizer.encode_batch(
        [p.answer for p in problems], length=answer_len
    )
    return PromptBatch(
        prompt_tokens,
        prompt_lengths,
        answer_tokens,
        answer_lengths,
        np.array([p.topic_id for p in problems], np.int32),
        np.array([p.difficulty for p in problems], np.int32),
        np.arange(len(problems), dtype=np.int32),
    )


def sft_examples(
    problems: Sequence[Problem], tokenizer: CharTokenizer, *, seq_len: int | None = None
) -> SFTBatch:
    """Supervised sequences of `problems` with the loss restricted to the completion + EOS
    (the answer for arithmetic; the chain of steps and the answer for reasoning problems)."""
    texts = [p.prompt + p.completion for p in problems]
    tokens, lengths = tokenizer.encode_batch(texts, add_bos=True, add_eos=True, length=seq_len)
    prompt_end = np.array([1 + len(p.prompt) for p in problems], np.int32)[:, None]
    pos = np.arange(tokens.shape[1])[None, :]
    loss_mask = (pos >= prompt_end) & (pos < lengths[:, None])
    return SFTBatch(tokens, loss_mask, lengths)


class BatchStream:
    """Iterator protocol and K-step stacking for any source with `next_batch()`."""

    def next_batch(self) -> PromptBatch:
        raise NotImplementedError

    def next_batches(self, k: int) -> PromptBatch:
        """The next k batches stacked on a leading axis [k, P, ...], for a scanned K-step loop."""
        batches = [self.next_batch() for _ in range(k)]
        return PromptBatch(*(np.stack(f) for f in zip(*batches)))

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch:
        return self.next_batch()


class PromptSource(BatchStream):
    """Batches of P problems in a seeded order per epoch; its whole state is {epoch, position}.

    Orders (`ebpo_jax.data.order.RecordOrder`): `naive` shuffles each epoch; `topic` and `difficulty`
    stably sort that shuffle by topic id or difficulty (easy first; `reverse_difficulty` hard
    first), so each epoch sweeps the groups in turn. `difficulty` ([n] floats, e.g. a
    difficulty file's) replaces the generator's levels as the key. A batch that runs past the
    end of an epoch continues with the next one.
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        tokenizer: CharTokenizer,
        batch_size: int,
        *,
        seed: int = 0,
        order: str = "naive",
        prompt_len: int | None = None,
        answer_len: int | None = None,
        difficulty: Sequence[float] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.problems = list(problems)
        max_prompt, max_answer = max_lengths(self.problems)
        self.tokenizer, self.batch_size, self.seed = tokenizer, batch_size, seed
        # Fixed widths over the whole list so every batch has the same shapes (one compile).
        self.prompt_len = max_prompt + 1 if prompt_len is None else prompt_len
        self.answer_len = max_answer if answer_len is None else answer_len
        self._encoded = encode_problems(
            self.problems, tokenizer, prompt_len=self.prompt_len, answer_len=self.answer_len
        )
        # Clusters in ascending id order: each epoch sweeps topics 0, 1, ... in turn.
        self.order = RecordOrder(
            len(self.problems),
            order=order,
            seed=seed,
            topic_ids=self._encoded.topic_ids,
            difficulty=self._encoded.difficulty if difficulty is None else difficulty,
            shuffle_clusters=False,
        )
        # Identifies the problem list, seed and order, so a resume on other data fails loudly.
        key = "\n".join([str(seed), order] + [p.prompt for p in self.problems])
        if difficulty is not None:  # another difficulty file is another order
            key += np.asarray(difficulty, np.float64).tobytes().hex()
        self.fingerprint = zlib.crc32(key.encode())

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Problem indices in the order of `epoch`."""
        return self.order.epoch_order(epoch)

    def state(self) -> dict[str, int]:
        """The resumable position (JSON-able; save it with the checkpoint)."""
        return {**self.order.state(), "fingerprint": self.fingerprint}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()`."""
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            raise ValueError(
                f"data state {state} was saved for other problems, seed or order "
                f"(fingerprint {self.fingerprint})"
            )
        self.order.restore({**state, "fingerprint": self.order.fingerprint})

    def next_indices(self) -> np.ndarray:
        """Indices of the next batch, advancing the state."""
        return self.order.next_indices(self.batch_size)

    def next_batch(self) -> PromptBatch:
        """The next P problems as arrays."""
        idx = self.next_indices()
        return PromptBatch(*(np.asarray(a)[idx] for a in self._encoded))
