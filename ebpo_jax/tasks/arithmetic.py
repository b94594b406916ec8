"""Procedurally generated arithmetic problems with topics, difficulty levels and a held-out split."""

import dataclasses
from collections.abc import Sequence

import numpy as np

TOPICS = ("addition", "subtraction", "multiplication", "modular", "comparison")
DIFFICULTIES = (1, 2, 3)

# Operand ranges (inclusive) per (topic, difficulty). Difficulty grows with operand size;
# the largest prompt, "999+999=", is 8 characters and the largest answer 4, so a whole
# BOS + prompt + answer + EOS sequence fits in 14 tokens.
_RANGES = {
    ("addition", 1): ((0, 9), (0, 9)),
    ("addition", 2): ((10, 99), (10, 99)),
    ("addition", 3): ((100, 999), (100, 999)),
    ("subtraction", 1): ((0, 9), (0, 9)),
    ("subtraction", 2): ((10, 99), (0, 99)),
    ("subtraction", 3): ((100, 999), (0, 999)),
    ("multiplication", 1): ((0, 9), (0, 9)),
    ("multiplication", 2): ((10, 99), (2, 9)),
    ("multiplication", 3): ((10, 99), (10, 99)),
    ("modular", 1): ((0, 99), (2, 9)),
    ("modular", 2): ((100, 999), (2, 9)),
    ("modular", 3): ((100, 999), (10, 99)),
    ("comparison", 1): ((0, 9), (0, 9)),
    ("comparison", 2): ((10, 99), (10, 99)),
    ("comparison", 3): ((100, 999), (100, 999)),
}
_SYMBOL = {"addition": "+", "subtraction": "-", "multiplication": "*", "modular": "%"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One verifiable problem: `prompt` (e.g. "12+7=") must be completed by exactly `answer`."""

    prompt: str
    answer: str
    topic: str
    topic_id: int
    difficulty: int
    id: str

    @property
    def completion(self) -> str:
        """The supervised response (SFT target): the answer itself."""
        return self.answer


def solve(topic: str, a: int, b: int) -> tuple[str, str]:
    """The (prompt, answer) strings of `topic` on operands a, b."""
    if topic == "comparison":
        return f"{a}?{b}=", "<" if a < b else (">" if a > b else "=")
    if topic not in _SYMBOL:
        raise ValueError(f"unknown topic {topic!r}; known: {TOPICS}")
    result = {"+": a + b, "-": a - b, "*": a * b, "%": a % b if b else None}[_SYMBOL[topic]]
    if result is None:
        raise ValueError(f"modular problem with divisor 0: {a}%{b}")
    return f"{a}{_SYMBOL[topic]}{b}=", str(result)


def _cell_operands(topic: str, difficulty: int, rng: np.random.Generator):
    """All distinct operand pairs (a, b) of one (topic, difficulty) cell, in seeded random order."""
    (a_lo, a_hi), (b_lo, b_hi) = _RANGES[topic, difficulty]
    nb = b_hi - b_lo + 1
    size = (a_hi - a_lo + 1) * nb
    # A permutation of the whole cell (<= 810k pairs) is cheap and gives distinct pairs.
    flat = rng.permutation(size)
    a, b = a_lo + flat // nb, b_lo + flat % nb
    if topic == "subtraction":  # non-negative answers keep the task learnable by a tiny model
        keep = a >= b
        a, b = a[keep], b[keep]
    return a, b


def make_splits(
    seed: int,
    *,
    train_per_cell: int = 400,
    test_per_cell: int = 40,
    topics: Sequence[str] = TOPICS,
    difficulties: Sequence[int] = DIFFICULTIES,
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic (train, test) problem lists with disjoint prompts.

    Each (topic, difficulty) cell draws distinct operand pairs in seeded order; the first
    `test_per_cell` (at most a quarter of the cell) go to test, the next `train_per_cell`
    to train (fewer if the cell is exhausted, e.g. 1-digit addition has only 100 prompts).
    The test split therefore does not depend on `train_per_cell`.
    """
    check_grid(topics, difficulties, train_per_cell, test_per_cell, TOPICS, DIFFICULTIES)
    train, test = [], []
    for topic in topics:
        topic_id = TOPICS.index(topic)
        for difficulty in difficulties:
            rng = np.random.default_rng([seed, topic_id, difficulty])
            a_all, b_all = _cell_operands(topic, difficulty, rng)
            # Small cells (1-digit operands) give at most a quarter of their prompts to test.
            n_test = min(test_per_cell, len(a_all) // 4)
            n = n_test + train_per_cell
            for k, (a, b) in enumerate(zip(a_all[:n].tolist(), b_all[:n].tolist())):
                split, out = ("test", test) if k < n_test else ("train", train)
                prompt, answer = solve(topic, a, b)
                pid = f"{split}/{topic}/{difficulty}/{len(out)}"
                out.append(Problem(prompt, answer, topic, topic_id, difficulty, pid))
    return train, test


def max_lengths(problems: Sequence[Problem]) -> tuple[int, int]:
    """The longest prompt and answer, in characters."""
    if not problems:
        raise ValueError("empty problem list")
    return max(len(p.prompt) for p in problems), max(len(p.answer) for p in problems)


def check_grid(topics, difficulties, train_per_cell, test_per_cell, known_topics, known_levels):
    """ValueError naming the first unknown topic or difficulty, or a negative per-cell count."""
    for t in topics:
        if t not in known_topics:
            raise ValueError(f"unknown topic {t!r}; known: {known_topics}")
    for d in difficulties:
        if d not in known_levels:
            raise ValueError(f"unknown difficulty {d!r}; known: {known_levels}")
    if train_per_cell < 0 or test_per_cell < 0:
        raise ValueError(f"per-cell counts must be >= 0, got {train_per_cell}, {test_per_cell}")
