"""The paper's EBPO recipe on Qwen3-8B with 32k-token responses: context parallelism on v5p-64.

configs/qwen3_8b.py's recipe (G=4, 512 prompts per step, mini-batch 128, lr 1e-6, KL 0.001
k3, clip 0.2, ...; explained there) with prompts of up to 2048 tokens and responses of up to
32768 (Qwen3's thinking budget), a 34816-token row. What changes, and why:
- Mesh fsdp=4 x context=8 over the 32 chips: each row's tokens are split over 8 chips
  (4352 per chip, a third of the 12k config's 12288), four rows side by side. The weights
  and Adam moments are sharded over both axes (`embed` -> fsdp x context, as MaxText folds
  its context axis into FSDP), so the resident state stays ~4 GB per chip.
- Attention "xla" with all-gathered keys and values per layer (models/attention.py): the
  packed rows are in zig-zag order (chunks i and 15-i of 16 on context shard i), which
  splash cannot mask (it orders keys by array position); the gather moves the same bytes
  as a ring (docs/pods.md, "Long context").
- Packed update: micro-batches of 4 rows x 34816 tokens (one row per fsdp shard); the
  planner fills rows with shorter sequences of the same group, so most rows hold several.
- Sampler: the 12k config's data=4 x tp=8 paged layout with `sampler.slots` bounding the
  rows live at once, so a shard's pages hold its live rows at their longest; see
  `SLOTS` and `KV_PAGES` below (chosen with the step estimate, docs/pods.md).
`--config=configs/qwen3_8b_32k.py:aot` is the same without data or checkpoint paths; check
the layout from a CPU host with
  python experiments/aot_compile.py --config=configs/qwen3_8b_32k.py:aot --topology=v5p-64 \
      --prompt_len=2048 [--estimate_only]
"""

from ebpo_jax.config import finalize, load_sibling

PROMPT_LEN, RESPONSE_LEN = 2048, 32768
ROW_LEN = PROMPT_LEN + RESPONSE_LEN  # 34816 = 16 zig-zag chunks of 2176
CONTEXT, FSDP = 8, 4  # v5p-64: 32 chips
# Rows live at once: 15 per row shard of data=4 x tp=8 (dp attention). The estimate at the
# stated lengths (mean response 10000 tokens, 5% at 32768) peaks at 2015 of the 2048 pages
# per shard; 512 slots would peak at 2187 (docs/pods.md, "Long context").
SLOTS = 480
KV_PAGES = 32 * 2048  # 2048 pages of 128 tokens per row shard (36 GiB per chip), as qwen3_8b


def _rules():
    """DEFAULT_RULES with the weights' `embed` dim sharded over fsdp and context."""
    from ebpo_jax.sharding import DEFAULT_RULES

    return tuple((n, ("fsdp", "context") if n == "embed" else a) for n, a in DEFAULT_RULES)


def get_config(variant=None):
    c = load_sibling(__file__, "qwen3_8b.py").recipe("qwen3_8b", variant)
    c.workdir = "runs/qwen3_8b_32k"
    c.data.max_prompt_len = PROMPT_LEN
    c.sampler.max_new_tokens = RESPONSE_LEN
    c.sampler.slots = SLOTS
    c.sampler.kv_pages = KV_PAGES
    c.model.overrides.attention = "xla"
    c.model.overrides.sharding_rules = _rules()
    c.loss.num_microbatches = 1  # packed: the token budget sets the micro-batches
    c.loss.tokens_per_microbatch = FSDP * ROW_LEN
    c.loss.pack_row_len = ROW_LEN
    c.mesh.shape, c.mesh.axes = (FSDP, CONTEXT), ("fsdp", "context")
    return finalize(c)
