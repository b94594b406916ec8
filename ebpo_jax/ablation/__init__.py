"""Ablation grids: expand a grid config into training runs, run them, collect and plot results."""

from ebpo_jax.ablation.grid import METHODS, Run, expand, run_config
from ebpo_jax.ablation.results import collect, paired_difference, summarize, to_markdown

__all__ = [
    "METHODS",
    "Run",
    "collect",
    "expand",
    "paired_difference",
    "run_config",
    "summarize",
    "to_markdown",
]
