"""Multi-turn CPU task 1: the reasoning problems with a calculator tool (task.family
"calculator", ebpo_jax.tasks.calc): the policy may write `<calc>47+85</calc>`, reads the
value from the environment and answers after "#". The SFT warm start shows the tool on half
of the problems (the observation off its loss, tasks/calc.py); a tool episode succeeds far
more often than a written chain, and EBPO learns to call the tool.
"""

from ebpo_jax.config import finalize, load_sibling


def get_config():
    c = load_sibling(__file__, "reasoning.py").get_config()
    c.unlock()
    c.workdir = "runs/calculator"
    c.task.family = "calculator"
    c.total_steps = 120
    c.eval_every = 30
    c.checkpoint_every = 30
    c.rollout.max_turns = 3  # a tool call, the answer, one spare
    c.rollout.turn_tokens = 64
    c.rollout.env_workers = 2
    c.model.overrides.max_position_embeddings = 160  # prompt + episode + one turn
    c.optimizer.learning_rate = 1e-4
    return finalize(c)
