"""EBPO inside other RL frameworks: a stateful estimator object and per-framework shims."""
