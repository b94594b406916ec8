"""ebpo-jax: Empirical Bayes Policy Optimization for LLM RL in pure JAX."""

from ebpo_jax.cpu_flags import add_cpu_flags

add_cpu_flags()  # before anything below can start an XLA backend

from ebpo_jax import advantages, losses
from ebpo_jax.advantages import (
    EBState,
    dr_grpo_advantage,
    eb_advantage,
    eb_diagnostics,
    grpo_advantage,
    init_eb_state,
    reinforce_pp_baseline_advantage,
    rloo_advantage,
)

__all__ = [
    "EBState",
    "advantages",
    "dr_grpo_advantage",
    "eb_advantage",
    "eb_diagnostics",
    "grpo_advantage",
    "init_eb_state",
    "losses",
    "reinforce_pp_baseline_advantage",
    "rloo_advantage",
]
