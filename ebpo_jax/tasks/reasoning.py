"""Reasoning-length synthetic tasks: the answer follows a written chain of verifiable steps.

Each problem's supervised completion is a chain of steps separated by ";", then "#" and the
final answer, e.g. "47+85=" -> "7+5+0=12;4+8+1=13;#132". Topics:
  carry_add  column addition, right to left, each step "a_i+b_i+carry=sum" (carry written out);
  carry_mul  a multi-digit number times one digit, each step "a_i*b+carry=product";
  chain      a +/- expression of several operands, evaluated left to right, one step per
             operation ("12+7=19;19-5=14;#14").
Difficulty 1-3 lengthens the chain (more digits or operands); within a cell the number of
steps varies, with a geometric tail in `chain`, so completion lengths (16-64 tokens with
EOS) are right-skewed. The reward scores only the final answer: the text after the last
"#" and before EOS must equal it exactly (the chain is the policy's business, as in RLVR).
Same API as the arithmetic family (Problem fields, make_splits, jittable reward_fn); the
only addition is `Problem.completion`, the SFT target. Topic and difficulty counts (3, 3)
fit inside the arithmetic family's cluster ids (5 topics x 3 levels).
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from ebpo_jax.tasks import reward, splits
from ebpo_jax.tasks.tokenizer import DEFAULT_ALPHABET, NUM_SPECIAL, CharTokenizer

TOPICS = ("carry_add", "carry_mul", "chain")
DIFFICULTIES = (1, 2, 3)
STEP_SEP, MARKER = ";", "#"
# A superset of the arithmetic alphabet, so the shared characters keep their ids.
ALPHABET = DEFAULT_ALPHABET + STEP_SEP + MARKER
MARKER_ID = NUM_SPECIAL + ALPHABET.index(MARKER)
# Completion + EOS lengths (tokens): the longest fits the sampler's budget
# (sampler.max_new_tokens in configs/reasoning.py).
MIN_RESPONSE_TOKENS, MAX_RESPONSE_TOKENS = 16, 64


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: `prompt` ("47+85="), the final `answer` ("132") and the supervised
    `completion` (the chain of steps, MARKER, then the answer)."""

    prompt: str
    answer: str
    topic: str
    topic_id: int
    difficulty: int
    id: str
    completion: str


def make_tokenizer() -> CharTokenizer:
    """The char tokenizer of this family (arithmetic's alphabet plus STEP_SEP and MARKER)."""
    return CharTokenizer(ALPHABET)


def _digits(n: int) -> list[int]:
    """Decimal digits of n >= 0, least significant first."""
    return [int(c) for c in reversed(str(n))]


def carry_add_steps(a: int, b: int) -> list[str]:
    """Column-addition steps of a + b, right to left: "a_i+b_i+carry=column sum"."""
    da, db = _digits(a), _digits(b)
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return steps


def carry_mul_steps(a: int, b: int) -> list[str]:
    """Long-multiplication steps of a * b (b one digit), right to left: "a_i*b+carry=product"."""
    steps, carry = [], 0
    for x in _digits(a):
        p = x * b + carry
        steps.append(f"{x}*{b}+{carry}={p}")
        carry = p // 10
    return steps


def chain_steps(operands: Sequence[int], ops: Sequence[str]) -> list[str]:
    """Left-to-right evaluation steps of operands[0] ops[0] operands[1] ...: "x op y=z"."""
    steps, acc = [], operands[0]
    for op, y in zip(ops, operands[1:]):
        new = acc + y if op == "+" else acc - y
        steps.append(f"{acc}{op}{y}={new}")
        acc = new
    return steps


def _carry_add(d: int, rng: np.random.Generator) -> tuple[str, list[str], int]:
    n = d + 1  # digits of the longer operand
    a = int(rng.integers(10 ** (n - 1), 10**n))
    b = int(rng.integers(1, 10 ** int(rng.integers(1, n + 1))))
    a, b = (a, b) if rng.random() < 0.5 else (b, a)
    return f"{a}+{b}=", carry_add_steps(a, b), a + b


def _carry_mul(d: int, rng: np.random.Generator) -> tuple[str, list[str], int]:
    a = int(rng.integers(10**d, 10 ** (d + 1)))
    b = int(rng.integers(2, 10))
    return f"{a}*{b}=", carry_mul_steps(a, b), a * b


def _chain(d: int, rng: np.random.Generator) -> tuple[str, list[str], int]:
    # d + 1 operations, plus a geometric tail: the long responses of the length distribution.
    num_ops = min(d + int(rng.geometric(0.5)), 6)
    operands = [int(rng.integers(1, 100))]
    ops = []
    for _ in range(num_ops):
        acc = operands[0] + sum(y if o == "+" else -y for o, y in zip(ops, operands[1:]))
        op = "-" if rng.random() < 0.5 and acc > 1 else "+"
        y = int(rng.integers(1, (acc if op == "-" else 99) + 1))  # intermediates stay >= 0
        ops.append(op)
        operands.append(y)
    prompt = str(operands[0]) + "".join(f"{o}{y}" for o, y in zip(ops, operands[1:])) + "="
    steps = chain_steps(operands, ops)
    return prompt, steps, int(steps[-1].split("=")[1])


_GENERATORS = {"carry_add": _carry_add, "carry_mul": _carry_mul, "chain": _chain}


def solve(topic: str, prompt: str) -> tuple[str, str]:
    """(completion, answer) of a prompt of `topic`, recomputed from the prompt text alone."""
    expr = prompt.removesuffix("=")
    if topic == "carry_add":
        a, b = (int(x) for x in expr.split("+"))
        steps, answer = carry_add_steps(a, b), a + b
    elif topic == "carry_mul":
        a, b = (int(x) for x in expr.split("*"))
        steps, answer = carry_mul_steps(a, b), a * b
    elif topic == "chain":
        nums, ops, cur = [], [], ""
        for c in expr:
            if c in "+-":
                nums.append(int(cur))
                ops.append(c)
                cur = ""
            else:
                cur += c
        nums.append(int(cur))
        steps = chain_steps(nums, ops)
        answer = int(steps[-1].split("=")[1])
    else:
        raise ValueError(f"unknown topic {topic!r}; known: {TOPICS}")
    return STEP_SEP.join(steps) + STEP_SEP + MARKER + str(answer), str(answer)


def _cell_prompts(topic: str, d: int, n: int, rng: np.random.Generator) -> list[tuple]:
    """Up to n distinct (prompt, answer, completion) of one cell whose completion + EOS has
    MIN_RESPONSE_TOKENS..MAX_RESPONSE_TOKENS tokens."""
    out, seen = [], set()
    for _ in range(50 * n):  # a bounded search: small cells return what exists
        if len(out) == n:
            break
        prompt, steps, answer = _GENERATORS[topic](d, rng)
        completion = STEP_SEP.join(steps) + STEP_SEP + MARKER + str(answer)
        fits = MIN_RESPONSE_TOKENS <= len(completion) + 1 <= MAX_RESPONSE_TOKENS
        if prompt in seen or not fits:
            continue
        seen.add(prompt)
        out.append((prompt, str(answer), completion))
    return out


def _draw_cell(topic: str, d: int, n_test: int, n_train: int, rng: np.random.Generator):
    """(n_test, rows (prompt, answer, completion)) of one cell: distinct prompts in seeded order."""
    return n_test, _cell_prompts(topic, d, n_test + n_train, rng)


CELLS = splits.Cells(TOPICS, DIFFICULTIES, _draw_cell, Problem)
make_splits = functools.partial(splits.make_splits, CELLS)


def final_answer(completion: str) -> str | None:
    """The text after the last MARKER of a completion (cut at EOS), None without a MARKER."""
    _, sep, tail = completion.rpartition(MARKER)
    return tail if sep else None


def string_reward(completion: str, answer: str, *, has_eos: bool) -> float:
    """Host reference: 1.0 iff the completion ended with EOS and its final answer is `answer`."""
    return float(has_eos and final_answer(completion) == answer)


# Rewards [B] float32: 1.0 where the tokens between the last MARKER and the first EOS (within
# the completion's length) spell the answer exactly; no EOS or no MARKER is 0.
reward_fn = functools.partial(reward.reward_fn, marker_id=MARKER_ID)


def response_lengths(problems: Sequence[Problem]) -> np.ndarray:
    """Supervised response lengths in tokens (completion + EOS), the length distribution."""
    return np.array([len(p.completion) + 1 for p in problems], np.int32)
