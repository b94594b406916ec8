"""The paper's EBPO recipe on Qwen3-8B, laid out for a v5p-64 slice (32 chips, 95 GiB each).

How each number was chosen:
- Recipe (PAPER.md, the authors' verl `ebpo` recipe): G=4, 512 prompts per step, PPO
  mini-batch 128 prompts (so 4 mini-batches, one epoch), lr 1e-6 constant, weight decay 0.01,
  KL loss 0.001 with k3 ("low_var_kl"), token-mean aggregation, clip 0.2 both sides,
  temperature 1.0 / top-p 1.0, responses up to 8192 tokens after prompts of up to 4096
  (a 12288-token padded row; pass `--prompt_len=4096` to aot_compile), grad clip 1.0 (verl).
- total_steps: the paper does not state it; 340 steps is ~10 passes over DAPO-Math-17k
  (17.4k prompts / 512 per step = 34 steps per pass).
- Data: DAPO-Math-17k with the authors' 10 MiniLM k-means topics, written once by
  `experiments/cluster_topics.py --data=data/dapo_math_17k.parquet --schema=dapo
  --out=data/dapo_math_17k_topics.jsonl` (identical on every host and across resumes),
  streamed topic by topic (EBPO-topic) with one global prior, as the paper. eval/pass@1
  during training averages MATH-500, AIME24/25, AMC23 and OlympiadBench at `eval_samples`
  samples (experiments/eval.py gives the paper's 16-sample numbers with intervals).
  The data/ and checkpoints/ paths are placeholders (relative to the working directory):
  put the files there or override, e.g. `--config.model.hf_path=/ckpt/Qwen3-8B`.
  `--config=configs/qwen3_8b.py:aot` is the same recipe without data or checkpoint paths
  (the synthetic tasks), for experiments/aot_compile.py on a host without them;
  `:int8` (e.g. `:aot,int8`) samples from int8 KV pages and int8 weights (INT8_LAYOUT).
- Estimator, two named variants (`--config=configs/qwen3_8b.py:paper`, the default, or
  `:authors`; either combines with aot, e.g. `:authors,aot`):
  `paper` is the method as the paper describes it: Welford statistics carried across steps,
  mu_glob the running mean of all rewards. `authors` is the authors' released code, which
  re-creates the statistics every batch and takes mu_glob as the mean of the group means
  (`estimator_options.per_batch=True, mu_glob="group_means"`). The paper's numbers were
  produced by the released code, so `authors` is the variant that reproduces them;
  `paper` is the method the text describes.
- Dual clip 3 on negative advantages (`loss.dual_clip`): the authors' runs use verl's
  clip_ratio_c = 3.0.
- Weights in float32, compute in bfloat16 (verl's FSDP mixed precision does the same): at
  lr 1e-6 an Adam step changes a weight by ~1e-6, far below bfloat16's resolution (2^-8
  relative), so bfloat16 master weights would never move.
- Mesh: pure FSDP over all 32 chips. 8B float32 params + Adam moments + the frozen
  reference are ~130 GB, 4 GB per chip; tensor parallelism would multiply the per-chip
  activation memory by the TP degree (no sequence parallelism here), so it buys nothing.
- Micro-batches: a mini-batch is 128 x 4 = 512 rows of 12288 tokens; 16 micro-batches of
  32 rows put exactly one row on each chip (micro-batch rows must divide over the chips:
  on a 64-chip slice use 8).
- Remat "full" keeps only each layer's input (12288 x 4096 bf16 = 96 MiB per layer per
  row); saving the matmul outputs (dots_*) would keep ~30 GiB per row.
- logits_chunk 1024: the head's [1024, 152k] float32 logits slice is 0.6 GiB per row,
  instead of 4.6 GiB for all 8192 completion positions at once.
- attention "splash": the Pallas kernel never holds the [T, T] scores (12288^2 x 32 heads
  x 4 bytes = 18 GiB per row and layer with the plain XLA attention).
- Sampler: all 512 prompts x 4 samples in one call, every row at once (sampler.slots = 0)
  on the paged engine, on a data=4 x tp=8 mesh of the same 32 chips with attention
  data-parallel over the tp chips (sampler.dp_attention): the weights split 8 ways, so a
  decode step reads 1/8 of them per chip, while each chip holds every kv head of its own 64
  rows' pages (32 row shards). Splitting the 8 kv heads over tp instead leaves 1-4 combined
  heads per chip, a layout the compiled loop converts around the TPU kernel at every step
  (3x the pool in memory). Each row holds pages of 128 tokens only for the tokens it has;
  the pool is 2048 pages per chip (36 GiB for Qwen3-8B: 128 tokens x 36 layers x 16
  combined kv heads x 128 x 2 bytes per page), about 3x the estimated peak of a chip's rows
  (docs/pods.md); a static cache of 2048 rows x 12288 tokens would be 108 GiB per chip.
  Pages of 128 tokens are 4 per block of the TPU kernel (kernels/ragged_paged_tpu.py),
  half a page unused per row on average.
The AOT reports for these choices are in docs/pods.md (experiments/aot_compile.py).
"""

from ebpo_jax.config import default_config, finalize

PRESET = "qwen3_8b"
# Placeholder HF checkpoint folders of each preset (the paper does not say base or instruct
# for LLaMA-3.1-8B).
CHECKPOINTS = {
    "qwen3_8b": "checkpoints/Qwen3-8B",
    "qwen3_14b": "checkpoints/Qwen3-14B",
    "qwen3_30b_a3b": "checkpoints/Qwen3-30B-A3B",
    "llama3_1_8b": "checkpoints/Llama-3.1-8B-Instruct",
}
EVAL_SETS = (
    "math500:data/math500.jsonl,aime2024:data/aime2024.jsonl,aime2025:data/aime2025.jsonl,"
    "amc23:data/amc23.jsonl,olympiadbench:data/olympiadbench.jsonl"
)


VARIANTS = ("paper", "authors", "aot", "multiturn", "int8")
# The v5p-64 sampler layout per preset: (sampler mesh, dp_attention, KV pages of 128 tokens
# per row shard). The dense models decode on data=4 x tp=8 with attention data-parallel
# over the tp chips (32 row shards, each chip every kv head of its rows). Qwen3-30B-A3B keeps
# data=16 x tp=2 with heads split over tp: 1536 pages per data shard compile to fit beside
# the resident train state (2048 missed by 3.3 GiB; docs/moe.md).
SAMPLER_LAYOUT = {
    "qwen3_8b": ("data=4,tp=8", True, 2048),
    "llama3_1_8b": ("data=4,tp=8", True, 2048),
    "qwen3_14b": ("data=4,tp=8", True, 2048),
    "qwen3_30b_a3b": ("data=16,tp=2", False, 1536),
}


# With int8 KV pages and weights (variant "int8", issue 46) the dense models split their kv
# heads over tp=4 (2 per chip): no dp attention's all-to-alls, and 8 data shards of 256 rows
# wait less for their slowest shard than 32 of 64 do. The int8 pool is read by this
# codebase's own kernel or the XLA path, neither of which needs 8 combined heads per chip.
# Compiled for v5p-64, each fitting (docs/pods.md, "The complete step"); Qwen3-14B's 8 kv heads
# split the same way. Qwen3-30B-A3B takes the same mesh with its experts split over the 8
# data shards (INT8_EXPERT_PARALLEL, sampler.expert_parallel): a decode step then reads 16
# of the 128 experts per chip, not all of them (docs/moe.md).
INT8_LAYOUT = {
    "qwen3_8b": ("data=8,tp=4", False, 3072),
    "llama3_1_8b": ("data=8,tp=4", False, 3072),
    "qwen3_14b": ("data=8,tp=4", False, 3072),
    "qwen3_30b_a3b": ("data=8,tp=4", False, 3072),
}
INT8_EXPERT_PARALLEL = ("qwen3_30b_a3b",)


def _variants(variant: str | None) -> set[str]:
    """`variant` as a set of names: comma-separated, "" = paper; paper and authors exclusive."""
    chosen = {v.strip() for v in (variant or "").split(",") if v.strip()}
    unknown = chosen - set(VARIANTS)
    if unknown or {"paper", "authors"} <= chosen:
        raise ValueError(
            f"unknown config variant {variant!r}; known: {', '.join(VARIANTS)} "
            "(comma-separated; paper or authors, not both)"
        )
    return chosen


def _data(c, preset: str, chosen) -> None:
    """The DAPO-Math records with topics, the paper's prompt and the math-verify reward."""
    c.data.schema = "record"  # cluster_topics.py output: DAPO records + topic
    c.data.template = "answer"  # the paper's "Answer: $Answer" prompt
    c.data.chat = True
    c.data.max_prompt_len = 4096
    c.data.on_overflow = "drop"
    c.data.order = "topic"  # EBPO-topic, the paper's best curriculum
    c.data.topics = "field"
    c.data.reward = "math"
    # Each host scores its block of the step's responses (about 50 ms each,
    # pods/step_terms.py); a v5p host has 208 vCPUs, so 64 processes, not 4.
    c.data.reward_workers = 64
    if "aot" not in chosen:
        c.model.hf_path = CHECKPOINTS[preset]
        c.data.path = "data/dapo_math_17k_topics.jsonl"
        c.data.eval_path = EVAL_SETS
    c.task.order = "topic"  # the aot variant's synthetic stream, same curriculum


def _sampler_and_update(c, preset: str, int8: bool = False) -> None:
    """The paged sampler's layout and the PPO update's optimizer and loss (`int8`: int8 KV
    pages and sampler weights on INT8_LAYOUT)."""
    c.sampler.max_new_tokens = 8192
    c.sampler.temperature = 1.0
    c.sampler.top_p = 1.0
    c.sampler.top_k = 0
    c.sampler.prompts_per_call = 512  # one call per step: see the comment block
    c.sampler.slots = 0  # every row of the call at once: pages, not slots, bound concurrency
    c.sampler.page_size = 128
    # The sampler's copy of the float32 master weights in bf16: decode reads half the bytes.
    c.sampler.param_dtype = "int8" if int8 else "bfloat16"
    c.sampler.kv_dtype = "int8" if int8 else ""  # "": the compute dtype
    layouts = INT8_LAYOUT if int8 and preset in INT8_LAYOUT else SAMPLER_LAYOUT
    from ebpo_jax.sharding import parse_mesh

    mesh, dp, pages = layouts[preset]
    c.sampler.mesh = mesh
    c.sampler.dp_attention = dp
    c.sampler.expert_parallel = int8 and preset in INT8_EXPERT_PARALLEL
    # row shards on v5p-64's 32 chips: every chip with dp attention, else the data shards
    shards = 32 if dp else dict(parse_mesh(mesh))["data"]
    c.sampler.kv_pages = shards * pages  # see the comment block

    c.optimizer.learning_rate = 1e-6
    c.optimizer.weight_decay = 0.01
    c.optimizer.warmup_steps = 0
    c.optimizer.schedule = "constant"
    c.optimizer.clip_norm = 1.0

    c.loss.ppo_epochs = 1
    c.loss.num_minibatches = 4  # 512 / 128 prompts
    c.loss.num_microbatches = 16  # one 12288-token row per chip on 32 chips
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.2
    c.loss.dual_clip = 3.0  # the authors' runs (verl's clip_ratio_c = 3.0)
    c.loss.agg = "token-mean"
    c.loss.kl_coef = 0.001
    c.loss.kl_estimator = "k3"
    c.loss.entropy_coef = 0.0
    c.loss.logits_chunk = 1024


def _multiturn(c) -> None:
    """Episodes with the calculator tool: 4 model turns of up to 2048 tokens in the same
    8192-token budget. A continued row keeps its KV pages (a multi-turn sampler.Session): every
    row of a call reserves its whole episode (96 pages of 128 tokens), so a call is 256 prompts x 4
    (32 rows per row shard, 3072 pages, 54 GiB per chip on the dense models' dp-attention
    layout) and a step 2 calls; for Qwen3-8B the first turn (prefill's pages + the pool + the
    train state) peaks at 78.4 of 95 GiB per chip on v5p-64; 512 prompts per call would need
    a 108 GiB pool per chip (docs/pods.md). The sampler layout is the preset's
    SAMPLER_LAYOUT, with every row's episode reserved instead of its kv_pages."""
    c.task.env = "calculator"
    c.rollout.max_turns = 4
    c.rollout.turn_tokens = 2048
    c.rollout.env_workers = 16
    c.sampler.prompts_per_call = 256
    c.sampler.kv_pages = 0  # each row's whole episode, reserved at admission


def recipe(preset: str, variant: str | None = None):
    """The paper's recipe around the model `preset` (shared by the 8B and 14B configs).

    variant "paper" (default): the carried prior; "authors": the released code's per-batch
    statistics with mu_glob = mean of group means; "aot": no data or checkpoint paths (the
    synthetic tasks at the same shapes); "multiturn": episodes with a calculator tool;
    "int8": int8 KV pages and sampler weights, on INT8_LAYOUT where the preset has one.
    Comma-separated, e.g. "authors,aot".
    """
    chosen = _variants(variant)
    from ebpo_jax.models import PRESETS

    c = default_config()
    c.workdir = f"runs/{preset}"
    c.seed = 0
    c.total_steps = 340
    c.prompts_per_step = 512
    c.group_size = 4
    c.estimator = "ebpo"
    if "authors" in chosen:  # the released code (produced the paper's numbers)
        c.estimator_options.per_batch = True
        c.estimator_options.mu_glob = "group_means"
    c.checkpoint_every = 10
    c.keep_checkpoints = 3
    c.eval_every = 20
    c.eval_batch_size = 512
    c.steps_per_jit = 1  # host reward (math-verify): jit -> host -> jit

    c.model.preset = preset
    c.model.overrides.vocab_size = PRESETS[preset]["vocab_size"]
    c.model.overrides.param_dtype = "float32"  # master weights: see the comment block
    c.model.overrides.dtype = "bfloat16"
    c.model.overrides.remat = "full"
    c.model.overrides.attention = "splash"

    _data(c, preset, chosen)
    _sampler_and_update(c, preset, int8="int8" in chosen)
    if "multiturn" in chosen:
        _multiturn(c)

    c.sft.steps = 0  # real checkpoints need no warm start

    c.mesh.shape = (-1,)
    c.mesh.axes = ("fsdp",)
    return c


def get_config(variant=None):
    return finalize(recipe(PRESET, variant))
