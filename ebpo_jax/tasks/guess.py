"""Guess the number (ebpo_jax.tasks.envs.guess): the prompt is a range "LO-HI=", the secret a number
in it; the model guesses ("37?"), reads "<" or ">" and the range still open ("<17-36="),
or "=", and guesses again.

Topics are range sizes (small 8-15, medium 16-31 numbers); difficulty 1-3 shifts the range
upwards (more digits to copy). The SFT warm start is a transcript per problem mixing
bisection (the midpoint of the range the hints leave) with uniformly random guesses inside
that range (RANDOM_GUESS_FRAC of guesses): the warm-started policy finds the secret within
`rollout.max_turns` guesses only sometimes; bisection always does for these sizes at 5 turns.
The reward comes from the environment (1 when found); the task's own reward is 0.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from ebpo_jax.tasks import splits
from ebpo_jax.tasks.envs.guess import ASK, FOUND, LESS, MORE, open_range
from ebpo_jax.tasks.tokenizer import CharTokenizer

TOPICS = ("small", "medium")
DIFFICULTIES = (1, 2, 3)
_SIZES = {"small": (8, 15), "medium": (16, 31)}
_BASE = {1: (0, 20), 2: (20, 60), 3: (60, 68)}  # where LO may start
RANDOM_GUESS_FRAC = 0.5
MAX_SFT_GUESSES = 5


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str  # "LO-HI="
    answer: str  # the secret
    topic: str
    topic_id: int
    difficulty: int
    id: str
    completion: str  # an SFT transcript: guesses and hints


def make_tokenizer() -> CharTokenizer:
    return CharTokenizer()


def transcript(lo: int, hi: int, secret: int, rng: np.random.Generator) -> str:
    """Guesses and the environment's replies until found (or MAX_SFT_GUESSES): each guess the
    midpoint of the open range or, with RANDOM_GUESS_FRAC, a random number in it."""
    out = []
    for _ in range(MAX_SFT_GUESSES):
        g = int(rng.integers(lo, hi + 1)) if rng.random() < RANDOM_GUESS_FRAC else (lo + hi) // 2
        if g == secret:
            out.append(f"{g}{ASK}{FOUND}")
            break
        lo, hi = open_range(lo, hi, [g], secret)
        out.append(f"{g}{ASK}{LESS if secret < g else MORE}{lo}-{hi}=")
    return "".join(out)


def _draw_cell(topic: str, d: int, n_test: int, n_train: int, rng: np.random.Generator):
    """(n_test, rows (prompt, secret, transcript)) of one cell: distinct (range, secret) triples."""
    seen, rows = set(), []
    for _ in range(50 * (n_train + n_test)):
        if len(seen) == n_train + n_test:
            break
        size = int(rng.integers(_SIZES[topic][0], _SIZES[topic][1] + 1))
        lo = int(rng.integers(*_BASE[d]))
        hi, secret = lo + size - 1, int(rng.integers(lo, lo + size))
        if (lo, hi, secret) in seen:
            continue
        seen.add((lo, hi, secret))
        rows.append((f"{lo}-{hi}=", str(secret), transcript(lo, hi, secret, rng)))
    return n_test, rows


CELLS = splits.Cells(TOPICS, DIFFICULTIES, _draw_cell, Problem, salt=(7,))
make_splits = functools.partial(splits.make_splits, CELLS)


def reward_fn(tokens_BN, lengths_B, answers_BA, answer_lengths_B, *, eos_id=2):
    """The task's own reward: 0 (the environment scores a found secret)."""
    del lengths_B, answers_BA, answer_lengths_B, eos_id
    return jnp.zeros(tokens_BN.shape[:1], jnp.float32)
