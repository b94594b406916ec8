"""The paper's EBPO recipe on LLaMA-3.1-8B for one 8xH200 node; see qwen3_8b_h200.py.

qwen3_8b_h200.py's layout (64 prompts x 4 samples per sampler call on tp=8, the H100
update), explained there and in qwen3_8b_h100.py.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe("llama3_1_8b", variant, nodes=1, prompts_per_call=64, microbatches=16)
    )
