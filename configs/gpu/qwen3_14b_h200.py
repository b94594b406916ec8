"""The paper's EBPO recipe on Qwen3-14B for one 8xH200 node (141 GiB each); see qwen3_8b_h100.py.

qwen3_14b_h100.py's layout (FSDP update, 16 micro-batches of 8 prompts, cuDNN attention) with
the sampler widened to what the H200 holds beside the resident train state (27.5 GiB per GPU):
- 256 prompts x 4 samples per call (2 calls per step), all 1024 rows at once on the paged
  engine (qwen3_8b_h200.py: fewer, larger calls read the weights fewer times). Prefill pages
  every prompt at the 4096-token padded width (20 GiB per GPU) plus 58.5 GiB of temporaries:
  109.5 of 134 GiB with the train state, so 512 prompts per call would not fit.
- kv_pages 24576: 60 GiB per GPU at 2.5 MiB a page (qwen3_14b_h100.py), about 3x the 8.3k
  pages the 1024 rows hold at once at the README's length distribution
  (`step_estimate.paged`); decode + the train state compile to 111.6 of 134 GiB.
The update is bound by FLOPs, which the H200 does not add over the H100, so it is the H100's.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(_node().node_recipe("qwen3_14b", variant, prompts_per_call=256, kv_pages=24576))
