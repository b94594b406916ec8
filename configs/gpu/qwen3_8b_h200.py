"""The paper's EBPO recipe on Qwen3-8B for one 8xH200 node (141 GiB each); see qwen3_8b_h100.py.

The H100 layout with the sampler doubled: 64 prompts x 4 samples per call (8 calls per step),
256 rows of 12288 tokens whose KV cache is 54 GiB per GPU on tp=8; with the prefill's
temporaries and the resident train state that is 81.7 of the 134 GiB given to JAX (AOT), so
128 prompts per call (~148 GiB) would not fit. The update is the H100's (16 micro-batches of
8 prompts, one per GPU): it is bound by FLOPs, which the H200 does not add.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe("qwen3_8b", variant, nodes=1, prompts_per_call=64, microbatches=16)
    )
