"""ebpo-jax: Empirical Bayes Policy Optimization for LLM RL in pure JAX."""
