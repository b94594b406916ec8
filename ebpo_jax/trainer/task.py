"""`ebpo_jax.trainer.task` as earlier scripts import it: the task protocol and registry live in
`ebpo_jax.tasks.protocol`."""

from ebpo_jax.tasks.protocol import (  # noqa: F401
    VALIDATION,
    Reward,
    Task,
    build_task,
    families,
    get,
    mean_pass,
    model_config_from,
    register,
    tokenizer_vocab,
)
