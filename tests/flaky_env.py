"""A test environment that sleeps, crashes or raises (its own light module: pool workers
import it)."""

import os
import time

from ebpo_jax.tasks.envs import Reply


class Flaky:
    """Sleeps, crashes its process or raises, by the turn's text."""

    stop_sequences = ("?",)
    error_observation = "!"

    def step(self, episode):
        turn = episode.turns[-1]
        if turn == "sleep?":
            time.sleep(600)
        if turn == "crash?":
            os._exit(3)
        if turn == "raise?":
            raise RuntimeError("tool bug")
        return Reply(turn.upper(), reward=float(len(episode.turns)))
