"""Pre-registered claims of the robustness grids (configs/ablations/robust.py), issue 32.

This file is the pre-registration: its claims, verdict rule and seed rule are committed
before any run of those grids, every run records this file's SHA-256, and
`experiments/claims.py --grids=configs/ablations/robust_claims.py` marks a claim post hoc
when the file changed after the runs it reads. Change it only by adding a new file.
"""

import importlib.util
import os

from ebpo_jax.ablation.results import contrast as _vs  # `a` minus `b` in a part, by seed

NAME = "robustness grids"
CLAIMS_OUT = "results/ablations/robust_claims.md"
VERDICT_RULE = (
    "Verdict rule, stated before the runs: `reproduced` when the 95% interval excludes 0 in "
    "the predicted direction, `opposite` when it excludes 0 the other way, `inconclusive` "
    "otherwise; the Holm column adjusts across every claim with a direction (alpha 0.05). "
    "For the warm_starts claims the interval is the two-level model's over the warm-start "
    "means (t with W - 1 = 4 degrees of freedom); the first warm start's paired interval is "
    "shown beside it and decides nothing. `n/a`: a reference with no prediction.\n"
)
SEED_RULE = (
    "Seed rule, stated before the runs: seeds are fixed, never extended: warm_starts 5 warm "
    "starts (sft.seed 0-4) x 3 RL seeds per (method, G); lr_sweep 4 seeds per (method, lr); "
    "curriculum_epoch 7 seeds; budget_g8 4 seeds. Best rate: for each method, the lr whose "
    "final validation pass@1 has the highest mean over its seeds; the methods are compared "
    "on the test split at their own best rates, paired by seed. A run added later, or a "
    "claim added later, is reported as post hoc.\n"
)
_BEST = {"axis": "lr", "by": "val_pass@1"}  # each term at its own best validation rate


def _warm(g: int) -> dict:
    return _vs(f"across warm starts: EBPO beats GRPO at G={g}", "warm_starts", "ebpo", "grpo",
               group_size=g)  # fmt: skip


def _best(other: str, label: str) -> dict:
    claim = _vs(f"best rate: EBPO beats {label} at G=4", "lr_sweep", "ebpo", other)
    return {**claim, "select": _BEST}


def _fixed(other: str, label: str) -> dict:
    claim = f"fixed rate 3e-5 (second view): EBPO - {label} at G=4"
    return _vs(claim, "lr_sweep", "ebpo", other, 0, lr=3e-5)


def _epoch(claim, method, order, base="ebpo", base_order="naive", direction=1) -> dict:
    """`method` in `order` minus `base` in `base_order`, over one epoch, paired by seed."""
    return {
        "claim": claim,
        "direction": direction,
        "plus": [("curriculum_epoch", {"method": method, "order": order})],
        "minus": [("curriculum_epoch", {"method": base, "order": base_order})],
    }


_SHRINK = [("warm_starts", {"method": "ebpo", "group_size": 2}),
           ("warm_starts", {"method": "grpo", "group_size": 8})]  # fmt: skip
_SHRINK_MINUS = [("warm_starts", {"method": "grpo", "group_size": 2}),
                 ("warm_starts", {"method": "ebpo", "group_size": 8})]  # fmt: skip
CLAIMS = [
    _warm(2),
    _warm(4),
    _warm(8),
    {
        "claim": "across warm starts: the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=8)",
        "direction": 1,
        "plus": _SHRINK,
        "minus": _SHRINK_MINUS,
    },
    _best("grpo", "GRPO"),
    _best("dr_grpo", "Dr. GRPO"),
    _best("rloo", "RLOO"),
    _best("rpp", "RPP"),
    _best("dapo", "DAPO"),
    _fixed("grpo", "GRPO"),
    _fixed("dapo", "DAPO"),
    _epoch("one epoch: EBPO-diff beats EBPO-naive", "ebpo", "difficulty"),
    _epoch(
        "(project) one epoch: EBPO per-cell priors, easy-to-hard, beat EBPO-naive",
        "ebpo_cluster",
        "difficulty",
    ),
    _epoch(
        "reference: one epoch, GRPO difficulty - naive", "grpo", "difficulty", "grpo", direction=0
    ),
    _epoch(
        "reference: one epoch, easy-to-hard, per-cell priors - paper EBPO",
        "ebpo_cluster",
        "difficulty",
        base_order="difficulty",
        direction=0,
    ),
    _vs("2x steps: EBPO beats GRPO at G=8", "budget_g8", "ebpo", "grpo", total_steps=400),
    _vs("4x steps: EBPO beats GRPO at G=8", "budget_g8", "ebpo", "grpo", total_steps=800),
]


def get_config(part: str):
    """The robustness grid `part` (configs/ablations/robust.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("robust", os.path.join(here, "robust.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(part)
