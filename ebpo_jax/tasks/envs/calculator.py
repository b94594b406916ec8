"""A calculator tool: a model turn ending in `<calc>EXPR</calc>` reads EXPR's value next.

EXPR is integers joined by + - * (usual precedence), evaluated exactly by a small parser
(no `eval`). A malformed call or a value over MAX_DIGITS digits reads MALFORMED; the
episode goes on either way (the model answers after "#" and stops at EOS).
"""

import re

from ebpo_jax.tasks.envs import Episode, Reply

OPEN, CLOSE = "<calc>", "</calc>"
MALFORMED = "?"
MAX_DIGITS = 12
_EXPR = re.compile(r"^\d{1,12}([+\-*]\d{1,12}){0,7}$")


def evaluate(expr: str) -> int | None:
    """The value of integers joined by + - * (products first), None if malformed."""
    if not _EXPR.match(expr):
        return None
    total, sign, product, number = 0, 1, 1, ""
    for c in expr + "+":
        if c.isdigit():
            number += c
            continue
        product *= int(number)
        number = ""
        if c == "*":
            continue
        total, product = total + sign * product, 1
        sign = 1 if c == "+" else -1
    return total


def call_of(turn: str) -> str | None:
    """The expression of the tool call a turn ends with, None without one."""
    if not turn.endswith(CLOSE):
        return None
    head = turn[: -len(CLOSE)]
    start = head.rfind(OPEN)
    return None if start < 0 else head[start + len(OPEN) :]


class Calculator:
    """The `calculator` environment."""

    stop_sequences = (CLOSE,)
    error_observation = MALFORMED

    def step(self, episode: Episode) -> Reply:
        expr = call_of(episode.turns[-1])
        value = None if expr is None else evaluate(expr)
        if value is None or len(str(abs(value))) > MAX_DIGITS:
            return Reply(MALFORMED)
        return Reply(str(value))
