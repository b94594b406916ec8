"""The paper's EBPO recipe on Qwen3-8B for one 8xH100-80GB node (configs/qwen3_8b.py's recipe).

The recipe (G=4, 512 prompts per step, mini-batch 128, lr 1e-6, KL 0.001 k3, 4096 + 8192
tokens, ...) is qwen3_8b.py's, explained there; only the layout differs:
- attention "cudnn": cuDNN flash attention through jax.nn.dot_product_attention (never the
  [T, T] scores; 18 GiB per row and layer with the XLA path). Unlike splash it also runs
  forward_grouped, so the update runs each prompt once per group of 4, not 4 times.
  bfloat16 compute, as cuDNN requires.
- Mesh: pure FSDP over the 8 GPUs (NVLink). float32 params, Adam moments and the reference
  are ~130 GB for 8B, 16 GiB per GPU; tensor parallelism would split activations too, but
  costs an all-reduce per layer and buys nothing while rows fit.
- Micro-batches 16: a 128-prompt mini-batch in micro-batches of 8 prompts (one prompt and its
  4 completions, 4096 + 4 x 8192 tokens, per GPU). Prompts per micro-batch must divide over
  the 8 GPUs, so 16 is the most; fewer, larger micro-batches only add activation memory.
- Remat "full": each layer keeps only its input (36 layers x 36864 tokens x 4096 x bf16 =
  10 GiB per GPU); saving matmul outputs would hold several times that.
- logits_chunk 1024: the head's [1024, 152k] float32 logits are 0.6 GiB per completion row at
  a time instead of 4.6 GiB for all 8192 positions.
- Sampler: 128 prompts x 4 samples per call (4 calls per step) on tp=8, every row of a call
  at once on the paged engine (qwen3_8b.py's pages of 128 tokens); 256 per call would not
  fit beside the train state (the H200's prefill alone is 67.9 GiB at 256). tp=8 puts one kv head per
  GPU and splits the bf16 weights 8 ways (2 GiB per GPU, read once per decoded token);
  data=8 would replicate all 16 GiB on every GPU. tp's all-reduces stay inside NVLink.
- Pages: `kv_pages` per node (one data shard), 12288 here: 27 GiB per GPU for Qwen3-8B
  (128 tokens x 36 layers x 1 kv head x 2 x 128 x 2 bytes = 2.25 MiB a page), about 3x the
  pages 512 rows hold at once at the README's length distribution (`step_estimate.paged`);
  decode + the resident train state (15 GiB per GPU) compile to 53.5 of 76 GiB, leaving room
  for what a compile without a device does not count (cuDNN workspace, NCCL buffers).
  Every GPU config passes its own prompts per call and pool to `node_recipe`.
- sampler.attention "xla": the gather path reads each row's live pages only; the Triton
  paged kernel (kernels/paged_gpu.py) wants head-major pools and transposes the whole pool
  at every layer of every step (configs/gpu/qwen3_8b_h200.py has the compiled comparison).
- XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the launch line below; the AOT budget assumes it):
  JAX's default 0.75 would leave 20 GiB of every GPU unused.

Launch, one process per GPU (`ebpo_jax.runtime.distributed.initialize()` reads these), on the node:
  for i in $(seq 0 7); do
    CUDA_VISIBLE_DEVICES=$i XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 JAX_NUM_PROCESSES=8 JAX_PROCESS_ID=$i \
      python experiments/train.py --config=configs/gpu/qwen3_8b_h100.py &
  done; wait
or one process that sees all 8 GPUs (no JAX_* variables):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/train.py --config=configs/gpu/qwen3_8b_h100.py
Check the fit from a CPU host first (`pip install -e '.[gpu-aot]'` in a venv of its own):
  python experiments/aot_compile.py --config=configs/gpu/qwen3_8b_h100.py:aot --topology=8xH100
"""

from ebpo_jax.config import finalize, load_sibling

PRESET = "qwen3_8b"


def node_recipe(
    preset, variant=None, *, nodes=1, prompts_per_call=32, microbatches=16, kv_pages=4096
):
    """qwen3_8b.py's recipe for `preset` on `nodes` nodes of 8 GPUs, `kv_pages` per node."""
    c = load_sibling(__file__, "../qwen3_8b.py").recipe(preset, variant)
    c.model.overrides.attention = "cudnn"
    c.mesh.shape = (-1,)
    c.mesh.axes = ("fsdp",)
    c.loss.num_microbatches = microbatches
    c.sampler.prompts_per_call = prompts_per_call
    c.sampler.mesh = f"data={nodes},tp=8"
    if c.rollout.max_turns == 1:  # kept-KV turns reserve each row's episode instead of a pool
        c.sampler.kv_pages = nodes * kv_pages  # one data shard per node
    c.sampler.attention = "xla"
    return c


def get_config(variant=None):
    return finalize(node_recipe(PRESET, variant, prompts_per_call=128, kv_pages=12288))
