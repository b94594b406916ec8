"""One `make_splits` for the generated families: a grid of (topic, difficulty) cells, each drawn
in one seeded sequence whose first problems go to test and the next to train."""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ebpo_jax import schema

_TASK = schema.Task()  # the per-cell counts' defaults are the config's


class Cells(NamedTuple):
    """A family's grid: its topics and levels, how one cell is drawn, and its Problem type."""

    topics: tuple[str, ...]
    difficulties: tuple[int, ...]
    # (topic, difficulty, n_test, n_train, rng) -> (tests kept, rows (prompt, answer, *extra))
    draw: Callable[..., tuple[int, list[tuple[str, ...]]]]
    problem: type  # built as problem(prompt, answer, topic, topic_id, difficulty, id, *extra)
    salt: tuple[int, ...] = ()  # appended to each cell's seed


def make_splits(
    cells: Cells,
    seed: int,
    *,
    train_per_cell: int = _TASK.train_per_cell,
    test_per_cell: int = _TASK.test_per_cell,
    topics: Sequence[str] | None = None,
    difficulties: Sequence[int] | None = None,
) -> tuple[list, list]:
    """Deterministic (train, test) problem lists of the grid (every topic and level by default).

    A cell's draw depends only on (seed, topic, difficulty), and test takes its first
    problems, so the test split does not depend on `train_per_cell`.
    """
    topics = cells.topics if topics is None else topics
    difficulties = cells.difficulties if difficulties is None else difficulties
    check_grid(topics, difficulties, train_per_cell, test_per_cell, cells)
    train, test = [], []
    for topic in topics:
        topic_id = cells.topics.index(topic)
        for d in difficulties:
            rng = np.random.default_rng([seed, topic_id, d, *cells.salt])
            n_test, rows = cells.draw(topic, d, test_per_cell, train_per_cell, rng)
            for k, (prompt, answer, *extra) in enumerate(rows):
                split, out = ("test", test) if k < n_test else ("train", train)
                pid = f"{split}/{topic}/{d}/{len(out)}"
                out.append(cells.problem(prompt, answer, topic, topic_id, d, pid, *extra))
    return train, test


def check_grid(topics, difficulties, train_per_cell: int, test_per_cell: int, cells: Cells):
    """ValueError naming the first unknown topic or difficulty, or a negative per-cell count."""
    for t in topics:
        if t not in cells.topics:
            raise ValueError(f"unknown topic {t!r}; known: {cells.topics}")
    for d in difficulties:
        if d not in cells.difficulties:
            raise ValueError(f"unknown difficulty {d!r}; known: {cells.difficulties}")
    if train_per_cell < 0 or test_per_cell < 0:
        raise ValueError(f"per-cell counts must be >= 0, got {train_per_cell}, {test_per_cell}")
