"""The EBPO trainer: the train state, the update, the step builder and the host loop (task
families: `ebpo_jax.tasks`; rollouts: `ebpo_jax.rollout`)."""

from ebpo_jax.rollout.single_turn import Rollout, make_rollout_fn
from ebpo_jax.tasks.protocol import Reward, Task, build_task, register
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_train_step, multi_step
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
