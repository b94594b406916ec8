"""ebpo-jax: Empirical Bayes Policy Optimization for LLM RL in pure JAX.

Importing it has no side effects. The XLA:CPU flags measured for this project
(`ebpo_jax.runtime.cpu_flags.add_cpu_flags()`) are set by the entry points (experiments/, benchmarks/,
the tests); a library user may call it before jax starts a backend.
"""

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

__version__ = "0.2.0"  # setup.py reads it; CHANGELOG.md says what each version changed

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
