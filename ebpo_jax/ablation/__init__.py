"""Ablation grids: expand a grid config into training runs, run them, collect and plot results."""

from ebpo_jax.ablation.grid import METHODS, Run, expand, run_config, with_seeds
from ebpo_jax.ablation.results import (
    claims,
    collect,
    paired_by_problem,
    paired_difference,
    summarize,
    to_markdown,
)

__all__ = [
    "METHODS",
    "Run",
    "claims",
    "collect",
    "expand",
    "paired_by_problem",
    "paired_difference",
    "run_config",
    "summarize",
    "to_markdown",
    "with_seeds",
]
