"""A seconds-scale config for tests and smoke runs: tiny model, few steps, no warm start.

`configs/micro.py:dapo` is DAPO's recipe (ebpo_jax.ablation.grid.METHODS["dapo"]: GRPO
advantages, dynamic sampling, clip-high 0.28), on the synthetic task or with `data.path`.
`:aot` (the pod configs' variant without data or checkpoint paths) is micro itself.
"""

from ebpo_jax.config import ConfigError, default_config, finalize


def get_config(variant=None):
    words = {w.strip() for w in (variant or "").split(",") if w.strip()}
    if words - {"dapo", "aot"}:
        raise ConfigError(f"configs/micro.py:{variant}: the variants are 'dapo' and 'aot'")
    c = default_config()
    c.workdir = "runs/micro"
    c.total_steps = 4
    c.prompts_per_step = 4
    c.group_size = 4
    c.checkpoint_every = 2
    c.eval_every = 2
    c.eval_batch_size = 32
    c.model.preset = "tiny"
    c.model.overrides.hidden_size = 32
    c.model.overrides.intermediate_size = 64
    c.model.overrides.num_layers = 1
    c.model.overrides.num_heads = 2
    c.model.overrides.num_kv_heads = 1
    c.model.overrides.head_dim = 16
    c.model.overrides.max_position_embeddings = 32
    c.model.overrides.dtype = "float32"  # so --config.model.overrides.dtype=bfloat16 can set it
    c.task.topics = "addition,comparison"
    c.task.max_difficulty = 1
    c.task.train_per_cell = 50
    c.task.test_per_cell = 8
    c.sampler.max_new_tokens = 4
    c.optimizer.learning_rate = 1e-3
    c.sft.steps = 0
    if "dapo" in words:
        from ebpo_jax.ablation import grid

        run = grid.Run("dapo", (), tuple(grid.METHODS["dapo"].items()))
        c = grid.run_config(c, run, c.workdir)
    return finalize(c)
