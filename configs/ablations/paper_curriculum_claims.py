"""Pre-registered claims of the paper's curriculum (configs/ablations/paper_axes.py:curriculum),
issue 49, item 4.

Committed before any of its runs, like configs/ablations/paper_axes_claims.py (whose g_axis
and tuning runs recorded that file's hash, so this part has its own file); change it only by
adding a new file. How the controls read: the paper's account (order) predicts the first two
claims; recency (the final evaluation reflects the last quarter's problems, as the robust
curriculum_epoch grid suggested: its whole loss appeared in the all-hard last quarter)
predicts the second one opposite, the references at three quarters and on q4 near 0 or
positive, and q1 negative. q1 .. q4: quartiles of the held-out problems by the same
difficulty file (the warm start's pass rate over 16 samples; ties by the generator's level).
"""

from ebpo_jax.ablation.grid import load_config_file

NAME = "paper curriculum"
CLAIMS_OUT = "results/ablations/paper_curriculum_claims.md"
PART = "curriculum"
EPOCH_END = 112  # one epoch (paper_axes.EPOCH_STEPS)
LAST_QUARTER = 84  # the evaluation before the easy-to-hard order's all-hard last quarter
VERDICT_RULE = (
    "Verdict rule, stated before the runs: the effect is the two-level model's over the "
    "warm-start means (t with W - 1 degrees of freedom), its standard error floored at the "
    "RL-seed noise sigma sqrt(sum 1/n_w) / W (twolevel.floored); beside it the bootstrap over "
    "held-out problems x warm starts (twolevel.bootstrap, 10,000 draws; over the band's "
    "problems for a band claim; none for a claim read before the last step, whose "
    "per-problem counts are not kept). `reproduced` when the span of both 95% intervals "
    "excludes 0 in the predicted direction, `opposite` when it excludes 0 the other way, "
    "`inconclusive` otherwise; the Holm column adjusts the larger of the two p-values across "
    "the claims with a direction (alpha 0.05), and decides. `n/a`: a reference with no "
    "prediction. Every term is read at equal steps (one epoch, or the step it names).\n"
)
SEED_RULE = (
    "Seed rule, stated before the runs: seeds are fixed, never extended: 9 warm starts "
    "(sft.seed 300-308, none used by an earlier grid or another part) x 2 RL seeds (0, 1) "
    "per order, from the power analysis in configs/ablations/paper_axes.py (+0.015 at 80% "
    "power). Each warm start's difficulty file is estimated once from that warm start "
    "(task.difficulty_file=auto, 16 samples at temperature 1, sampling seed 0) and committed "
    "beside it in warm_starts/. Runs pair by (warm start, seed): the same warm start, "
    "difficulty file and sampler keys. A run or claim added later is post hoc.\n"
)
RERUNS = {  # fixed before the runs: each order at the first warm start and seed
    PART: [
        "epoch__sft.seed-300__seed-0__method-ebpo__order-naive",
        "epoch__sft.seed-300__seed-0__method-ebpo__order-difficulty",
        "epoch__sft.seed-300__seed-0__method-ebpo__order-reverse_difficulty",
    ],
}
RERUN_RULE = (
    "Rerun rule, stated before the runs: when the part completes, its runs in RERUNS (each "
    "order at warm start 300, seed 0) are rerun on a machine of the other CPU vendor "
    "(`ablate.py --rerun=RUN_ID`, from the committed warm start and the difficulty file "
    "beside it). Each is judged against the band of its own cell: the 95% prediction "
    "interval of one more run from the cell's 18 committed runs. Inside: consistent; "
    "outside: the cell is flagged and its claims are reported with and without it.\n"
)


def _term(order: str, step: int | None = None) -> tuple:
    where = {"method": "ebpo", "order": order}
    return PART, where if step is None else {**where, "step": step}


def _vs(claim: str, a: str, b: str, direction: int = 1, *, band: str = "", step=None) -> dict:
    """Order `a` minus order `b` (EBPO), paired by (warm start, seed); `band`: that held-out
    quartile's pass@1; `step`: that evaluation instead of the last."""
    out = {
        "claim": claim,
        "direction": direction,
        "plus": [_term(a, step)],
        "minus": [_term(b, step)],
    }
    return {**out, "band": band} if band else out


CLAIMS = [
    # The paper: EBPO-diff (easy to hard by the base model's pass rate) beats EBPO at equal steps.
    _vs(
        "one epoch: EBPO-diff (easy to hard by the warm start's pass rate) beats EBPO-naive",
        "difficulty",
        "naive",
    ),
    _vs(
        "order, not recency: one epoch easy to hard beats hard to easy (same difficulty file)",
        "difficulty",
        "reverse_difficulty",
    ),
    _vs(
        "reference: at three quarters (step 84, before the all-hard quarter), EBPO-diff - naive",
        "difficulty",
        "naive",
        0,
        step=LAST_QUARTER,
    ),
    _vs(
        "reference: hardest held-out quarter (q4), EBPO-diff - naive",
        "difficulty",
        "naive",
        0,
        band="q4",
    ),
    _vs(
        "reference: easiest held-out quarter (q1), EBPO-diff - naive",
        "difficulty",
        "naive",
        0,
        band="q1",
    ),
    {
        # Naive's last-quarter evaluation on the hard problems is the yardstick of the
        # curriculum's all-hard last quarter.
        "claim": "reference: last quarter on q4: EBPO-diff's change (step 84 -> 112) - naive's",
        "direction": 0,
        "band": "q4",
        "plus": [_term("difficulty", EPOCH_END), _term("naive", LAST_QUARTER)],
        "minus": [_term("difficulty", LAST_QUARTER), _term("naive", EPOCH_END)],
    },
    _vs("reference: one epoch, hard to easy - naive", "reverse_difficulty", "naive", 0),
]


def get_config(part: str):
    """The paper-axes grid `part` (configs/ablations/paper_axes.py)."""
    return load_config_file("configs/ablations/paper_axes.py", part)
