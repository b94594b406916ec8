"""The reasoning claims (configs/ablations/reasoning.py) over the arithmetic-task grids.

Not a grid: `experiments/claims.py` reads it for the second column of the reasoning claims
table. Parts are the committed arithmetic grids (3 seeds each, every seed with its own warm
start): group_size.py (block `budget`, G in {2, 4, 8, 16}, no RLOO), estimator_variants.py
(at G=2, not 4) and curriculum.py (G=4).
"""

from ebpo_jax.ablation import grid as grid_lib
from ebpo_jax.ablation.results import contrast as _vs  # `a` minus `b` in a part, by seed

NAME = "arithmetic task"
PARTS = ("group_size", "estimator_variants", "curriculum")
CLAIMS_OUT = "results/ablations/arithmetic_claims.md"


def get_config(part: str):
    """The arithmetic grid `part` (its out_dir holds the committed results.csv)."""
    if part not in PARTS:
        raise ValueError(f"configs/ablations/arithmetic_claims.py:{part}: one of {PARTS}")
    return grid_lib.load_config_file(f"configs/ablations/{part}.py")


def _budget(claim, a, b, g, direction=1):
    """`a` minus `b` at G=g in group_size.py's equal-budget block."""
    return _vs(claim, "group_size", a, b, direction, block="budget", group_size=g)


def _order(claim, order, method, direction=1):
    """`order` minus the naive order for `method` in curriculum.py."""
    return _vs(claim, "curriculum", order, "naive", direction, "order", method=method)


def _variant(claim, method):
    """An estimator variant minus paper EBPO in estimator_variants.py (no prediction)."""
    return _vs(claim, "estimator_variants", method, "ebpo", 0)


_B = {"block": "budget"}
CLAIMS = [
    _budget("EBPO beats GRPO at G=2", "ebpo", "grpo", 2),
    _budget("EBPO beats GRPO at G=4", "ebpo", "grpo", 4),
    _budget("EBPO beats GRPO at G=8", "ebpo", "grpo", 8),
    _budget("EBPO beats GRPO at G=16", "ebpo", "grpo", 16),
    {
        "claim": "the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=16)",
        "direction": 1,
        "plus": [
            ("group_size", {**_B, "method": "ebpo", "group_size": 2}),
            ("group_size", {**_B, "method": "grpo", "group_size": 16}),
        ],
        "minus": [
            ("group_size", {**_B, "method": "grpo", "group_size": 2}),
            ("group_size", {**_B, "method": "ebpo", "group_size": 16}),
        ],
    },
    _budget("EBPO beats Dr. GRPO at G=4", "ebpo", "dr_grpo", 4),
    _budget("EBPO beats DAPO at G=4", "ebpo", "dapo", 4),
    _order("EBPO-topic beats EBPO-naive", "topic", "ebpo"),
    _order("EBPO-diff beats EBPO-naive", "difficulty", "ebpo"),
    _budget("(project) the gain is the shrunk baseline: EBPO beats RPP at G=2", "ebpo", "rpp", 2),
    _budget("(project) EBPO beats RPP at G=4", "ebpo", "rpp", 4),
    _budget("reference: Dr. GRPO - GRPO at G=4", "dr_grpo", "grpo", 4, 0),
    _budget("reference: DAPO - GRPO at G=4", "dapo", "grpo", 4, 0),
    _order("reference: GRPO topic - naive", "topic", "grpo", 0),
    _order("reference: GRPO difficulty - naive", "difficulty", "grpo", 0),
    _variant("variant: per-batch statistics - paper EBPO", "ebpo_per_batch"),
    _variant("variant: per-cell priors - paper EBPO", "ebpo_cluster"),
    _variant("variant: forgetting 0.95 - paper EBPO", "ebpo_forget"),
]
