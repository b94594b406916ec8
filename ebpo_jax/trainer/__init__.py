"""The EBPO trainer: task protocol and families, rollout, update, the step builder, the host
loop, the SFT warm start."""

from ebpo_jax.trainer.rollout import Rollout, make_rollout_fn
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_train_step, multi_step
from ebpo_jax.trainer.task import Reward, Task, build_task, register
from ebpo_jax.trainer.update import make_update_fn

__all__ = [
    "Reward",
    "Rollout",
    "Task",
    "TrainState",
    "build_task",
    "init_train_state",
    "make_optimizer",
    "make_rollout_fn",
    "make_runner",
    "make_train_step",
    "make_update_fn",
    "multi_step",
    "register",
]
