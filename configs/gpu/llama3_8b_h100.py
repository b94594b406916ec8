"""The paper's EBPO recipe on LLaMA-3.1-8B for one 8xH100-80GB node; see qwen3_8b_h100.py.

Same layout as qwen3_8b_h100.py, whose comment block explains every number (and the launch):
FSDP over 8 GPUs, cuDNN attention, 16 micro-batches of 8 prompts, full remat, 64 prompts x 4
samples per sampler call on tp=8. LLaMA-3.1-8B has 32 layers (Qwen3-8B 36) and a 128k
vocabulary, so its KV cache (1.5 GiB per 12288-token row) and activations are a little smaller.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe("llama3_1_8b", variant, nodes=1, prompts_per_call=32, microbatches=16)
    )
