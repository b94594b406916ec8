"""The paper's EBPO recipe on LLaMA-3.1-8B for one 8xH100-80GB node; see qwen3_8b_h100.py.

Same layout as qwen3_8b_h100.py, whose comment block explains every number (and the launch):
FSDP over 8 GPUs, cuDNN attention, 16 micro-batches of 8 prompts, full remat, 64 prompts x 4
samples per sampler call on tp=8. LLaMA-3.1-8B has 32 layers (Qwen3-8B 36) and a 128k
vocabulary, so its KV cache (1.5 GiB per 12288-token row) and activations are a little smaller.
"""

import importlib.util
import os

from ebpo_jax.config import finalize


def _node():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_8b_h100.py")
    spec = importlib.util.spec_from_file_location("qwen3_8b_h100_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(variant=None):
    return finalize(
        _node().node_recipe("llama3_1_8b", variant, nodes=1, prompts_per_call=32, microbatches=16)
    )
