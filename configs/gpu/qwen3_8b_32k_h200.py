"""The 32k-token Qwen3-8B recipe (configs/qwen3_8b_32k.py) on one 8xH200 node (141 GiB each).

configs/qwen3_8b_32k.py explains the recipe and its context parallelism; what the node changes:
- Mesh fsdp=1 x context=8: each 34816-token row is split over the 8 GPUs (4352 tokens per
  GPU, as on v5p-64), one row per micro-batch; the weights and Adam moments are sharded 8
  ways over `context` (the 32k config's rules fold it into FSDP), ~15 GiB per GPU.
- Attention "xla" with all-gathered keys and values over NVLink: zig-zag rows need causality
  by slot, which neither cuDNN's nor splash's masks express.
- Sampler: the GPU nodes' tp=8 layout (configs/gpu/qwen3_8b_h100.py) with the 32k config's
  pages of 128 tokens. The pool is the 8k H200 config's 36864 pages (81 GiB per GPU at 2.25
  MiB a page); `SLOTS` bounds the rows live at once so the pool holds them at their longest
  (chosen with `aot_compile.py --estimate_only`, lengths scaled as in the 32k config).
Check the fit from a CPU host, in the GPU venv (docs/pods.md):
  python experiments/aot_compile.py --config=configs/gpu/qwen3_8b_32k_h200.py:aot \
      --topology=8xH200 --prompt_len=2048
"""

from ebpo_jax.config import finalize, load_sibling

CONTEXT = 8
SLOTS = 256
KV_PAGES = 36864
PROMPTS_PER_CALL = 128


def get_config(variant=None):
    long = load_sibling(__file__, "../qwen3_8b_32k.py")
    c = long.get_config(variant)
    c.mesh.shape, c.mesh.axes = (1, CONTEXT), ("fsdp", "context")
    c.loss.tokens_per_microbatch = long.ROW_LEN  # one row per micro-batch (fsdp=1)
    c.sampler.mesh = "data=1,tp=8"
    c.sampler.dp_attention = False
    c.sampler.prompts_per_call = PROMPTS_PER_CALL
    c.sampler.slots = SLOTS
    c.sampler.kv_pages = KV_PAGES
    c.sampler.attention = "xla"
    return finalize(c)
