"""The paper's EBPO recipe on Qwen3-30B-A3B (mixture of experts) for a v5p-64 slice (32 chips).

Only the model and what a mixture of experts changes differ from qwen3_8b.py, whose comment
block explains every other number (G=4, 512 prompts, 12288-token rows, splash attention,
full remat, chunked log-probs, the paged sampler on a data=16 x tp=2 mesh). What differs:
- Model: 48 layers, every one sparse, 128 experts of width 768, top-8 with renormalised
  weights (HF's Qwen3-30B-A3B config.json); 30.5B parameters, 3.3B active per token.
- Experts: stored split over the `fsdp` axis (the `expert` rule), 4 of the 128 per chip on
  fsdp=32; each device sorts its own rows and runs them through the experts gathered at
  the dispatch's shard_map (models/moe.py), as FSDP gathers a dense layer. In the sampler
  (no fsdp axis) the experts are replicated over `data` and their hidden dim split over `tp`;
  the `int8` variant splits them over its 8 data shards too (sampler.expert_parallel, 16
  experts a shard): a decode step reads 1/8 of the expert weights, and each MoE layer
  all-gathers the step's tokens and reduce-scatters the outputs over `data` instead.
- Sampler pool: 1536 pages of 128 tokens per data shard (qwen3_8b.py's SAMPLER_LAYOUT, 9 GiB per
  chip), as the bf16 weights take 28.5 GiB per chip on tp=2. AOT for v5p-64
  (results/aot_tpu/qwen3_30b_a3b_v5p64.json, docs/moe.md): decode 74.6 GiB per chip, 88.8
  with the train state resident; 2048 pages compiled to 98.3, over the 95. The estimated
  peak is 1269 pages per shard. With 4 kv heads, tp=2 leaves 4 combined K/V heads per
  chip, the layout docs/pods.md says the compiled decode converts around the kernel: the
  decode's temporaries grew ~3x the pool's bytes between 1536 and 2048 pages.
- Grouped matmuls: `moe_impl="auto"`, the Pallas megablox kernel when compiling for TPU.
- Memory: float32 master weights + Adam + the reference are ~490 GB, ~15 GB per chip.
- Router: no load-balancing loss (`model.moe.lb_coef` 0, as RL recipes do for a pretrained
  router); routing replay off by default (`model.moe.routing_replay`).
The variants (`:paper`, `:authors`, `:aot`) are qwen3_8b.py's; the checkpoint folder a
placeholder (`--config.model.hf_path=/ckpt/Qwen3-30B-A3B`).
"""

from ebpo_jax.config import finalize, load_sibling

PRESET = "qwen3_30b_a3b"


def get_config(variant=None):
    c = load_sibling(__file__, "qwen3_8b.py").recipe(PRESET, variant)
    c.model.overrides.moe_impl = "auto"
    return finalize(c)
