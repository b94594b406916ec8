"""Guess the number: the prompt gives a range "LO-HI=", the model guesses a number and ends
the turn with "?"; the environment answers "<" (the secret is smaller) or ">" (larger)
followed by the range still open, "LO-HI=", or "=" (found: reward 1, episode over).
Success within the turn limit needs several turns (bisection of a range of n numbers needs
up to ceil(log2(n + 1)) guesses); the echoed range spares the policy the bookkeeping.
"""

from ebpo_jax.tasks.envs import Episode, Reply

ASK = "?"
LESS, MORE, FOUND = "<", ">", "="
BAD = " "  # a turn that is not a number


def parse_range(prompt: str) -> tuple[int, int]:
    """(LO, HI) of a prompt "LO-HI="."""
    lo, hi = prompt.removesuffix("=").split("-")
    return int(lo), int(hi)


def as_guess(turn: str) -> int | None:
    """The number a turn guesses, None if it is not one."""
    text = turn.removesuffix(ASK)
    return int(text) if text.isdigit() and len(text) <= 6 else None


def open_range(lo: int, hi: int, guesses, secret: int) -> tuple[int, int]:
    """The range the hints to `guesses` leave open."""
    for g in guesses:
        if g is not None and g < secret:
            lo = max(lo, g + 1)
        elif g is not None and g > secret:
            hi = min(hi, g - 1)
    return lo, hi


def reply_to(prompt: str, turns, secret: int) -> Reply:
    """The hint for the last of `turns` and the range still open."""
    guesses = [as_guess(t) for t in turns]
    lo, hi = open_range(*parse_range(prompt), guesses, secret)
    g = guesses[-1]
    if g == secret:
        return Reply(FOUND, reward=1.0, done=True)
    hint = BAD if g is None else LESS if secret < g else MORE
    return Reply(f"{hint}{lo}-{hi}=")


class GuessNumber:
    """The `guess` environment; the episode's `answer` is the secret number."""

    stop_sequences = (ASK,)
    error_observation = BAD

    def step(self, episode: Episode) -> Reply:
        return reply_to(episode.prompt, episode.turns, int(episode.answer))
