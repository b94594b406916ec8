"""Does EBPO beat GRPO / Dr. GRPO / DAPO at small group sizes, and does the gap close by G=16?

Blocks (CPU scale, the tiny default's warm-started policy on the arithmetic tasks):
  budget   method x G at equal sample budget: P x G = 128 responses per step for every G;
  prompts  grpo vs ebpo at equal prompts (P = 16, so G=16 generates 8x the responses of G=2);
  lr       a learning-rate sweep at G=4 for grpo and ebpo; with the rpp control in `budget`
           (batch-standardised group-mean baseline) it separates the shrunk baseline from
           the change of step size (EBPO standardises over the batch, GRPO per group).
`--config=configs/ablations/group_size.py:paper` is the same grid on configs/qwen3_8b.py.
"""

import ml_collections

from ebpo_jax.ablation.grid import CPU_BASE_CONFIG, CPU_FIXED

METHODS = ["grpo", "dr_grpo", "dapo", "ebpo", "rpp"]


def get_config(scale: str = "cpu"):
    c = ml_collections.ConfigDict()
    c.name = "group_size"
    seeds = [0, 1, 2]
    if scale == "paper":
        c.base_config = "configs/qwen3_8b.py"
        c.out_dir = "results/ablations/group_size_paper"
        c.fixed = {"total_steps": 300, "eval_every": 50}
        budget, groups, lrs = 2048, [2, 4, 8, 16, 32], [5e-7, 2e-6]
        # DAPO's dynamic sampling refills inside the jitted rollout, which needs a jittable
        # reward; math-verify runs on the host, so DAPO is left out at paper scale for now.
        methods = [m for m in METHODS if m != "dapo"]
    else:
        c.base_config = CPU_BASE_CONFIG
        c.out_dir = "results/ablations/group_size"
        c.fixed = dict(CPU_FIXED)
        budget, groups, lrs = 128, [2, 4, 8, 16], [2.5e-4, 1e-3]
        methods = METHODS
    c.blocks = [
        {
            "name": "budget",
            "axes": {"method": methods, "group_size": groups, "seed": seeds},
            "rollouts_per_step": budget,
        },
        {
            "name": "prompts",
            "axes": {"method": ["grpo", "ebpo"], "group_size": groups, "seed": seeds},
            "fixed": {"prompts_per_step": budget // 8},
        },
        {
            "name": "lr",
            "axes": {"method": ["grpo", "ebpo"], "lr": lrs, "seed": seeds},
            "fixed": {"group_size": 4},
            "rollouts_per_step": budget,
        },
    ]
    return c
