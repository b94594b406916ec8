# ruff: noqa: RUF009 (setting() and section() are dataclasses.field factories)
"""Every training setting, declared once: its section, type, default, one-line doc and check.

Each config section is a frozen (hashable) dataclass; a field is `setting(default, doc,
check=...)`. `config.default_config()` builds the ml_collections ConfigDict from these
classes (so config files and `--config.a.b=v` keep working), and `parse(config)` reads a
ConfigDict back into a typed `Config`, running each field's check (a one-line `ConfigError`
naming `section.field`). Checks that need several sections live in `ebpo_jax.config.checks`.
This module imports no jax: a check that needs a registry imports it when it runs.
"""

import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A training config field is missing, misspelt or impossible."""


# A check takes (dotted name, value) and returns a one-line error, or None when the value is fine.
Check = Callable[[str, Any], str | None]


def setting(default, doc: str, check: Check | None = None):
    """A config field: its default, its one-line doc and its check."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def section(cls, doc: str, after: str = ""):
    """A sub-section field (a nested ConfigDict); `after` places it after a top-level field."""
    return dataclasses.field(
        default_factory=cls, metadata={"doc": doc, "section": cls, "after": after}
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bound(name, value, ok: bool, says: str) -> str | None:
    return None if ok else f"{name} must be {says}, got {value!r}"


def at_least(n, note: str = "") -> Check:
    """value >= n."""
    return lambda name, v: _bound(name, v, v >= n, f">= {n}{note}")


def positive(name, v) -> str | None:
    """value > 0."""
    return _bound(name, v, v > 0, "> 0")


nonneg = at_least(0)


def int_at_least(n, note: str = "") -> Check:
    """An int (not a bool) >= n; `note` says what the bound value means."""
    return lambda name, v: _bound(name, v, _is_int(v) and v >= n, f"an int >= {n}{note}")


def in_range(lo, hi, closed: bool = True) -> Check:
    """lo <= value <= hi (value < hi when not `closed`)."""
    says = f"in [{lo}, {hi}{']' if closed else ')'}"
    return lambda name, v: _bound(name, v, lo <= v and (v <= hi if closed else v < hi), says)


def must(ok: Callable[[Any], bool], says: str) -> Check:
    """`name=value must be <says>` unless ok(value)."""
    return lambda name, v: None if ok(v) else f"{name}={v!r} must be {says}"


def nonempty_path(name, v) -> str | None:
    """A non-blank path."""
    return None if str(v).strip() else f"{name} must be a non-empty path"


def one_of(*choices: str, lazy: str = "") -> Check:
    """value in `choices`, or in the tuple `lazy` = "module:NAME" (imported when checked)."""

    def check(name, v):
        options = choices
        if lazy:
            module, attr = lazy.split(":")
            options = getattr(importlib.import_module(module), attr)
        return None if v in options else f"{name}={v!r} is not one of {tuple(options)}"

    return check


def lazy_check(path: str) -> Check:
    """The check `module:function`, imported when it runs."""

    def check(name, v):
        module, attr = path.split(":")
        return getattr(importlib.import_module(module), attr)(name, v)

    return check


class Pairs(Mapping):
    """A frozen, hashable mapping (sorted (name, value) pairs): free-form options in a spec."""

    def __init__(self, items=()):
        pairs = dict(items).items() if isinstance(items, Mapping) else items
        self._items = tuple(sorted((str(k), _hashable(v)) for k, v in pairs))

    def __getitem__(self, key):
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Pairs) and self._items == other._items

    def __repr__(self) -> str:
        return f"Pairs({dict(self._items)!r})"

    def to_dict(self) -> dict:
        return dict(self._items)


def _hashable(v):
    """Lists and dicts (from a config file) as tuples and Pairs, so that specs hash."""
    if isinstance(v, Mapping):
        return Pairs(v)
    if isinstance(v, list | tuple):
        return tuple(_hashable(x) for x in v)
    return v


@dataclasses.dataclass(frozen=True)
class Wandb:
    """Weights & Biases beside TensorBoard and metrics.jsonl: project "" = off."""

    project: str = setting("", 'W&B project; "" = no W&B logging')
    mode: str = setting(
        "online",
        "online | offline (WANDB_MODE=offline is honoured too) | disabled",
        one_of("online", "offline", "disabled"),
    )
    entity: str = setting("", 'W&B team or user; "" = your default')
    name: str = setting("", '"" = the workdir\'s base name')


@dataclasses.dataclass(frozen=True)
class Lora:
    """LoRA / QLoRA (models.lora): only the adapters train; the KL reference is the base."""

    rank: int = setting(0, "adapter rank; 0 = full fine-tuning", int_at_least(0, " (0 = off)"))
    alpha: float = setting(32.0, "the adapter's output is scaled by alpha / rank", positive)
    targets: str = setting("q,k,v,o,gate,up,down", "any of these, comma-separated")
    base_dtype: str = setting(
        "",
        'the frozen base\'s storage: "" = model param_dtype, float32, bfloat16, int8, nf4',
        one_of(lazy="ebpo_jax.models.lora:BASE_DTYPES"),
    )


@dataclasses.dataclass(frozen=True)
class Moe:
    """Mixture-of-experts policies (a qwen3_moe preset or checkpoint)."""

    routing_replay: bool = setting(
        False, "the update (and old log-prob recompute) reuse the sampler's experts per token"
    )
    lb_coef: float = setting(0.0, "router load-balancing loss coefficient (0 = off, as for RL)")


@dataclasses.dataclass(frozen=True)
class Model:
    """The policy: a preset or a local HF checkpoint, LoRA and mixture-of-experts options."""

    preset: str = setting("tiny", "a name in ebpo_jax.models presets (tiny, qwen3_8b, ...)")
    overrides: Pairs = setting(Pairs(), "ModelConfig fields, e.g. num_layers")
    hf_path: str = setting(
        "", "a local HF checkpoint folder: weights and tokenizer (overrides: non-shape only)"
    )
    tokenizer_path: str = setting(
        "", "a local HF tokenizer folder for a randomly initialised preset"
    )
    batch_invariant: bool = setting(
        False,
        "a token's log-prob depends only on its own row (fixed tiles and reduction orders), so "
        "the sampler's log-probs equal the trainer's bit for bit",
    )
    lora: Lora = section(Lora, "LoRA / QLoRA adapters")
    moe: Moe = section(Moe, "mixture-of-experts routing")


@dataclasses.dataclass(frozen=True)
class Data:
    """Math data (ebpo_jax.data); path "" = the synthetic tasks of `task`."""

    path: str = setting("", "a json/jsonl/parquet file or folder of them")
    schema: str | Pairs = setting(
        "dapo", 'a name in SCHEMAS, or a field mapping {"prompt": ..., "answer": ...}'
    )
    limit: int = setting(0, "0 = every row")
    template: str = setting(
        "answer", "answer (the paper's) | boxed | plain | a string with {problem}"
    )
    chat: bool = setting(True, "wrap in the tokenizer's chat template")
    system: str = setting("", "optional system prompt (chat only)")
    max_prompt_len: int = setting(1024, "tokens", positive)
    on_overflow: str = setting("drop", "drop (and count) or error")
    order: str = setting("naive", "naive | topic | difficulty | reverse_difficulty")
    shuffle_clusters: bool = setting(True, "topic order: clusters in seeded order per epoch")
    topics: str = setting("field", "field (the schema's topic) | kmeans (MiniLM embeddings) | none")
    num_clusters: int = setting(10, "for topics=kmeans (data.clustering.NUM_CLUSTERS)", positive)
    reward: str = setting("math", 'a name in rewards.REWARDS or "pkg.module:fn"')
    reward_timeout_s: float = setting(
        10.0, "seconds per math-verify check (then reward 0)", positive
    )
    reward_workers: int = setting(0, "0 = min(4, cpu count)")
    format_weight: float = setting(0.0, 'bonus for an "Answer:" line or \\boxed{}')
    eval_path: str = setting(
        "", 'held-out benchmarks: comma-separated "path" or "schema:path"; "" = no eval'
    )
    eval_schema: str = setting("math500", "for eval entries without a schema")
    eval_limit: int = setting(0, "first N problems of each eval file; 0 = all")


@dataclasses.dataclass(frozen=True)
class Task:
    """The synthetic and generated task families."""

    family: str = setting(
        "", 'a name in trainer.task\'s registry; "" = "math" with data.path, else "arithmetic"'
    )
    topics: str = setting("", 'comma-separated topic names; "" = every topic')
    env: str = setting(
        "",
        "an environment (ebpo_jax.tasks.envs registry) that makes any family's rollouts multi-turn "
        'episodes; "" = the family\'s own (calculator, guess) or none',
    )
    max_difficulty: int = setting(0, "0 = every level", nonneg)
    seed: int = setting(
        0, "problem generation (the held-out split depends only on this)", int_at_least(0)
    )
    train_per_cell: int = setting(
        400, "training problems per (topic, difficulty) cell", at_least(1)
    )
    test_per_cell: int = setting(20, "held-out problems per (topic, difficulty) cell", at_least(1))
    val_per_cell: int = setting(
        0, "validation problems per cell (reasoning family), never in eval/pass@1", nonneg
    )
    order: str = setting(
        "naive",
        "naive | topic | difficulty (EBPO curricula, easy to hard) | reverse_difficulty",
        one_of("naive", "topic", "difficulty", "reverse_difficulty"),
    )
    difficulty_file: str = setting(
        "",
        "per-problem difficulty (experiments/estimate_difficulty.py's toy output) for the "
        'difficulty orders and the held-out quartiles; "auto" = estimated from the warm start; '
        '"" = the generator\'s levels',
    )
    difficulty_samples: int = setting(
        16, 'samples per problem at temperature 1 for difficulty_file="auto"', at_least(1)
    )


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Rollout sampling and the sampler's layout."""

    max_new_tokens: int = setting(16, "response length budget in tokens", at_least(1))
    temperature: float = setting(1.0, "rollout sampling temperature (> 0 for training)", positive)
    top_p: float = setting(
        1.0, "nucleus sampling mass; 1.0 = off", lambda n, v: _bound(n, v, 0 < v <= 1, "in (0, 1]")
    )
    top_k: int = setting(0, "0 = off", int_at_least(0, " (0 = off)"))
    prompts_per_call: int = setting(
        0, "prompts per sampler call: 0 = all P at once; else P / prompts_per_call chunks"
    )
    mesh: str = setting("", 'e.g. "data=8,tp=4" (AOT report); "" = the trainer\'s mesh')
    param_dtype: str = setting(
        "",
        "the sampler's copy of the weights: \"\" = the trainer's, bfloat16, float32, or int8 "
        "(per-channel scales, made at each weight move)",
        one_of("", "bfloat16", "float32", "int8"),
    )
    kv_dtype: str = setting(
        "",
        'KV cache pages: "" = the model\'s compute dtype, or int8 (a float32 scale per token '
        "and kv head, beside the pages; docs/sampler.md)",
        one_of("", "int8"),
    )
    slots: int = setting(
        0,
        "decode slots per call: 0 = one static batch; S > 0 = continuous batching",
        int_at_least(0, " (0 = the static batch)"),
    )
    page_size: int = setting(16, "tokens per KV cache page", int_at_least(1))
    kv_pages: int = setting(
        0,
        "KV pages per sampler call; 0 = every slot's longest row",
        int_at_least(0, " (0 = enough for every slot)"),
    )
    attention: str = setting(
        "auto",
        "paged decode attention: auto (the platform's Pallas kernel), xla, pallas_tpu, pallas_gpu",
        one_of(lazy="ebpo_jax.sampler.spec:ATTENTION_IMPLS"),
    )
    dp_attention: bool = setting(
        False,
        "rows and KV pages split over tp too: each tp chip attends all heads of its rows",
    )
    expert_parallel: bool = setting(
        False,
        "mixture of experts: the sampler's experts split over its data axes (E / shards each), "
        "tokens all-gathered to them and their outputs reduce-scattered back (models/moe.py)",
    )
    live_buckets: int = setting(
        1,
        "decode steps run on the smallest of this many batch sizes that holds the live rows "
        "(each compiles its own forward); 1 = every slot at every step",
        int_at_least(1),
    )


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The one-step-stale pipeline and multi-turn episodes (docs/multiturn.md)."""

    max_staleness: int = setting(
        0,
        "0: sample with the params updated; 1: rollout t+1 with params t during update t",
        must(lambda v: v in (0, 1), "0 or 1"),
    )
    max_turns: int = setting(1, "model turns per episode", at_least(1))
    turn_tokens: int = setting(0, "tokens per model turn; 0 = sampler.max_new_tokens")
    keep_kv: bool = setting(
        True,
        "multi-turn rows keep their KV pages across turns (only observations are fed); "
        "False: every turn prefills the episode so far",
    )
    env_workers: int = setting(
        2, "environment worker processes; 0 = in the trainer's process", nonneg
    )
    env_timeout_s: float = setting(
        10.0, "seconds per environment call before a tool error", positive
    )


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """AdamW with gradient clipping and a warm-up + constant/cosine schedule."""

    learning_rate: float = setting(1e-6, "AdamW peak learning rate", positive)
    weight_decay: float = setting(0.01, "AdamW decoupled weight decay", nonneg)
    warmup_steps: int = setting(0, "in train steps", nonneg)
    schedule: str = setting(
        "constant", "constant | cosine (decays to final_lr_frac)", one_of("constant", "cosine")
    )
    final_lr_frac: float = setting(0.1, "cosine: final learning rate / peak", in_range(0, 1))
    # optax.clip_by_global_norm flips the gradient's sign below 0 (ascent) and zeroes it at 0.
    clip_norm: float = setting(1.0, "global gradient-norm clip", positive)
    b1: float = setting(0.9, "Adam beta1", in_range(0, 1, closed=False))
    b2: float = setting(0.999, "Adam beta2", in_range(0, 1, closed=False))


_share = must(lambda v: 0 < v <= 1, "in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Loss:
    """The policy loss and the PPO update (losses.LossOptions.from_config reads the loss's)."""

    name: str = setting(
        "ppo",
        "a name in ebpo_jax.losses' registry: ppo | gspo | gspo_token | cispo | clip_cov | kl_cov",
    )
    ppo_epochs: int = setting(1, "passes over each rollout", at_least(1))
    num_minibatches: int = setting(1, "per PPO epoch; splits the P prompts", at_least(1))
    num_microbatches: int = setting(1, "gradient accumulation within a mini-batch", at_least(1))
    clip_low: float = setting(0.2, "PPO ratio clip below: 1 - clip_low", nonneg)
    clip_high: float = setting(0.2, "PPO ratio clip above: 1 + clip_high", nonneg)
    dual_clip: float = setting(
        0.0, "dual-clip bound (> 1); 0 = off", must(lambda v: v == 0 or v > 1, "0 (off) or > 1")
    )
    agg: str = setting(
        "token-mean",
        "loss aggregation: ebpo_jax.losses.AGG_MODES",
        one_of(lazy="ebpo_jax.losses:AGG_MODES"),
    )
    kl_coef: float = setting(0.0, "KL penalty to the frozen reference; 0 = off", nonneg)
    kl_estimator: str = setting("k3", "k1 | k2 | k3", one_of("k1", "k2", "k3"))
    entropy_coef: float = setting(0.0, "entropy bonus; 0 = off")
    logits_chunk: int = setting(0, ">0: completion logits in chunks of this many positions")
    recompute_old_logprobs: bool = setting(
        False, "old log-probs from the trainer's own forward instead of the sampler's"
    )
    is_correction: str = setting(
        "none",
        "none | tis | mis (needs recompute_old_logprobs)",
        one_of(lazy="ebpo_jax.importance:IS_MODES"),
    )
    is_level: str = setting(
        "token",
        "token | sequence (ratio product) | geometric (their mean)",
        one_of(lazy="ebpo_jax.importance:IS_LEVELS"),
    )
    is_cap: float = setting(
        2.0, "TIS: weights truncated at this", at_least(1, " (a matched token has weight 1)")
    )
    is_low: float = setting(0.5, "MIS: tokens / sequences with a ratio below this dropped")
    is_high: float = setting(2.0, "MIS: upper ratio bound (see is_low)")
    tokens_per_microbatch: int = setting(
        0, ">0: packed update, rows of pack_row_len tokens; 0 = padded rows", nonneg
    )
    pack_row_len: int = setting(0, "0 = prompt width + sampler.max_new_tokens", nonneg)
    clip_cov_ratio: float = setting(
        2e-4, "clip_cov: share of tokens whose gradient is dropped (verl's)", _share
    )
    clip_cov_lb: float = setting(1.0, "clip_cov: candidates have clip_cov_lb < Cov")
    clip_cov_ub: float = setting(5.0, "clip_cov: candidates have Cov < clip_cov_ub")
    kl_cov_ratio: float = setting(
        2e-4, "kl_cov: share of tokens (largest Cov) with the |log-ratio| penalty", _share
    )
    kl_cov_coef: float = setting(0.1, "kl_cov: the penalty's weight (verl's ppo_kl_coef)", nonneg)


@dataclasses.dataclass(frozen=True)
class Dapo:
    """DAPO's dynamic sampling and overlong shaping."""

    dynamic_sampling: bool = setting(False, "drop all-equal groups, refill from further prompts")
    max_extra_rounds: int = setting(2, "extra rollout rounds to refill dropped groups", nonneg)
    overlong_buffer: int = setting(
        0, "tokens before max_new_tokens where the soft penalty starts; 0 = off"
    )
    overlong_penalty: float = setting(1.0, "the soft penalty at max_new_tokens (linear)", nonneg)
    mask_truncated: bool = setting(False, "no loss on responses cut at max_new_tokens")


@dataclasses.dataclass(frozen=True)
class Sft:
    """The supervised warm start (synthetic tasks)."""

    steps: int = setting(0, "0 = no warm start", nonneg)
    batch_size: int = setting(64, "sequences per step", at_least(1))
    learning_rate: float = setting(3e-3, "peak learning rate", positive)
    warmup_steps: int = setting(20, "linear warmup steps", nonneg)
    cache_dir: str = setting("", '"" = <workdir>/sft_cache')
    seed: int = setting(
        -1,
        "seed of the initial policy (init + SFT); -1 = the run's seed",
        int_at_least(-1, " (-1 = the run's seed)"),
    )
    params_file: str = setting("", "a committed warm start (.npz named by its SHA-256)")
    params_sha256: str = setting("", "when set, a warm start with another hash is refused")
    export_dir: str = setting("", "also write the warm start to <export_dir>/<sha256>.npz")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The trainer's device mesh."""

    shape: tuple[int, ...] = setting((1,), "-1 = the remaining devices")
    axes: tuple[str, ...] = setting(
        ("data",), "the mesh axes' names, one per shape entry: data, fsdp, context, tp"
    )
    devices: int = setting(0, "0 = every device; n = the first n devices of this process")


# The built-in estimators' keyword options (advantages.eb_advantage, grpo_advantage, ...).
@dataclasses.dataclass(frozen=True)
class EstimatorOptions:
    """Keyword options for the estimator; None = the estimator's own default.

    A custom estimator's options are added in its config file (`c.estimator_options.x = 3`);
    they land in `extra` and are settable from the command line too.
    """

    per_batch: bool | None = setting(None, "EB: the prior from this batch alone")
    forgetting: float | None = setting(None, "EB: the prior's forgetting factor")
    normalize: str | None = setting(None, "how advantages are normalised")
    eps: float | None = setting(None, "the normaliser's epsilon")
    extra: Pairs = setting(Pairs(), "a custom estimator's options")

    def as_kwargs(self) -> dict:
        """Every option as the estimator's keyword arguments (None = its default)."""
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[:-1]}
        return {**known, **self.extra}


@dataclasses.dataclass(frozen=True)
class Run:
    """The top-level settings."""

    workdir: str = setting(
        "runs/run",
        "the run's folder (relative: to the current one); resumed if it exists",
        nonempty_path,
    )
    seed: int = setting(0, "RL seed: sampling, shuffling, init", int_at_least(0))
    total_steps: int = setting(100, "RL steps to train to (a resume continues up to this)", nonneg)
    prompts_per_step: int = setting(32, "P", at_least(1))
    group_size: int = setting(8, "G", at_least(1))
    estimator: str = setting("ebpo", "any name in ebpo_jax.advantages' registry")
    eb_clusters: str = setting(
        "none",
        "EB priors: none (one global) | topic | cell (topic x difficulty; synthetic)",
        one_of("none", "topic", "cell"),
    )
    checkpoint_every: int = setting(50, "steps between checkpoints (also on SIGTERM/SIGINT)")
    keep_checkpoints: int = setting(3, "newest checkpoints kept", at_least(1))
    eval_every: int = setting(50, "steps between held-out evaluations (and the last step)")
    eval_batch_size: int = setting(128, "held-out prompts per sampler call", at_least(1))
    eval_temperature: float = setting(
        1.0, "pass@1 sampling temperature (the paper's: 1.0); 0.0 = greedy, one sample", nonneg
    )
    eval_samples: int = setting(
        4, "samples per held-out problem (pass@1 is their mean)", at_least(1)
    )
    steps_per_jit: int = setting(
        1, "K steps per lax.scan; 1 = jit -> host -> jit with per-phase timing", at_least(1)
    )
    max_nonfinite_steps: int = setting(
        5, "stop after this many non-finite steps in a row", at_least(1)
    )
    step_timeout_s: float = setting(
        0.0,
        "seconds a step's phase may run before the run dumps its stacks and exits 1; "
        "0 = auto (ebpo_jax.runtime.watchdog: 3600 s while 3 steps compile, then from their times)",
        nonneg,
    )
    profile_steps: str = setting(
        "",
        "'a:b': a jax.profiler trace of steps a..b-1 into the workdir ('' = none)",
        lazy_check("ebpo_jax.runtime.tracing:check_steps"),
    )
    log_every: int = setting(10, "without a terminal: a progress line every N steps", at_least(1))
    log_every_s: float = setting(30.0, "... and at most this many seconds apart", positive)
    restart: bool = setting(
        False, "start over in a workdir with metrics.jsonl but no checkpoint (rewrites metrics)"
    )
    log_samples_every: int = setting(
        0, ">0: every N steps, a few (prompt, completion, reward) to samples.jsonl", nonneg
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole typed config: the top-level settings and each section."""

    run: Run = section(Run, "the top-level settings")
    estimator_options: EstimatorOptions = section(
        EstimatorOptions, "keyword options for the estimator", after="estimator"
    )
    wandb: Wandb = section(Wandb, "Weights & Biases logging")
    model: Model = section(Model, "the policy")
    data: Data = section(Data, "math data")
    task: Task = section(Task, "synthetic task families")
    sampler: Sampler = section(Sampler, "rollout sampling")
    rollout: Rollout = section(Rollout, "staleness and multi-turn episodes")
    optimizer: Optimizer = section(Optimizer, "AdamW")
    loss: Loss = section(Loss, "policy loss and PPO update")
    dapo: Dapo = section(Dapo, "DAPO shaping")
    sft: Sft = section(Sft, "SFT warm start")
    mesh: Mesh = section(Mesh, "the trainer's mesh")


# Sub-dicts whose keys are free-form: checked against the estimator / model, not the schema.
OPEN_DICTS = ("estimator_options", "model.overrides")
# Sections whose fields sit at the config's top level (no sub-dict of their own).
FLAT = ("run",)


def _fields(cls):
    return dataclasses.fields(cls)


def default_of(cls) -> Callable[[str], Any]:
    """name -> the declared default of that field of section `cls` (for a library's spec)."""
    return lambda name: cls.__dataclass_fields__[name].default


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _convert(cls, name, value):
    """The ConfigDict value as the field's declared type (tuples, Pairs, float for int)."""
    kind = _hints(cls)[name]
    if isinstance(value, Mapping) or hasattr(value, "to_dict"):
        return Pairs(value.to_dict() if hasattr(value, "to_dict") else value)
    if kind is float and _is_int(value):
        return float(value)
    if isinstance(value, list | tuple):
        return _hashable(value)
    return value


def _parse_section(cls, node, prefix: str):
    """One section (or a flat one) from its ConfigDict `node`; runs each field's check."""
    values = {}
    for f in _fields(cls):
        name = prefix + f.name
        if f.metadata.get("section"):
            sub = node if f.name in FLAT else node[f.name]
            values[f.name] = _parse_section(
                f.metadata["section"], sub, "" if f.name in FLAT else name + "."
            )
            continue
        if cls is EstimatorOptions and f.name == "extra":
            known = {g.name for g in _fields(cls)}
            values["extra"] = Pairs({k: v for k, v in node.items() if k not in known})
            continue
        value = _convert(cls, f.name, node[f.name])
        check = f.metadata.get("check")
        error = check(name, value) if check and value is not None else None
        if error:
            raise ConfigError(error)
        values[f.name] = value
    return cls(**values)


def parse(config) -> Config:
    """The ConfigDict `config` as a typed Config; ConfigError on the first bad field value."""
    return _parse_section(Config, config, "")


def docs() -> dict[str, str]:
    """Dotted field name -> its one-line doc, for every declared field."""
    out = {}

    def walk(cls, prefix):
        for f in _fields(cls):
            if f.metadata.get("section"):
                if f.name not in FLAT:
                    out[prefix + f.name] = f.metadata["doc"]
                walk(f.metadata["section"], prefix if f.name in FLAT else f"{prefix}{f.name}.")
            elif not (cls is EstimatorOptions and f.name == "extra"):
                out[prefix + f.name] = f.metadata["doc"]

    walk(Config, "")
    return out
