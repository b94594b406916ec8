"""Procedurally generated arithmetic problems with topics, difficulty levels and a held-out split."""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from ebpo_jax.tasks import splits

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


def _draw_cell(topic: str, difficulty: int, n_test: int, n_train: int, rng: np.random.Generator):
    """(tests kept, rows (prompt, answer)) of one cell: distinct operand pairs in seeded order,
    at most a quarter of the cell to test, then `n_train` (fewer if the cell is exhausted,
    e.g. 1-digit addition has only 100 prompts)."""
    a_all, b_all = _cell_operands(topic, difficulty, rng)
    n_test = min(n_test, len(a_all) // 4)
    n = n_test + n_train
    return n_test, [solve(topic, a, b) for a, b in zip(a_all[:n].tolist(), b_all[:n].tolist())]


CELLS = splits.Cells(TOPICS, DIFFICULTIES, _draw_cell, Problem)
make_splits = functools.partial(splits.make_splits, CELLS)


def max_lengths(problems: Sequence[Problem]) -> tuple[int, int]:
    """The longest prompt and answer, in characters."""
    if not problems:
        raise ValueError("empty problem list")
    return max(len(p.prompt) for p in problems), max(len(p.answer) for p in problems)
