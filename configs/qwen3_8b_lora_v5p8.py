"""The paper's EBPO recipe on Qwen3-8B with LoRA, for a v5p-8 slice (4 chips, 95 GiB each).

Everything not listed here is configs/qwen3_8b.py's recipe (its comment block explains it).
- LoRA rank 32 on all seven projections (q, k, v, o, gate, up, down): reports of RL with
  LoRA at rank >= 32 match full fine-tuning on math RLVR. alpha 64 (scale 2).
- lr 1e-5: LoRA's best learning rate is about 10x full fine-tuning's (1e-6 in the paper).
- The frozen base in bfloat16 (no float32 master copy: it never moves); adapters and their
  Adam moments in float32. The KL reference is the base with the adapters off.
- Mesh: FSDP over the 4 chips. One 12288-token row per chip per micro-batch: a mini-batch
  of 128 prompts x 4 samples is 128 micro-batches of one prompt's 4 rows.
- Sampler: 64 prompts x 4 samples per call (8 calls per step) through 32 continuous-batching
  slots on tp=4: the merged bf16 weights split over the 4 chips, and per chip the same cache
  shapes as one data shard of configs/qwen3_8b.py's v5p-64 sampler (64 prompts of 4096
  tokens, 32 slots of 12288), which fits there.
`:aot` is the same without data or checkpoint paths (experiments/aot_compile.py).
"""

from ebpo_jax.config import finalize, load_sibling


def _qwen3_8b():
    return load_sibling(__file__, "qwen3_8b.py")


def lora_recipe(preset, variant, *, chips: int, data_shards: int):
    """The paper's recipe with LoRA rank 32 on `chips` chips (shared with the 14B config);
    the sampler on data=`data_shards` x tp=4, 64 prompts and 32 slots per data shard."""
    c = _qwen3_8b().recipe(preset, variant)
    c.workdir = f"runs/{preset}_lora"
    c.model.overrides.param_dtype = "bfloat16"  # the frozen base; adapters are float32
    c.model.lora.rank = 32
    c.model.lora.alpha = 64.0
    c.model.lora.targets = "q,k,v,o,gate,up,down"
    c.model.lora.base_dtype = ""
    c.optimizer.learning_rate = 1e-5
    # One prompt's G=4 rows per micro-batch row-group: rows / chips = 1 row per chip.
    c.loss.num_microbatches = c.prompts_per_step // c.loss.num_minibatches * 4 // chips
    c.sampler.prompts_per_call = 64 * data_shards
    if c.rollout.max_turns == 1:  # kept-KV turns run every row of a call at once
        c.sampler.slots = 32 * data_shards
    c.sampler.mesh = f"data={data_shards},tp=4"
    return c


def get_config(variant=None):
    return finalize(lora_recipe("qwen3_8b", variant, chips=4, data_shards=1))
