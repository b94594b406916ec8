"""Grids that test the reasoning claims against a reviewer's objections (issue 32).

`--config=configs/ablations/robust.py:<part>`, part one of
  warm_starts       EBPO vs GRPO at G = 2, 4, 8 (128 responses per step) from 5 SFT warm
                    starts (`sft.seed` 0-4), 3 RL seeds nested under each: the two-level
                    interval (ebpo_jax/ablation/twolevel.py) covers warm-start variation;
  lr_sweep          GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline, EBPO and DAPO at G=4, lr in
                    {1e-5, 3e-5, 1e-4}, 4 seeds, each evaluated on a validation split
                    (`task.val_per_cell`, disjoint from train and test) that picks its best
                    rate; the test split compares them at those rates;
  curriculum_epoch  naive and easy-to-hard orders for GRPO, EBPO and EBPO with per-cell
                    priors at G=4 over exactly one epoch (112 steps x 32 prompts = 3584 of
                    the 3600 training problems: no restart), 7 seeds;
  budget_g8         EBPO vs GRPO at G=8 with 2x and 4x the 200 steps, 4 seeds.
The claims, verdict rule and seed rule are in CLAIMS_FILE, committed before any run of
these grids (`ablate.py` refuses to train them otherwise); every run records its SHA-256.
Seeds are fixed here (SEED_RULE there): run without --power_effect or --seeds.
Warm starts are written content-addressed to `<out_dir>/warm_starts/` (commit them: a
rerun on another CPU family then starts from the same weights).
"""

import ml_collections

CLAIMS_FILE = "configs/ablations/robust_claims.py"
PARTS = ("warm_starts", "lr_sweep", "curriculum_epoch", "budget_g8")
BUDGET = 128  # responses per step, as in configs/ablations/reasoning.py
FIXED = {  # the reasoning grids' schedule
    "total_steps": 200,
    "eval_every": 50,
    "eval_samples": 4,
    "checkpoint_every": 50,
    "keep_checkpoints": 1,
}
WARM_STARTS = [0, 1, 2, 3, 4]
LRS = [1e-5, 3e-5, 1e-4]
SEEDS = {"warm_starts": 3, "lr_sweep": 4, "curriculum_epoch": 7, "budget_g8": 4}
EPOCH_STEPS = 112  # one pass over 9 cells x 400 training problems at 32 prompts per step
VAL_PER_CELL = 20  # as many validation problems as test ones


def _blocks(part: str) -> list[dict]:
    seeds = list(range(SEEDS[part]))
    if part == "warm_starts":
        axes = {"sft.seed": WARM_STARTS, "seed": seeds, "method": ["grpo", "ebpo"]}
        return [
            {"name": "warm", "axes": {**axes, "group_size": [2, 4, 8]}, "rollouts_per_step": BUDGET}
        ]
    if part == "lr_sweep":
        methods = ["grpo", "dr_grpo", "rloo", "rpp", "ebpo", "dapo"]
        return [
            {
                "name": "lr",
                "axes": {"method": methods, "lr": LRS, "seed": seeds},
                "fixed": {"group_size": 4, "task": {"val_per_cell": VAL_PER_CELL}},
                "rollouts_per_step": BUDGET,
            }
        ]
    if part == "curriculum_epoch":
        return [
            {
                "name": "epoch",
                "axes": {
                    "method": ["grpo", "ebpo", "ebpo_cluster"],
                    "order": ["naive", "difficulty"],
                    "seed": seeds,
                },
                "fixed": {
                    "group_size": 4,
                    "prompts_per_step": BUDGET // 4,
                    "total_steps": EPOCH_STEPS,
                    "eval_every": EPOCH_STEPS // 4,
                    "checkpoint_every": EPOCH_STEPS // 2,
                },
            }
        ]
    return [
        {
            "name": "steps",
            "axes": {"method": ["grpo", "ebpo"], "total_steps": [400, 800], "seed": seeds},
            "fixed": {"group_size": 8},
            "rollouts_per_step": BUDGET,
        }
    ]


def get_config(part: str = "warm_starts"):
    if part not in PARTS:
        raise ValueError(f"configs/ablations/robust.py:{part}: part must be one of {PARTS}")
    c = ml_collections.ConfigDict()
    c.name = f"robust_{part}"
    c.base_config = "configs/reasoning.py"
    c.out_dir = f"results/ablations/robust_{part}"
    c.fixed = dict(FIXED)
    c.blocks = _blocks(part)
    c.claims_file = CLAIMS_FILE
    c.commit_warm_starts = part == "warm_starts"
    c.reuse = []  # fresh runs on one machine: no rows of another CPU family mixed in
    return c
