"""The paper's EBPO recipe on Qwen3-14B with LoRA rank 32, for a v5p-16 slice (8 chips).

As configs/qwen3_8b_lora_v5p8.py (whose comment block explains every choice), on 8 chips:
FSDP over 8, one 12288-token row per chip per micro-batch (64 micro-batches of 2 prompts),
and the sampler at 128 prompts x 4 samples per call (4 calls per step) through 64 slots on
data=2 x tp=4.
"""

from ebpo_jax.config import finalize, load_sibling


def _lora_8b():
    return load_sibling(__file__, "qwen3_8b_lora_v5p8.py")


def get_config(variant=None):
    return finalize(_lora_8b().lora_recipe("qwen3_14b", variant, chips=8, data_shards=2))
