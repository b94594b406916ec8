"""Math records as the trainer's prompt batches, and the host reward that scores their rollouts.

`MathPromptSource` has the interface of `tasks.PromptSource` (next_batch, next_batches,
state, restore) and yields `tasks.PromptBatch`es of chat-formatted, tokenised prompts in a
`RecordOrder`. Math answers are strings, checked on the host: a batch's `index` is each
prompt's record index (`answer_tokens` are empty), so `make_host_reward` can look the answer
up from the rollout alone, after any resume.
"""

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ebpo_jax import rewards
from ebpo_jax.data.clustering import cluster_texts, topic_ids_from_field
from ebpo_jax.data.config import validate_data_config
from ebpo_jax.data.loading import load_records
from ebpo_jax.data.order import BY_DIFFICULTY, RecordOrder, Shard
from ebpo_jax.data.prompts import render_prompt
from ebpo_jax.data.schemas import DataError, Record
from ebpo_jax.data.tokenize import decode_completions, encode_prompts
from ebpo_jax.schema import Data
from ebpo_jax.tasks import PromptBatch
from ebpo_jax.tasks.synthetic import BatchStream


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Records and their cluster ids (`topic_ids`, aligned with `records`, e.g. k-means
    labels; None = the records' own `topic` field)."""

    records: Sequence[Record]
    topic_ids: Sequence[int] | None = None

    def __post_init__(self):
        if not self.records:
            raise DataError("no records to draw prompts from")
        if self.topic_ids is not None and len(self.topic_ids) != len(self.records):
            raise ValueError(f"{len(self.topic_ids)} topic ids for {len(self.records)} records")


class MathPromptSource(BatchStream):
    """Batches of `batch_size` prompts of the corpus's records in `data.order`, resumable,
    sharded across hosts.

    `data` is the `data` config section (schema.Data): template, chat, system, max_prompt_len,
    on_overflow, order and shuffle_clusters. Prompts over `max_prompt_len` tokens are dropped
    (counted in `num_dropped`) or raise, by `on_overflow`. `difficulty` order needs every
    record's difficulty.
    """

    def __init__(
        self,
        corpus: Corpus,
        tokenizer: Any,
        batch_size: int,
        data: Data | None = None,
        *,
        seed: int = 0,
        shard: Shard = Shard(),
        chat_kwargs: dict | None = None,
    ):
        data = Data() if data is None else data
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        kept = self._encode(corpus.records, tokenizer, data, chat_kwargs)
        self._set_topics(corpus.topic_ids, kept, data.order)
        self.order = RecordOrder(
            len(self.records),
            order=data.order,
            seed=seed,
            topic_ids=self.topic_ids,
            difficulty=self._ordered_difficulty(data.order),
            shuffle_clusters=data.shuffle_clusters,
            shard=shard,
        )
        key = "\n".join(
            [str(self.order.fingerprint), *self.texts, *(r.answer for r in self.records)]
        )
        self.fingerprint = zlib.crc32(key.encode())

    def _encode(self, records, tokenizer, data: Data, chat_kwargs) -> Sequence[int]:
        """Render and tokenise every prompt; keeps those within data.max_prompt_len."""
        texts = [
            render_prompt(
                tokenizer,
                r.prompt,
                template=data.template,
                chat=data.chat,
                system=data.system or None,
                chat_kwargs=chat_kwargs,
            )
            for r in records
        ]
        enc = encode_prompts(
            tokenizer, texts, max_length=data.max_prompt_len, on_overflow=data.on_overflow
        )
        kept = enc.kept
        self.records = [records[i] for i in kept]
        self.texts = [texts[i] for i in kept]
        self.num_dropped = enc.num_dropped
        self._tokens, self._lengths = enc.tokens, enc.lengths
        self._difficulty = np.array(
            [np.nan if r.difficulty is None else r.difficulty for r in self.records], np.float32
        )
        return kept

    def _set_topics(self, topic_ids, kept, order: str) -> None:
        """Cluster ids: the corpus's `topic_ids` of the kept records, else their topics."""
        if topic_ids is not None:
            self.topic_ids = np.asarray(topic_ids, np.int32)[kept]
            self.topic_names = tuple(str(i) for i in range(int(self.topic_ids.max()) + 1))
        elif any(r.topic is not None for r in self.records) or order == "topic":
            self.topic_ids, self.topic_names = topic_ids_from_field(self.records)
        else:
            self.topic_ids, self.topic_names = np.zeros(len(self.records), np.int32), ("all",)

    def _ordered_difficulty(self, order: str):
        """Each record's difficulty for the difficulty orders (DataError if one has none)."""
        if order not in BY_DIFFICULTY:
            return None
        missing = [r.id for r in self.records if r.difficulty is None]
        if missing:
            raise DataError(
                f"order {order!r} needs every record's difficulty; {len(missing)} have none "
                f"(first: {missing[:3]}); write it with experiments/estimate_difficulty.py"
            )
        return [r.difficulty for r in self.records]

    @property
    def num_clusters(self) -> int:
        return len(self.topic_names)

    def state(self) -> dict[str, int]:
        """The resumable position (JSON-able; save it with the checkpoint)."""
        return {**self.order.state(), "fingerprint": self.fingerprint}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()`."""
        if int(state.get("fingerprint", self.fingerprint)) != self.fingerprint:
            raise ValueError(
                f"data state {state} was saved for other records, prompts, order or sharding "
                f"(fingerprint {self.fingerprint})"
            )
        self.order.restore({**state, "fingerprint": self.order.fingerprint})

    def batch(self, indices) -> PromptBatch:
        """The records at `indices` as a PromptBatch (`index`: the record indices)."""
        idx = np.asarray(indices, np.int64)
        return PromptBatch(
            prompt_tokens=self._tokens[idx],
            prompt_lengths=self._lengths[idx],
            answer_tokens=np.zeros((idx.size, 1), np.int32),
            answer_lengths=np.zeros(idx.size, np.int32),
            topic_ids=self.topic_ids[idx],
            difficulty=self._difficulty[idx],
            index=idx.astype(np.int32),
        )

    def next_batch(self) -> PromptBatch:
        """The next `batch_size` prompts of this host's stream."""
        return self.batch(self.order.next_indices(self.batch_size))


def make_host_reward(
    source: MathPromptSource,
    tokenizer: Any,
    *,
    reward: str = "math",
    timeout_s: float = 10.0,
    workers: int | None = None,
    format_weight: float = 0.0,
):
    """host_reward(rollout) -> rewards [P, G] float32: `reward` of each decoded completion.

    `rollout` has index [P] (record indices, from MathPromptSource's batches),
    tokens [P, G, N] and lengths [P, G]. `format_weight` adds that much for a response with
    a final "Answer:" line or a \\boxed{} answer.
    """
    rewards.get_reward(reward)  # a bad name fails now, not at the first step

    def host_reward(rollout) -> np.ndarray:
        tokens_PGN = np.asarray(rollout.tokens)
        P, G, N = tokens_PGN.shape
        idx_P = np.asarray(rollout.index)
        texts = decode_completions(
            tokenizer, tokens_PGN.reshape(P * G, N), np.asarray(rollout.lengths).reshape(P * G)
        )
        answers = [source.records[int(i)].answer for i in idx_P for _ in range(G)]
        r_B = rewards.math_rewards(
            texts, answers, timeout_s=timeout_s, workers=workers, reward=reward
        )
        if format_weight:
            r_B = r_B + format_weight * np.array(
                [rewards.format_reward(t) for t in texts], np.float32
            )
        return r_B.reshape(P, G).astype(np.float32)

    return host_reward


def source_from_config(
    c: Data,
    tokenizer,
    batch_size: int,
    *,
    seed: int = 0,
    shard: Shard = Shard(),
    log: Callable[[str], None] = print,
) -> tuple[MathPromptSource, Callable]:
    """(prompt source, host reward) for the data section `c`."""
    validate_data_config(c)
    schema = c.schema if isinstance(c.schema, str) else dict(c.schema)
    records = load_records(c.path, schema, limit=c.limit or None)
    topic_ids = None
    if c.topics == "kmeans":
        topic_ids = cluster_texts([r.prompt for r in records], c.num_clusters, seed=seed)
    elif c.topics == "none":
        records = [dataclasses.replace(r, topic=None) for r in records]
    source = MathPromptSource(
        Corpus(records, topic_ids), tokenizer, batch_size, c, seed=seed, shard=shard
    )
    log(
        f"data: {len(source.records)} prompts from {c.path} ({source.num_dropped} over "
        f"{c.max_prompt_len} tokens dropped), {source.num_clusters} clusters, order {c.order}"
    )
    host_reward = make_host_reward(
        source,
        tokenizer,
        reward=c.reward,
        timeout_s=c.reward_timeout_s,
        workers=c.reward_workers or None,
        format_weight=c.format_weight,
    )
    return source, host_reward
