"""Rollouts: sample a batch of answers (one turn, many turns, or refilled rounds) and score it."""
