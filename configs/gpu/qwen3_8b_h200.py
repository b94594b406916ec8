"""The paper's EBPO recipe on Qwen3-8B for one 8xH200 node (141 GiB each); see qwen3_8b_h100.py.

The H100 layout with the sampler doubled: 128 prompts x 4 samples per call (4 calls per step,
as on the v5p-64), 512 rows of 12288 tokens whose KV cache is 108 GiB per GPU on tp=8, which
the H200's 141 GiB holds beside the resident train state. The update is the H100's (16
micro-batches of 8 prompts, one per GPU): it is bound by FLOPs, which the H200 does not add.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe("qwen3_8b", variant, nodes=1, prompts_per_call=64, microbatches=16)
    )
