"""The paper's own axes on the reasoning task (issue 49), fresh warm starts, 4x the held-out set.

`--config=configs/ablations/paper_axes.py:<part>`, part one of
  g_axis   EBPO, GRPO and Clip-Cov at G = 2, 4, 8, 16 with a fixed 16 prompts per step, so
           compute grows with G as in the paper (512 prompts per step there); 8 warm starts
           (`sft.seed` 100-107) x 2 RL seeds, by the power analysis below;
  tuning   GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, Clip-Cov, EBPO and DAPO at G=4 (128
           responses per step), lr on a 5-point log grid 1e-5 .. 3e-4, 3 warm starts
           (`sft.seed` 200-202) x 2 RL seeds, each rate chosen on the validation split
           (disjoint from train and test); EBPO and DAPO evaluate every 10 steps (not 50), so
           DAPO is read where it has spent EBPO's tokens between evaluations 10 steps apart;
  curriculum  the paper's EBPO-diff: one epoch (112 steps x 32 prompts at G=4, 3584 of the
           3600 training problems, no restart) ordered easy to hard by the warm start's own
           pass rate over 16 samples at temperature 1 (`task.difficulty_file=auto`: estimated
           once per warm start, written beside it in warm_starts/), against naive (the
           task's seeded shuffle) at equal steps, and hard to easy by the same file (order vs
           recency); evaluated at each quarter (every 28 steps), the held-out problems also
           split into quartiles of that file's difficulty (`pass@1/q1` .. `q4`); EBPO only,
           9 warm starts (`sft.seed` 300-308) x 2 RL seeds, 54 runs. Its claims are in their
           own file (CLAIMS_FILES): the g_axis and tuning runs recorded CLAIMS_FILE's hash.
Every part evaluates 80 held-out problems per cell (720, 4x the 180 of the earlier grids:
problem sampling is no longer the binding noise) at 4 samples. No run is shared with
another grid or part, and no warm start with any earlier grid (those used `sft.seed` 0-4).
The claims, verdict rule, seed rule and rerun rule are in CLAIMS_FILE (the curriculum's in
CLAIMS_FILES), committed before any run (`ablate.py` refuses to train otherwise); every run
records its SHA-256. Seeds are fixed here: run without --power_effect or --seeds. Warm
starts are written content-addressed to `<out_dir>/warm_starts/` (commit them with the
results; the curriculum's difficulty files sit beside them).

Power analysis (ebpo_jax.ablation.power.warm_starts_needed), from the robust warm_starts
grid's variance components (results/ablations/robust_warm_starts, twolevel.interval):
warm-start sd tau = 0.0107 and RL-seed sd sigma = 0.0094 of the paired EBPO - GRPO
difference (G=2, the largest tau among the single-G claims). To detect +0.015 at 80% power
with the two-sided t over warm-start means: 1 seed needs 10 warm starts, 2 seeds 8, 3 seeds 8,
4 seeds 7. Warm starts dominate, so 2 RL seeds (the fewest that estimate sigma for the
standard-error floor) under 8 warm starts. The tuning grid picks rates, its claims are
secondary: 3 warm starts x 2 seeds (the issue's minimum). The curriculum: the same +0.015
at 80% power, tau = 0.0107 (as above; no grid has measured it for an order contrast) and
sigma = 0.0108, the RL-seed sd of EBPO difficulty - naive at the epoch's end in
results/ablations/robust_curriculum_epoch (7 seeds; 0.0115 at step 84 gives the same
counts): 1 seed needs 11 warm starts, 2 seeds 9, 3 seeds 8, 4 seeds 8; 2 seeds x 9 warm
starts is the fewest runs (18 per order).

Run the curriculum (claims committed first): `python experiments/ablate.py
--config=configs/ablations/paper_axes.py:curriculum --workers=2` (or `--executor=ray`), then
`python experiments/claims.py --grids=configs/ablations/paper_curriculum_claims.py`. Size:
54 runs of 14,336 responses; scaled from the 16 finished g_axis runs' wall times (0.039 s
per generated response, this 2-core machine under load) about 8.5 CPU-hours of training,
plus at most 4.8 for the 9 difficulty estimates (69,120 samples each, at the g_axis runs'
non-step time per evaluation sample, SFT and compiles included): about 13 CPU-hours.
"""

import ml_collections

CLAIMS_FILE = "configs/ablations/paper_axes_claims.py"
# A part registered after others trained: its own file keeps their recorded hash current.
CLAIMS_FILES = {"curriculum": "configs/ablations/paper_curriculum_claims.py"}
PARTS = ("g_axis", "tuning", "curriculum")
FIXED = {  # the reasoning grids' schedule, 4x the held-out problems
    "total_steps": 200,
    "eval_every": 50,
    "eval_samples": 4,
    "checkpoint_every": 50,
    "keep_checkpoints": 1,
    "task": {"test_per_cell": 80},
}
WARM_STARTS = {
    "g_axis": list(range(100, 108)),
    "tuning": [200, 201, 202],
    "curriculum": list(range(300, 309)),
}
SEEDS = [0, 1]
GROUP_SIZES = [2, 4, 8, 16]
PROMPTS = 16  # per step at every G (configs/reasoning.py's)
LRS = [1e-5, 2.3e-5, 5.5e-5, 1.3e-4, 3e-4]  # 1e-5 * 30^(k/4), k = 0..4, to 2 digits
TUNED = ["grpo", "dr_grpo", "rloo", "rpp", "clip_cov"]
DENSE = ["ebpo", "dapo"]  # evaluated every 10 steps: DAPO's equal-token reading
BUDGET = 128  # responses per step in the tuning part (G=4: 32 prompts)
VAL_PER_CELL = 20
EPOCH_STEPS = 112  # one pass over 9 cells x 400 training problems at 32 prompts per step
ORDERS = ["naive", "difficulty", "reverse_difficulty"]  # easy to hard, hard to easy
CURRICULUM = {  # one epoch at G=4, evaluated at each quarter, ordered by the warm start
    "group_size": 4,
    "prompts_per_step": BUDGET // 4,
    "total_steps": EPOCH_STEPS,
    "eval_every": EPOCH_STEPS // 4,
    "checkpoint_every": EPOCH_STEPS // 2,
    "task": {"difficulty_file": "auto", "difficulty_samples": 16},
}


def _blocks(part: str) -> list[dict]:
    axes = {"sft.seed": WARM_STARTS[part], "seed": SEEDS}
    if part == "curriculum":
        axes = {**axes, "method": ["ebpo"], "order": ORDERS}
        return [
            {
                "name": "epoch",
                "axes": axes,
                "fixed": {**CURRICULUM, "task": dict(CURRICULUM["task"])},
            }
        ]
    if part == "g_axis":
        axes = {**axes, "method": ["grpo", "ebpo", "clip_cov"], "group_size": GROUP_SIZES}
        return [{"name": "g", "axes": axes, "fixed": {"prompts_per_step": PROMPTS}}]
    fixed = {"group_size": 4, "task": {"val_per_cell": VAL_PER_CELL}}
    return [
        {
            "name": name,
            "axes": {**axes, "method": methods, "lr": LRS},
            "fixed": {**fixed, **extra},
            "rollouts_per_step": BUDGET,
        }
        for name, methods, extra in (("lr", TUNED, {}), ("dense", DENSE, {"eval_every": 10}))
    ]


def get_config(part: str = "g_axis"):
    if part not in PARTS:
        raise ValueError(f"configs/ablations/paper_axes.py:{part}: part must be one of {PARTS}")
    c = ml_collections.ConfigDict()
    c.name = f"paper_{part}"
    c.base_config = "configs/reasoning.py"
    c.out_dir = f"results/ablations/paper_{part}"
    c.fixed = {k: dict(v) if isinstance(v, dict) else v for k, v in FIXED.items()}
    c.blocks = _blocks(part)
    c.claims_file = CLAIMS_FILES.get(part, CLAIMS_FILE)
    c.commit_warm_starts = True
    c.reuse = []  # fresh runs only
    return c
