"""The paper's EBPO recipe on Qwen3-14B for one 8xH200 node (141 GiB each); see qwen3_8b_h100.py.

qwen3_14b_h100.py's layout (FSDP update, 16 micro-batches of 8 prompts, cuDNN attention) with
the sampler widened to what the H200 holds: the train state stays resident while sampling
(27.5 GiB per GPU) and the prompt cache plus prefill temporaries grow by about 1.4 GiB per
prompt on tp=8 (AOT on 8xH100: 22.1 GiB of prefill for 16 prompts), so 64 prompts x 4 samples
per call (8 calls per step) need about 116 of the 134 GiB the config gives JAX. The update is
bound by FLOPs, which the H200 does not add over the H100, so it is the H100's.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(_node().node_recipe("qwen3_14b", variant, prompts_per_call=64))
