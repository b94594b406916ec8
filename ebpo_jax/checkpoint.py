"""`ebpo_jax.checkpoint` as README examples and earlier scripts import it: the run-time
module is `ebpo_jax.runtime.checkpoint`."""

from ebpo_jax.runtime.checkpoint import (  # noqa: F401
    Checkpointer,
    CheckpointError,
    PreemptionGuard,
    list_steps,
    load_params,
    verify_manifest,
)
