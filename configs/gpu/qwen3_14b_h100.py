"""The paper's EBPO recipe on Qwen3-14B for one 8xH100-80GB node; see qwen3_8b_h100.py.

qwen3_8b_h100.py's layout, explained there. 14.8B float32 params, Adam moments and the
reference are ~29 GiB per GPU over 8 GPUs, and 40 layers of 5120 keep ~14 GiB of layer inputs
per micro-batch of 8 prompts under full remat: the update fits one node (AOT: 64.9 of 76 GiB
per GPU). The sampler takes 16 prompts x 4 samples per call (32 calls per step): the KV cache
is 1.9 GiB per 12288-token row and the resident train state is 27.5 GiB per GPU (AOT: prefill
+ state 49.6 GiB, so 32 prompts per call, ~72 GiB, is the next step to try on a real node).
configs/gpu/qwen3_14b_2x8xh100.py spreads the same run over two nodes for twice the FLOP/s.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(_node().node_recipe("qwen3_14b", variant, prompts_per_call=16))
