"""The paper's EBPO recipe on Qwen3-14B over two 8xH100-80GB nodes; see qwen3_8b_h100.py.

qwen3_8b_h100.py's layout (and launch) on 16 GPUs:
- Mesh: pure FSDP over all 16 GPUs: the train state (~29 GiB per GPU on one node) halves, and
  so does the resident state beside the sampler. Each layer's weights are all-gathered across
  the nodes (InfiniBand); at 16 prompts per micro-batch a layer's forward and backward take
  several times longer than its all-gather.
- Micro-batches 8: 16 prompts each, one prompt and its 4 completions per GPU.
- Sampler: 256 prompts x 4 samples per call (2 calls per step) on data=2 x tp=8: each node
  samples its own 512 rows, all at once on the paged engine, with tensor parallelism inside
  its NVLink domain. Prefill + the resident train state (13.8 GiB per GPU) compile to 56.5
  of 76 GiB; 512 prompts per call would put 256 on a node, whose prefill alone compiles to
  81.9 GiB (configs/gpu/qwen3_14b_h200.py).
- Pages: kv_pages 12288 per node (one data shard each), 30 GiB per GPU at 2.5 MiB a page
  (qwen3_14b_h100.py), about 2.8x the 4.3k pages the busier node's 512 rows hold at once at
  the README's length distribution (`step_estimate.paged`); decode + the train state compile
  to 57.5 of 76 GiB.

Launch: one process per GPU on both nodes (16 processes), node 0's address as coordinator:
  # on node n (0 or 1), for i in 0..7:
  CUDA_VISIBLE_DEVICES=$i XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
  JAX_COORDINATOR_ADDRESS=<node0>:12345 JAX_NUM_PROCESSES=16 JAX_PROCESS_ID=$((8 * n + i)) \
    python experiments/train.py --config=configs/gpu/qwen3_14b_2x8xh100.py
(or one process per node seeing its 8 GPUs: JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=n).
"""

from ebpo_jax.config import finalize, load_sibling


def _node():
    return load_sibling(__file__, "qwen3_8b_h100.py")


def get_config(variant=None):
    return finalize(
        _node().node_recipe(
            "qwen3_14b", variant, nodes=2, prompts_per_call=256, microbatches=8, kv_pages=12288
        )
    )
