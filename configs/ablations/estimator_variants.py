"""Which EBPO variant: the paper's carried prior, the released code's per-batch statistics,
per-cluster priors, or a forgetting factor? GRPO as the reference, at G=2 (where the
prior matters most; the group_size grid covers larger G).

CPU scale: the tiny default on the arithmetic tasks, 128 responses per step.
`--config=configs/ablations/estimator_variants.py:paper` runs it on configs/qwen3_8b.py.
"""

import ml_collections

from ebpo_jax.ablation.grid import CPU_BASE_CONFIG, CPU_FIXED


def get_config(scale: str = "cpu"):
    c = ml_collections.ConfigDict()
    c.name = "estimator_variants"
    if scale == "paper":
        c.base_config = "configs/qwen3_8b.py"
        c.out_dir = "results/ablations/estimator_variants_paper"
        c.fixed = {"total_steps": 300, "eval_every": 50}
        budget, groups = 2048, [4, 8]
        cluster = "ebpo_topic"  # math data: one prior per topic (no difficulty levels)
    else:
        c.base_config = CPU_BASE_CONFIG
        c.out_dir = "results/ablations/estimator_variants"
        c.fixed = dict(CPU_FIXED)
        budget, groups = 128, [2]
        cluster = "ebpo_cluster"  # one prior per (topic, difficulty) cell
    c.blocks = [
        {
            "name": "variant",
            "axes": {
                "method": ["grpo", "ebpo", "ebpo_per_batch", cluster, "ebpo_forget"],
                "group_size": groups,
                "seed": [0, 1, 2],
            },
            "rollouts_per_step": budget,
        }
    ]
    return c
