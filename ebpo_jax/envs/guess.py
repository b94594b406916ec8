"""Guess the number: the prompt gives a range "LO-HI?", the model guesses a number and ends
the turn with "?"; the environment answers "<" (the secret is smaller), ">" (larger) or "="
(found: reward 1, episode over). Success within the turn limit needs several turns
(bisection of a range of n numbers needs up to ceil(log2(n + 1)) guesses).
"""

from ebpo_jax.envs import Episode, Reply

ASK = "?"
LESS, MORE, FOUND = "<", ">", "="
BAD = " "  # a turn that is not a number


def reply_to(guess_text: str, secret: int) -> Reply:
    """The hint for one guess ("<", ">" or "=" with reward 1 and done)."""
    text = guess_text.removesuffix(ASK)
    if not text.isdigit() or len(text) > 6:
        return Reply(BAD)
    guess = int(text)
    if guess == secret:
        return Reply(FOUND, reward=1.0, done=True)
    return Reply(LESS if secret < guess else MORE)


class GuessNumber:
    """The `guess` environment; the episode's `answer` is the secret number."""

    stop_sequences = (ASK,)
    error_observation = BAD

    def step(self, episode: Episode) -> Reply:
        return reply_to(episode.turns[-1], int(episode.answer))
