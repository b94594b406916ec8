"""A seconds-scale grid for tests and smoke runs: 2 methods x 2 group sizes, micro policy."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.name = "micro"
    c.base_config = "configs/micro.py"
    c.out_dir = "runs/ablations/micro"
    c.fixed = {"total_steps": 2, "eval_every": 2, "checkpoint_every": 2}
    c.blocks = [
        {
            "name": "main",
            "axes": {"method": ["grpo", "ebpo"], "group_size": [2, 4], "seed": [0]},
            "rollouts_per_step": 8,
        }
    ]
    return c
