"""The EBPO trainer: TrainState, rollouts, the pure train step, the host loop, SFT warm start,
and what a run trains on (task_setup)."""

from ebpo_jax.trainer.rollout import Rollout, make_rollout_fn
from ebpo_jax.trainer.state import TrainState, init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_multi_step, make_train_step, make_update_fn
from ebpo_jax.trainer.task_setup import Task, build_task

__all__ = [
    "Rollout",
    "Task",
    "TrainState",
    "build_task",
    "init_train_state",
    "make_multi_step",
    "make_optimizer",
    "make_rollout_fn",
    "make_train_step",
    "make_update_fn",
]
