"""Do topic-ordered and easy-to-hard data streams help EBPO (EBPO-topic, EBPO-diff)?

CPU scale: the tiny default on the arithmetic tasks (3 topics x 2 difficulty levels), G=4,
P=32. `naive` shuffles, `topic` streams one topic cluster at a time, `difficulty` goes
easy to hard (the tasks' difficulty field stands in for the base model's pass rate).
GRPO runs the same orders as a control: an order effect seen with both estimators comes
from the data, not from the EB prior.
`--config=configs/ablations/curriculum.py:paper` runs it on configs/qwen3_8b.py (data.order,
with topics from k-means and difficulty from experiments/estimate_difficulty.py).
"""

import ml_collections

from ebpo_jax.ablation.grid import CPU_BASE_CONFIG, CPU_FIXED


def get_config(scale: str = "cpu"):
    c = ml_collections.ConfigDict()
    c.name = "curriculum"
    if scale == "paper":
        c.base_config = "configs/qwen3_8b.py"
        c.out_dir = "results/ablations/curriculum_paper"
        c.fixed = {"total_steps": 300, "eval_every": 50, "group_size": 4}
    else:
        c.base_config = CPU_BASE_CONFIG
        c.out_dir = "results/ablations/curriculum"
        c.fixed = {**CPU_FIXED, "group_size": 4, "prompts_per_step": 32}
    c.blocks = [
        {
            "name": "order",
            "axes": {
                "method": ["grpo", "ebpo"],
                "order": ["naive", "topic", "difficulty"],
                "seed": [0, 1, 2],
            },
        }
    ]
    return c
