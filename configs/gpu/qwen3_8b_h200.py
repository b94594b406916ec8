"""The paper's EBPO recipe on Qwen3-8B for one 8xH200 node (141 GiB each); see qwen3_8b_h100.py.

The H100 layout with the paged sampler's pool and calls sized for the H200's 134 GiB (given
to JAX, AOT):
- 256 prompts x 4 samples per call (2 calls per step), all 1024 rows at once (slots 0):
  with every row at once a call takes as many decode steps as its longest row, so fewer,
  larger calls read the weights fewer times. Prefill pages every prompt at the 4096-token
  padded width (18 GiB per GPU for 256 prompts, held through the call's decode) plus 48
  GiB of temporaries; 512 prompts per call would need about twice both (not compiled),
  beside the 15 GiB resident train state.
- kv_pages 36864 (one data shard): 81 GiB per GPU at 2.25 MiB a page (see qwen3_8b_h100.py),
  about 4x the 8.3k pages the 1024 rows hold at once at the README's length distribution
  (`step_estimate.paged`), so a long tail seldom preempts. Decode compiles to the pool plus
  the prompt pages and weights; with the train state resident that leaves ~17 GiB for what
  a compile without a device does not count (cuDNN workspace, NCCL buffers).
- attention "xla" (qwen3_8b_h100.py): compiled for 8xH200 at this layout, the Triton kernel
  needs 1.8 GiB more temporaries and, at every decode step, a pass per layer that reads the
  layer's whole pool and writes its K and V halves (2x the pool, 162 GiB a step); the XLA
  path gathers the rows' live pages only.
The update is the H100's (16 micro-batches of 8 prompts, one per GPU): it is bound by FLOPs,
which the H200 does not add.
"""

from ebpo_jax.config import finalize, load_sibling

PROMPTS_PER_CALL = 256
KV_PAGES = 36864


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe(
            "qwen3_8b",
            variant,
            nodes=1,
            prompts_per_call=PROMPTS_PER_CALL,
            microbatches=16,
            kv_pages=KV_PAGES,
        )
    )
