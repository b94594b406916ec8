"""A host reward for tests/refill_test.py, in a module that imports nothing: reward workers
import it by name, and a worker that first imports jax can overrun `data.reward_timeout_s`
on a loaded machine (its items then score 0, a different run)."""


def odd_words(response: str, answer: str) -> float:
    """1.0 for an odd number of words: a random policy earns it about half the time."""
    return float(len(response.split()) % 2)
