"""The reasoning family: generated problems whose answer follows a written chain of steps
(ebpo_jax.tasks.reasoning), trained like the arithmetic family (SFT warm start, jittable
reward on the text after the last `#`)."""

from ebpo_jax.spec import TaskSpec
from ebpo_jax.tasks import reasoning
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import Task


def load_problems(spec: TaskSpec):
    """(tokenizer, train problems, held-out problems) of the `task` section."""
    return task_arithmetic.load_problems(spec, reasoning, reasoning.make_tokenizer())


def build(spec: TaskSpec, *, mesh=None, log=print) -> Task:
    """Chains of steps, their char tokenizer and the final-answer reward."""
    return task_arithmetic.build_synthetic(
        spec, reasoning, reasoning.make_tokenizer(), reasoning.reward_fn, mesh=mesh, log=log
    )
