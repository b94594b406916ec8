"""The paper's EBPO recipe on LLaMA-3.1-8B for one 8xH200 node; see qwen3_8b_h200.py.

qwen3_8b_h200.py's layout, explained there and in qwen3_8b_h100.py: the H100 update, 256
prompts x 4 samples per sampler call on tp=8 (2 calls per step), all 1024 rows at once on the
paged engine, kv_pages 36864 (72 GiB per GPU at LLaMA's 2 MiB a page, llama3_8b_h100.py),
about 4x the 8.3k pages the 1024 rows hold at once at the README's length distribution
(`step_estimate.paged`). Decode + the resident train state compile to 105.5 of 134 GiB,
prefill + train state to 79.9; 512 prompts per call would need about twice the prefill's
64.9 GiB (not compiled).
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe(
            "llama3_1_8b", variant, nodes=1, prompts_per_call=256, microbatches=16, kv_pages=36864
        )
    )
