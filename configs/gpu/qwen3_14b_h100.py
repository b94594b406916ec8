"""The paper's EBPO recipe on Qwen3-14B for one 8xH100-80GB node; see qwen3_8b_h100.py.

qwen3_8b_h100.py's layout, explained there. 14.8B float32 params, Adam moments and the
reference are ~29 GiB per GPU over 8 GPUs, and 40 layers of 5120 keep ~14 GiB of layer inputs
per micro-batch of 8 prompts under full remat: the update fits one node (AOT: 64.9 of 76 GiB
per GPU). The sampler stays resident beside the 27.5 GiB train state:
- 64 prompts x 4 samples per call (8 calls per step), all 256 rows at once on the paged
  engine. Prefill compiles to 23.1 GiB (50.6 with the train state); 128 prompts per call
  compiled to 70.2 GiB of prefill + train state (71.3 with decode on 12288 pages), too
  little room for what a compile without a device does not count.
- kv_pages 6144: 15 GiB per GPU (128 tokens x 40 layers x 1 kv head x 2 x 128 x 2 bytes =
  2.5 MiB a page), about 3x the pages 256 rows hold at once at the README's length
  distribution (`step_estimate.paged`); decode + the train state compile to 51.1 of 76 GiB.
configs/gpu/qwen3_14b_2x8xh100.py spreads the same run over two nodes for twice the FLOP/s.
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(_node().node_recipe("qwen3_14b", variant, prompts_per_call=64, kv_pages=6144))
