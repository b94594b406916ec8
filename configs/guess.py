"""Multi-turn CPU task 2: guess the number from higher/lower hints (task.family "guess",
ebpo_jax.tasks.guess): up to 5 guesses of 3 tokens, each answered "<", ">" or "=".
The SFT transcripts mix bisection with random guesses; EBPO can learn to bisect.
"""

from ebpo_jax.config import finalize, load_sibling


def get_config():
    c = load_sibling(__file__, "reasoning.py").get_config()
    c.unlock()
    c.workdir = "runs/guess"
    c.task.family = "guess"
    c.task.train_per_cell = 300
    c.task.test_per_cell = 30
    c.total_steps = 60
    c.eval_every = 20
    c.checkpoint_every = 20
    c.sampler.max_new_tokens = 56  # 5 turns of "NN?" + a hint and the open range "<LO-HI="
    c.rollout.max_turns = 5
    c.rollout.turn_tokens = 4
    c.rollout.env_workers = 2
    c.model.overrides.max_position_embeddings = 72  # prompt + episode + one turn
    c.optimizer.learning_rate = 1e-4
    c.dapo.overlong_buffer = 0
    return finalize(c)
