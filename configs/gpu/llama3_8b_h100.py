"""The paper's EBPO recipe on LLaMA-3.1-8B for one 8xH100-80GB node; see qwen3_8b_h100.py.

Same layout as qwen3_8b_h100.py, whose comment block explains every number (and the launch):
FSDP over 8 GPUs, cuDNN attention, 16 micro-batches of 8 prompts, full remat, 128 prompts x 4
samples per sampler call on tp=8 (4 calls per step), every row of a call at once on the paged
engine. LLaMA-3.1-8B has 32 layers (Qwen3-8B 36) and a 128k vocabulary, so a page is 2 MiB
per GPU (128 tokens x 32 layers x 1 kv head x 2 x 128 x 2 bytes) and its activations are a
little smaller. kv_pages 12288 (24 GiB per GPU) is about 3x the pages 512 rows hold at once
at the README's length distribution (`step_estimate.paged`); decode + the resident train
state compile to 49.2 of 76 GiB, prefill + train state to 48.4. 256 prompts per call would
not fit beside the train state (prefill alone compiles to 64.9 GiB at 256 on 8xH200).
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe(
            "llama3_1_8b", variant, nodes=1, prompts_per_call=128, microbatches=16, kv_pages=12288
        )
    )
