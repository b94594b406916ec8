"""Record orders for RL (naive, topic-grouped, easy or hard first), resumable, sharded across hosts.

Each epoch is one global order of all records, identical on every host; host i of n takes
every n-th record of it (positions i, i+n, ...), cut to the same count on every host so all
hosts run the same number of steps. A strided subsequence keeps the order's structure: each
host's stream is grouped by topic, or monotone in difficulty, like the global one.
"""

import zlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

ORDERS = ("naive", "topic", "difficulty", "reverse_difficulty")
BY_DIFFICULTY = ("difficulty", "reverse_difficulty")


class Shard(NamedTuple):
    """This host's share of the records: host `index` of `count`."""

    index: int = 0
    count: int = 1


class RecordOrder:
    """Indices of the next batch of records; its whole state is {epoch, position} (+ a fingerprint).

    - `naive`: a seeded shuffle per epoch.
    - `topic`: records grouped by cluster id (EBPO-topic); clusters in seeded order per epoch
      (or ascending with `shuffle_clusters=False`), records shuffled within a cluster.
    - `difficulty`: easy to hard (ascending difficulty, EBPO-diff), ties shuffled; each epoch
      is another easy-to-hard pass.
    - `reverse_difficulty`: hard to easy by the same key (the curriculum's order control).
    """

    def __init__(
        self,
        num_records: int,
        *,
        order: str = "naive",
        seed: int = 0,
        topic_ids: Sequence[int] | None = None,
        difficulty: Sequence[float] | None = None,
        shuffle_clusters: bool = True,
        shard: Shard = Shard(),
    ):
        host_id, num_hosts = shard
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; known: {ORDERS}")
        if not 0 <= host_id < num_hosts:
            raise ValueError(f"host_id {host_id} not in [0, num_hosts={num_hosts})")
        if num_records < num_hosts:
            raise ValueError(f"{num_records} records cannot be split across {num_hosts} hosts")
        self.num_records, self.order, self.seed = num_records, order, seed
        self.num_hosts, self.host_id, self.shuffle_clusters = num_hosts, host_id, shuffle_clusters
        self.topic_ids = self._key("topic_ids", topic_ids, order == "topic", np.int64)
        self.difficulty = self._key("difficulty", difficulty, order in BY_DIFFICULTY, np.float64)
        if self.difficulty is not None and np.isnan(self.difficulty).any():
            raise ValueError(
                f"difficulty has NaN at records {np.flatnonzero(np.isnan(self.difficulty))[:10]}"
            )
        self.shard_size = num_records // num_hosts  # equal on every host
        # Identifies data, order and sharding, so a resume on anything else fails loudly.
        key = repr((num_records, order, seed, shuffle_clusters, num_hosts, host_id))
        for arr in (self.topic_ids, self.difficulty):
            if arr is not None:
                key += arr.tobytes().hex()
        self.fingerprint = zlib.crc32(key.encode())
        self.epoch, self.position = 0, 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _key(self, name, values, required: bool, dtype):
        if values is None:
            if required:
                raise ValueError(f"order {self.order!r} needs {name}")
            return None
        arr = np.asarray(values, dtype)
        if arr.shape != (self.num_records,):
            raise ValueError(f"{name} has shape {arr.shape}, expected ({self.num_records},)")
        return arr

    def global_order(self, epoch: int) -> np.ndarray:
        """All record indices in epoch `epoch`'s order (the same on every host)."""
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.num_records)
        if self.order == "topic":
            clusters = np.unique(self.topic_ids)
            rank = np.empty(clusters.max() - clusters.min() + 1, np.int64)
            cluster_order = rng.permutation(clusters) if self.shuffle_clusters else clusters
            rank[cluster_order - clusters.min()] = np.arange(clusters.size)
            perm = perm[np.argsort(rank[self.topic_ids[perm] - clusters.min()], kind="stable")]
        elif self.order in BY_DIFFICULTY:
            sign = 1.0 if self.order == "difficulty" else -1.0
            perm = perm[np.argsort(sign * self.difficulty[perm], kind="stable")]
        return perm

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This host's record indices in epoch `epoch`."""
        if self._cache is None or self._cache[0] != epoch:
            shard = self.global_order(epoch)[self.host_id :: self.num_hosts][: self.shard_size]
            self._cache = (epoch, shard)
        return self._cache[1]

    def state(self) -> dict[str, int]:
        """The resumable position (JSON-able; save it with the checkpoint)."""
        return {"epoch": self.epoch, "position": self.position, "fingerprint": self.fingerprint}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by `state()`."""
        if int(state.get("fingerprint", self.fingerprint)) != self.fingerprint:
            raise ValueError(
                f"data state {state} was saved for other data, order, seed or host sharding "
                f"(this order's fingerprint is {self.fingerprint})"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.shard_size:
            raise ValueError(f"data state {state} out of range for a shard of {self.shard_size}")
        self.epoch, self.position = epoch, position

    def next_indices(self, batch_size: int) -> np.ndarray:
        """Record indices [batch_size] of this host's next batch, advancing the state.

        A batch that runs past the end of an epoch continues with the next epoch's start.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = []
        while len(out) < batch_size:
            order = self.epoch_order(self.epoch)
            take = min(batch_size - len(out), order.size - self.position)
            out.extend(order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == order.size:
                self.epoch, self.position = self.epoch + 1, 0
        return np.array(out, np.int64)
