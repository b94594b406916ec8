"""Training config schema and validation: bad fields are one-line errors before any compile."""

import json
import math
import os

import ml_collections

from ebpo_jax import losses
from ebpo_jax.data.config import data_config
from ebpo_jax.importance import IS_LEVELS, IS_MODES
from ebpo_jax.losses import AGG_MODES

SCHEDULES = ("constant", "cosine")
SAMPLER_DTYPES = ("", "bfloat16", "float32")


class ConfigError(ValueError):
    """A training config field is missing, misspelt or impossible."""


# The built-in estimators' keyword options (advantages.eb_advantage, grpo_advantage, ...),
# declared so that `--config.estimator_options.forgetting=0.95` works from the command line;
# None = the estimator's own default (advantages.estimate drops None options).
ESTIMATOR_OPTIONS = {"per_batch": bool, "forgetting": float, "normalize": str, "eps": float}
KL_ESTIMATORS = ("k1", "k2", "k3")  # ebpo_jax.losses.KL_ESTIMATORS (kept jax-free here)
WANDB_MODES = ("online", "offline", "disabled")


def estimator_options_config() -> ml_collections.ConfigDict:
    """estimator_options with each built-in option as a typed None placeholder.

    A custom estimator's options are added in its config file
    (`c.estimator_options.my_option = 3`) and are then settable from the command line too.
    """
    c = ml_collections.ConfigDict()
    for name, kind in ESTIMATOR_OPTIONS.items():
        c[name] = ml_collections.config_dict.placeholder(kind)
    return c


def default_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with defaults; config files start from this."""
    c = ml_collections.ConfigDict()
    c.workdir = "runs/run"  # the run's folder (relative: to the current one); resumed if it exists
    c.seed = 0  # RL seed: sampling, shuffling, init
    c.total_steps = 100  # RL steps to train to (a resume continues up to this)
    c.prompts_per_step = 32  # P
    c.group_size = 8  # G
    c.estimator = "ebpo"  # any name in ebpo_jax.advantages' registry
    c.estimator_options = estimator_options_config()  # keyword options for the estimator
    # EB priors: none (one global) | topic | cell (topic x difficulty; synthetic tasks only)
    c.eb_clusters = "none"
    c.checkpoint_every = 50  # steps between checkpoints (also on SIGTERM/SIGINT)
    c.keep_checkpoints = 3  # newest checkpoints kept
    c.eval_every = 50  # steps between held-out evaluations (and the last step)
    c.eval_batch_size = 128  # held-out prompts per sampler call
    # eval/pass@1 = mean reward over eval_samples samples per held-out problem at this
    # temperature (the paper's protocol: temperature 1.0); 0.0 = greedy, one sample.
    c.eval_temperature = 1.0
    c.eval_samples = 4  # samples per held-out problem (pass@1 is their mean)
    c.steps_per_jit = 1  # K steps per lax.scan; 1 = jit -> host -> jit with per-phase timing
    c.max_nonfinite_steps = 5  # stop after this many non-finite steps in a row
    # Without a terminal (a log file, a batch job): a progress line every log_every steps and
    # at least every log_every_s seconds. On a terminal a tqdm bar shows every step.
    c.log_every = 10
    c.log_every_s = 30.0  # progress lines without a terminal: at most this many seconds apart
    # A workdir with metrics.jsonl but no checkpoint is refused unless restart=True (which
    # starts over and rewrites its metrics); see ebpo_jax.workdir.check_workdir.
    c.restart = False
    c.log_samples_every = (
        0  # >0: every N steps, a few (prompt, completion, reward) to samples.jsonl
    )

    # Weights & Biases beside TensorBoard and metrics.jsonl: project "" = off.
    c.wandb = ml_collections.ConfigDict()
    c.wandb.project = ""  # W&B project; "" = no W&B logging
    c.wandb.mode = "online"  # online | offline (WANDB_MODE=offline is honoured too) | disabled
    c.wandb.entity = ""  # W&B team or user; "" = your default
    c.wandb.name = ""  # "" = the workdir's base name

    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # a name in ebpo_jax.models presets (tiny, qwen3_8b, llama3_8b, ...)
    c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields, e.g. num_layers
    # A local HF checkpoint folder: weights (models.from_hf) and tokenizer; the preset is
    # unused and overrides may only change non-shape fields (dtype, remat, attention, ...).
    c.model.hf_path = ""
    # A local HF tokenizer folder for a randomly initialised preset (vocab from the tokenizer).
    c.model.tokenizer_path = ""
    # LoRA / QLoRA (ebpo_jax.models.lora): rank 0 = full fine-tuning. Only the adapters
    # train; the KL reference is the frozen base with the adapters off.
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0  # adapter rank; 0 = full fine-tuning
    c.model.lora.alpha = 32.0  # the adapter's output is scaled by alpha / rank
    c.model.lora.targets = "q,k,v,o,gate,up,down"  # any of these, comma-separated
    # The frozen base's storage: "" = model param_dtype, float32, bfloat16, or QLoRA's int8 / nf4.
    c.model.lora.base_dtype = ""
    # Mixture-of-experts policies (a qwen3_moe preset or checkpoint): routing replay records
    # the experts the sampler chose for every token and makes the update (and the old
    # log-prob recompute) use them; lb_coef weights the router load-balancing loss.
    c.model.moe = ml_collections.ConfigDict()
    c.model.moe.routing_replay = False  # the update reuses the sampler's experts per token
    c.model.moe.lb_coef = 0.0  # router load-balancing loss coefficient (0 = off, as for RL)

    # Math data (ebpo_jax.data); path "" = the synthetic arithmetic tasks of `task` below.
    c.data = data_config()

    c.task = ml_collections.ConfigDict()
    # A name in ebpo_jax.trainer.task's registry; "" = "math" with data.path, else "arithmetic".
    c.task.family = ""
    c.task.topics = ""  # comma-separated topic names; "" = every topic
    c.task.max_difficulty = 0  # 0 = every level
    c.task.seed = 0  # problem generation (the held-out split depends only on this)
    c.task.train_per_cell = 400  # training problems per (topic, difficulty) cell
    c.task.test_per_cell = 20  # held-out problems per (topic, difficulty) cell
    # Validation problems per cell (reasoning family), drawn after train: they choose
    # hyperparameters as eval/validation/pass@1 and never enter eval/pass@1 (the test split).
    c.task.val_per_cell = 0
    c.task.order = "naive"  # naive | topic | difficulty (EBPO-naive/topic/diff curricula)

    c.sampler = ml_collections.ConfigDict()
    c.sampler.max_new_tokens = 16  # response length budget in tokens
    c.sampler.temperature = 1.0  # rollout sampling temperature
    c.sampler.top_p = 1.0  # nucleus sampling mass; 1.0 = off
    c.sampler.top_k = 0  # 0 = off
    # Prompts per sampler call: 0 = all of a round's P prompts at once; else the rollout
    # generates P / prompts_per_call chunks one after another, so the KV cache is per chunk.
    c.sampler.prompts_per_call = 0
    c.sampler.mesh = ""  # e.g. "data=8,tp=4" (AOT report); "" = the trainer's mesh
    # The dtype of the sampler's copy of the weights: "" = the trainer's; "bfloat16" casts the
    # weights moved to the sampler (a pod's layout; the mismatch/* metrics show what it costs).
    c.sampler.param_dtype = ""

    c.rollout = ml_collections.ConfigDict()
    # 0: each step samples with the params it updates. 1: rollout t+1 is generated with params
    # t while update t runs, the sampler on the `sampler.mesh` devices after the trainer's.
    c.rollout.max_staleness = 0
    # Multi-turn episodes (a task with an environment, docs/multiturn.md): model turns at most,
    # tokens per model turn (0 = sampler.max_new_tokens, the episode's whole budget), and the
    # environment's worker processes (0 = in the trainer's process) and per-call timeout.
    c.rollout.max_turns = 1  # model turns per episode
    c.rollout.turn_tokens = 0  # tokens per model turn; 0 = sampler.max_new_tokens
    c.rollout.env_workers = 2  # environment worker processes; 0 = in the trainer's process
    c.rollout.env_timeout_s = 10.0  # seconds per environment call before a tool error
    # Decode slots per sampler call: 0 = every row of the call decodes as one static batch
    # until the longest ends; S > 0 = continuous batching, S rows at a time, a slot refilled
    # as soon as its row ends. A multiple of the sampler mesh's data shards.
    c.sampler.slots = 0
    # The paged KV cache (docs/sampler.md): pages of `page_size` tokens; `kv_pages` pages per
    # sampler call over all data shards (0 = enough for every slot's longest row). When the
    # pool is short, new rows wait for pages; one row must fit the pool on its own.
    c.sampler.page_size = 16  # tokens per KV cache page
    c.sampler.kv_pages = 0  # KV pages per sampler call; 0 = every slot's longest row

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-6  # AdamW peak learning rate
    c.optimizer.weight_decay = 0.01  # AdamW decoupled weight decay
    c.optimizer.warmup_steps = 0  # in train steps
    c.optimizer.schedule = "constant"  # or "cosine" (decays to final_lr_frac over total_steps)
    c.optimizer.final_lr_frac = 0.1  # cosine: final learning rate / peak
    c.optimizer.clip_norm = 1.0  # global gradient-norm clip; 0 = off
    c.optimizer.b1 = 0.9  # Adam beta1
    c.optimizer.b2 = 0.999  # Adam beta2

    c.loss = ml_collections.ConfigDict()
    c.loss.name = "ppo"  # any name in ebpo_jax.losses' registry: ppo | gspo | gspo_token | cispo
    c.loss.ppo_epochs = 1  # passes over each rollout
    c.loss.num_minibatches = 1  # per PPO epoch; splits the P prompts
    c.loss.num_microbatches = 1  # gradient accumulation within a mini-batch
    c.loss.clip_low = 0.2  # PPO ratio clip below: 1 - clip_low
    c.loss.clip_high = 0.2  # PPO ratio clip above: 1 + clip_high (clip-higher when larger)
    c.loss.dual_clip = 0.0  # 0 = off
    c.loss.agg = "token-mean"  # loss aggregation: ebpo_jax.losses.AGG_MODES
    c.loss.kl_coef = 0.0  # KL penalty to the frozen reference; 0 = off (no reference kept)
    c.loss.kl_estimator = "k3"  # k1 | k2 | k3
    c.loss.entropy_coef = 0.0  # entropy bonus; 0 = off
    c.loss.logits_chunk = 0  # >0: completion logits in chunks of this many positions (big vocab)
    # Old log-probs from the trainer's own forward instead of the sampler's (ebpo_jax.importance).
    c.loss.recompute_old_logprobs = False
    c.loss.is_correction = "none"  # none | tis | mis (needs recompute_old_logprobs)
    c.loss.is_level = "token"  # token | sequence (product of ratios) | geometric (their mean)
    c.loss.is_cap = 2.0  # TIS: weights truncated at this
    c.loss.is_low = 0.5  # MIS: tokens / sequences with a ratio outside [is_low, is_high] dropped
    c.loss.is_high = 2.0  # MIS: upper ratio bound (see is_low)
    # >0: packed update (trainer/packing.py): sequences packed into rows of pack_row_len
    # tokens, micro-batches of tokens_per_microbatch // pack_row_len rows; 0 = padded rows.
    c.loss.tokens_per_microbatch = 0
    c.loss.pack_row_len = 0  # 0 = prompt width + sampler.max_new_tokens (the longest sequence)

    c.dapo = ml_collections.ConfigDict()
    c.dapo.dynamic_sampling = False  # drop all-equal groups, refill from further prompts
    c.dapo.max_extra_rounds = 2  # dynamic sampling: extra rollout rounds to refill dropped groups
    c.dapo.overlong_buffer = (
        0  # tokens before max_new_tokens where the soft penalty starts; 0 = off
    )
    c.dapo.overlong_penalty = 1.0  # the soft penalty at max_new_tokens (linear over the buffer)
    c.dapo.mask_truncated = False  # no loss on responses cut at max_new_tokens

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # 0 = no warm start
    c.sft.batch_size = 64  # SFT warm start: sequences per step
    c.sft.learning_rate = 3e-3  # SFT warm start: peak learning rate
    c.sft.warmup_steps = 20  # SFT warm start: linear warmup steps
    c.sft.cache_dir = ""  # "" = <workdir>/sft_cache
    # Seed of the initial policy (init + SFT); -1 = the run's seed. A fixed seed gives every
    # RL seed the same warm start, as a pretrained base does (and one SFT per grid).
    c.sft.seed = -1
    # A committed warm start (an .npz named by its SHA-256, ebpo_jax.trainer.sft.export) used
    # instead of training one: every CPU family then starts from the same bytes.
    c.sft.params_file = ""
    c.sft.params_sha256 = ""  # when set, a warm start with another hash is refused
    c.sft.export_dir = ""  # also write the warm start to <export_dir>/<sha256>.npz (committed)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1,)  # -1 = the remaining devices
    c.mesh.axes = ("data",)  # the mesh axes' names, one per mesh.shape entry
    # 0 = the mesh spans every device (pods); n = the first n devices of this single process
    # (tests compare a 1-device run with an 8-device one on the same 8 fake CPU devices).
    c.mesh.devices = 0
    return c


def load_sibling(config_file: str, name: str):
    """The config module `name` next to `config_file` (config files are loaded by path, so a
    config that builds on another cannot import it as a package module)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(
        f"ebpo_config_{os.path.basename(name)[:-3]}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Lock a config so that assigning a misspelt field raises."""
    config.lock()
    return config


# Sub-dicts whose keys are free-form: checked against the estimator / model, not the schema.
OPEN_DICTS = ("estimator_options", "model.overrides")


def _is_closed_dict(x, name: str = "") -> bool:
    """A schema sub-dict whose keys are fixed (the open ones hold free-form options)."""
    return isinstance(x, ml_collections.ConfigDict) and bool(len(x)) and name not in OPEN_DICTS


def _unknown_fields(config, schema, prefix=""):
    """Dotted names present in config but not in schema (open dicts excepted)."""
    out = []
    for key in config.keys():  # noqa: SIM118 (ConfigDict)
        name = prefix + key
        if key not in schema:
            out.append(name)
        elif _is_closed_dict(schema[key], name) and isinstance(
            config[key], ml_collections.ConfigDict
        ):
            out += _unknown_fields(config[key], schema[key], name + ".")
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_values(c, need) -> None:
    """Ranges of the scalar fields the trainer would otherwise accept silently or trip on late."""
    opt = c.optimizer
    need(bool(str(c.workdir).strip()), "workdir must be a non-empty path")
    need(_is_int(c.seed) and c.seed >= 0, f"seed must be an int >= 0, got {c.seed!r}")
    need(c.log_every >= 1, f"log_every must be >= 1, got {c.log_every}")
    need(c.get("log_every_s", 1.0) > 0, f"log_every_s must be > 0, got {c.get('log_every_s')}")
    need(c.eval_batch_size >= 1, f"eval_batch_size must be >= 1, got {c.eval_batch_size}")
    need(c.log_samples_every >= 0, f"log_samples_every must be >= 0, got {c.log_samples_every}")
    # optax.clip_by_global_norm flips the gradient's sign below 0 (ascent) and zeroes it at 0.
    need(opt.clip_norm > 0, f"optimizer.clip_norm must be > 0, got {opt.clip_norm}")
    need(0 <= opt.b1 < 1, f"optimizer.b1 must be in [0, 1), got {opt.b1}")
    need(0 <= opt.b2 < 1, f"optimizer.b2 must be in [0, 1), got {opt.b2}")
    need(opt.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
    need(
        0 <= opt.final_lr_frac <= 1,
        f"optimizer.final_lr_frac must be in [0, 1], got {opt.final_lr_frac}",
    )
    need(opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}")
    t = c.task
    need(_is_int(t.seed) and t.seed >= 0, f"task.seed must be an int >= 0, got {t.seed!r}")
    need(t.train_per_cell >= 1, f"task.train_per_cell must be >= 1, got {t.train_per_cell}")
    need(
        t.get("val_per_cell", 0) >= 0,
        f"task.val_per_cell must be >= 0, got {t.get('val_per_cell')}",
    )
    need(t.test_per_cell >= 1, f"task.test_per_cell must be >= 1, got {t.test_per_cell}")
    need(t.max_difficulty >= 0, f"task.max_difficulty must be >= 0, got {t.max_difficulty}")
    need(
        _is_int(c.sampler.top_k) and c.sampler.top_k >= 0,
        f"sampler.top_k must be an int >= 0 (0 = off), got {c.sampler.top_k!r}",
    )
    need(
        c.loss.kl_estimator in KL_ESTIMATORS,
        f"loss.kl_estimator={c.loss.kl_estimator!r} is not one of {KL_ESTIMATORS}",
    )
    need(
        c.dapo.overlong_penalty >= 0,
        f"dapo.overlong_penalty must be >= 0, got {c.dapo.overlong_penalty}",
    )
    need(c.sft.batch_size >= 1, f"sft.batch_size must be >= 1, got {c.sft.batch_size}")
    need(c.sft.warmup_steps >= 0, f"sft.warmup_steps must be >= 0, got {c.sft.warmup_steps}")
    need(c.sft.learning_rate > 0, f"sft.learning_rate must be > 0, got {c.sft.learning_rate}")
    sft_seed = c.sft.get("seed", -1)
    need(
        isinstance(sft_seed, int) and sft_seed >= -1,
        f"sft.seed must be an int >= -1 (-1 = the run's seed), got {sft_seed!r}",
    )
    need(c.wandb.mode in WANDB_MODES, f"wandb.mode={c.wandb.mode!r} is not one of {WANDB_MODES}")


def _validate_estimator_options(c, need) -> None:
    """Every option set (not None) is a keyword the estimator takes."""
    import inspect

    from ebpo_jax import advantages  # the registry; imported late so this module stays light

    try:
        fn = advantages.get(c.estimator)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"estimator={c.estimator!r} is not in the advantages registry ({e})"
        ) from None
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in c.estimator_options.items():
        need(
            value is None or takes_any or name in params,
            f"estimator_options.{name}={value!r}: estimator {c.estimator!r} takes no "
            f"option {name!r}",
        )


def model_max_positions(c) -> int | None:
    """The model's max_position_embeddings as the config gives it (hf config.json or preset)."""
    if c.model.hf_path:
        path = os.path.join(c.model.hf_path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None  # models.hf names the broken file when the task is built
        return c.model.overrides.get("max_position_embeddings", value)
    from ebpo_jax.models.config import PRESETS, ModelConfig

    if c.model.preset not in PRESETS:
        raise ConfigError(f"model.preset={c.model.preset!r} is not one of {sorted(PRESETS)}")
    default = ModelConfig.__dataclass_fields__["max_position_embeddings"].default
    default = PRESETS[c.model.preset].get("max_position_embeddings", default)
    return c.model.overrides.get("max_position_embeddings", default)


def check_positions(config, prompt_len: int, max_positions: int) -> None:
    """ConfigError unless prompt_len + sampler.max_new_tokens fits the model's positions.

    validate() checks what the config alone knows; the synthetic tasks' prompt width is
    known once the problems are built, so their setup calls this with it.
    """
    need_pos = prompt_len + config.sampler.max_new_tokens
    if need_pos > max_positions:
        raise ConfigError(
            f"sampler.max_new_tokens={config.sampler.max_new_tokens}: prompts of {prompt_len} "
            f"tokens + completions need {need_pos} positions, the model has {max_positions} "
            "(model max_position_embeddings)"
        )


def _validate_positions(c) -> None:
    """Prompt + completion within the model's positions (prompt width: data.max_prompt_len,
    or at least one token for the synthetic tasks, whose width is checked at task build)."""
    max_pos = model_max_positions(c)
    if max_pos is None:
        return
    check_positions(c, c.data.max_prompt_len if c.data.path else 1, int(max_pos))


def mesh_devices(config, num_devices: int) -> int:
    """How many devices the mesh spans: `mesh.devices`, or all `num_devices` when it is 0."""
    n = int(config.mesh.get("devices", 0))
    if n < 0 or n > num_devices:
        raise ConfigError(f"mesh.devices={n} must be in [0, {num_devices}] (0 = every device)")
    return n or num_devices


def sampler_mesh_spec(config) -> list[tuple[str, int]]:
    """`sampler.mesh` ("data=8,tp=4") as [(axis, size), ...]; [] = the trainer's mesh."""
    from ebpo_jax.sharding import parse_mesh  # late: this module stays free of jax

    text = config.sampler.get("mesh", "")
    try:
        return parse_mesh(text)
    except ValueError:
        raise ConfigError(f"sampler.mesh={text!r} is not like 'data=8,tp=4'") from None


def mesh_shape(config, num_devices: int) -> tuple[int, ...]:
    """The mesh shape with -1 resolved against the mesh's devices; ConfigError when impossible.

    `num_devices` is every device there is; `mesh.devices` may pick fewer.
    """
    from ebpo_jax.sharding import resolve_shape  # late: this module stays free of jax

    num_devices = mesh_devices(config, num_devices)
    shape, axes = tuple(config.mesh.shape), tuple(config.mesh.axes)
    if len(shape) != len(axes):
        raise ConfigError(f"mesh.shape {shape} and mesh.axes {axes} differ in length")
    try:
        return resolve_shape(shape, num_devices)
    except ValueError as e:
        raise ConfigError(f"mesh.shape: {e}") from None


def _validate_data_and_model(c, need) -> None:
    """Math data vs the synthetic tasks: files exist, and the trainer options they allow."""
    from ebpo_jax.data import DataError
    from ebpo_jax.data.config import validate_data_config

    d, m = c.data, c.model
    if m.hf_path:
        need(
            os.path.isfile(os.path.join(m.hf_path, "config.json")),
            f"model.hf_path={m.hf_path!r} is not a local HF checkpoint folder (no config.json)",
        )
    if m.tokenizer_path:
        need(
            os.path.isdir(m.tokenizer_path),
            f"model.tokenizer_path={m.tokenizer_path!r} is not a local tokenizer folder",
        )
    need(
        not (m.hf_path and m.tokenizer_path),
        "set model.hf_path (weights and tokenizer) or model.tokenizer_path, not both",
    )
    if not d.path:
        need(
            not (m.hf_path or m.tokenizer_path or d.eval_path),
            "model.hf_path, model.tokenizer_path and data.eval_path need data.path "
            "(the synthetic tasks use their own char tokenizer and held-out split)",
        )
        return
    try:
        validate_data_config(d)
    except DataError as e:
        raise ConfigError(str(e)) from None
    need(
        bool(m.hf_path or m.tokenizer_path),
        f"data.path={d.path!r} needs a tokenizer: set model.hf_path or model.tokenizer_path",
    )
    need(
        c.eb_clusters != "cell",
        "eb_clusters='cell' needs the synthetic tasks; with data.path use 'topic' or 'none'",
    )
    # Math answers are verified on the host (jit -> host -> jit), one step per call.
    need(
        c.steps_per_jit == 1,
        f"steps_per_jit={c.steps_per_jit}: data.path is scored by a host reward, so it must be 1",
    )
    need(
        not c.dapo.dynamic_sampling,
        "dapo.dynamic_sampling needs a jittable reward; data.path is scored by a host reward",
    )
    need(
        c.sft.steps == 0,
        f"sft.steps={c.sft.steps}: the SFT warm start is for the synthetic tasks, not data.path",
    )


def _validate_loss_choice(loss, need) -> None:
    """The surrogate's name, the dual clip and the importance-sampling correction."""
    need(
        loss.name in losses.names(),
        f"loss.name={loss.name!r} is not in the policy-loss registry ({', '.join(losses.names())})",
    )
    need(
        loss.dual_clip == 0 or loss.dual_clip > 1,
        f"loss.dual_clip={loss.dual_clip} must be 0 (off) or > 1",
    )
    need(
        loss.is_correction in IS_MODES,
        f"loss.is_correction={loss.is_correction!r} is not one of {IS_MODES}",
    )
    need(loss.is_level in IS_LEVELS, f"loss.is_level={loss.is_level!r} is not one of {IS_LEVELS}")
    need(loss.is_cap >= 1, f"loss.is_cap={loss.is_cap} must be >= 1 (a matched token has weight 1)")
    need(
        0 < loss.is_low <= 1 <= loss.is_high,
        f"loss.is_low={loss.is_low}, loss.is_high={loss.is_high}: need 0 < is_low <= 1 <= is_high",
    )
    need(
        loss.is_correction == "none" or loss.recompute_old_logprobs,
        f"loss.is_correction={loss.is_correction!r} needs loss.recompute_old_logprobs=True "
        "(without it the old log-probs are the sampler's and every weight is 1)",
    )


def _validate_packing(loss, max_new_tokens: int, need) -> None:
    """loss.tokens_per_microbatch / pack_row_len; the prompt width is checked by packing.layout."""
    budget, row = loss.tokens_per_microbatch, loss.pack_row_len
    need(budget >= 0, f"loss.tokens_per_microbatch must be >= 0, got {budget}")
    need(row >= 0, f"loss.pack_row_len must be >= 0, got {row}")
    if budget == 0:
        need(row == 0, f"loss.pack_row_len={row} needs loss.tokens_per_microbatch > 0")
        return
    need(
        loss.num_microbatches == 1,
        f"loss.num_microbatches={loss.num_microbatches}: with loss.tokens_per_microbatch > 0 "
        "the token budget sets the micro-batches; use num_microbatches=1",
    )
    need(
        row == 0 or row > max_new_tokens,
        f"loss.pack_row_len={row} must exceed sampler.max_new_tokens={max_new_tokens}",
    )
    need(
        budget >= max(row, max_new_tokens + 1),
        f"loss.tokens_per_microbatch={budget} must hold one row (loss.pack_row_len, or "
        f"prompt width + sampler.max_new_tokens={max_new_tokens})",
    )


def _validate_turns(c, need) -> None:
    """rollout.max_turns / turn_tokens / env_*: the multi-turn episode's limits."""
    r = c.rollout
    need(
        _is_int(r.max_turns) and r.max_turns >= 1,
        f"rollout.max_turns must be >= 1, got {r.max_turns!r}",
    )
    n = c.sampler.max_new_tokens
    need(
        _is_int(r.turn_tokens) and 0 <= r.turn_tokens <= n,
        f"rollout.turn_tokens={r.turn_tokens!r} must be in [0, sampler.max_new_tokens={n}]",
    )
    need(
        _is_int(r.env_workers) and r.env_workers >= 0,
        f"rollout.env_workers must be >= 0, got {r.env_workers!r}",
    )
    need(r.env_timeout_s > 0, f"rollout.env_timeout_s must be > 0, got {r.env_timeout_s}")


def _validate_staleness(c, need, num_devices) -> None:
    """rollout.max_staleness and sampler.param_dtype: what the one-step-off pipeline needs."""
    s = c.rollout.max_staleness
    need(s in (0, 1), f"rollout.max_staleness={s} must be 0 or 1")
    need(
        c.sampler.param_dtype in SAMPLER_DTYPES,
        f"sampler.param_dtype={c.sampler.param_dtype!r} is not one of {SAMPLER_DTYPES}",
    )
    need(
        not (c.sampler.param_dtype and c.steps_per_jit != 1),
        f"sampler.param_dtype={c.sampler.param_dtype!r} needs steps_per_jit=1",
    )
    if s == 0:
        return
    need(
        c.steps_per_jit == 1,
        f"rollout.max_staleness=1 needs steps_per_jit=1, got {c.steps_per_jit}",
    )
    sampler = sampler_mesh_spec(c)
    need(
        bool(sampler),
        "rollout.max_staleness=1 needs sampler.mesh (e.g. 'data=4'): the sampler runs on the "
        "devices after the trainer's",
    )
    if num_devices is not None:
        trainer = mesh_devices(c, num_devices)
        sizes = [n for _, n in sampler]
        rest = num_devices - trainer
        samp = rest if -1 in sizes else math.prod(sizes)
        need(
            0 < samp <= rest,
            f"rollout.max_staleness=1: mesh.devices={trainer} + sampler.mesh={c.sampler.mesh!r} "
            f"need more than the {num_devices} devices (set mesh.devices to the trainer's share)",
        )


def _validate_lora(lc, need) -> None:
    """model.lora: rank >= 0, alpha > 0, known targets and base dtype."""
    from ebpo_jax.models import lora  # late: this module stays free of jax

    rank = lc.rank
    need(
        isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0,
        f"model.lora.rank must be an int >= 0 (0 = off), got {rank!r}",
    )
    need(lc.alpha > 0, f"model.lora.alpha must be > 0, got {lc.alpha}")
    targets = [t.strip() for t in str(lc.targets).split(",") if t.strip()]
    bad = sorted(set(targets) - set(lora.TARGETS)) or sorted(
        {t for t in targets if targets.count(t) > 1}
    )
    need(
        bool(targets) and not bad,
        f"model.lora.targets={lc.targets!r}: unknown or repeated {bad}; "
        f"expected a comma-separated subset of {','.join(lora.TARGETS)}",
    )
    need(
        lc.base_dtype in lora.BASE_DTYPES,
        f"model.lora.base_dtype={lc.base_dtype!r} is not one of {lora.BASE_DTYPES}",
    )


def _validate_slots(c, shape, need):
    """Continuous batching splits slots and each call's prompts over the data shards."""
    slots = c.sampler.get("slots", 0)
    if not slots:
        return
    spec = sampler_mesh_spec(c) or list(zip(c.mesh.axes, shape))
    shards = math.prod(n for axis, n in spec if axis in ("data", "fsdp"))
    per_call = c.sampler.prompts_per_call or c.prompts_per_step
    need(
        slots % shards == 0 and per_call % shards == 0,
        f"sampler.slots={slots} and the {per_call} prompts per sampler call must be multiples "
        f"of the sampler mesh's {shards} data shards",
    )


def _validate_pages(s, need):
    """sampler.page_size and sampler.kv_pages (whether one row fits is checked per call)."""
    ps, pages = s.get("page_size", 16), s.get("kv_pages", 0)
    need(_is_int(ps) and ps >= 1, f"sampler.page_size={ps!r} must be an int >= 1")
    need(
        _is_int(pages) and pages >= 0,
        f"sampler.kv_pages={pages!r} must be an int >= 0 (0 = enough for every slot)",
    )


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Raise ConfigError (one line) on a misspelt field or an impossible value."""
    unknown = _unknown_fields(config, default_config())
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
    missing = [k for k in default_config().keys() if k not in config]  # noqa: SIM118
    if missing:
        raise ConfigError(f"missing config field(s): {', '.join(missing)}")

    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)

    c, loss = config, config.loss
    _validate_values(c, need)
    need(c.group_size >= 1, f"group_size must be >= 1, got {c.group_size}")
    need(c.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {c.prompts_per_step}")
    need(c.total_steps >= 0, f"total_steps must be >= 0, got {c.total_steps}")
    need(loss.ppo_epochs >= 1, f"loss.ppo_epochs must be >= 1, got {loss.ppo_epochs}")
    need(
        loss.num_minibatches >= 1, f"loss.num_minibatches must be >= 1, got {loss.num_minibatches}"
    )
    need(
        loss.num_microbatches >= 1,
        f"loss.num_microbatches must be >= 1, got {loss.num_microbatches}",
    )
    need(
        c.prompts_per_step % loss.num_minibatches == 0,
        f"prompts_per_step={c.prompts_per_step} is not divisible by loss.num_minibatches={loss.num_minibatches}",
    )
    per_mb = c.prompts_per_step // loss.num_minibatches
    need(
        per_mb % loss.num_microbatches == 0,
        f"prompts per mini-batch ({per_mb}) is not divisible by loss.num_microbatches={loss.num_microbatches}",
    )
    n = c.sampler.max_new_tokens
    need(
        loss.logits_chunk >= 0 and (loss.logits_chunk == 0 or n % loss.logits_chunk == 0),
        f"loss.logits_chunk={loss.logits_chunk} must be 0 or divide sampler.max_new_tokens={n}",
    )
    need(loss.agg in AGG_MODES, f"loss.agg={loss.agg!r} is not one of {AGG_MODES}")
    _validate_loss_choice(loss, need)
    _validate_packing(loss, n, need)
    need(loss.kl_coef >= 0, f"loss.kl_coef must be >= 0, got {loss.kl_coef}")
    need(loss.clip_low >= 0 and loss.clip_high >= 0, "loss.clip_low/clip_high must be >= 0")
    need(
        c.optimizer.schedule in SCHEDULES,
        f"optimizer.schedule={c.optimizer.schedule!r} is not one of {SCHEDULES}",
    )
    need(
        c.optimizer.learning_rate > 0,
        f"optimizer.learning_rate must be > 0, got {c.optimizer.learning_rate}",
    )
    need(
        c.sampler.max_new_tokens >= 1,
        f"sampler.max_new_tokens must be >= 1, got {c.sampler.max_new_tokens}",
    )
    need(
        c.sampler.temperature > 0,
        f"sampler.temperature must be > 0 for training, got {c.sampler.temperature}",
    )
    need(0 < c.sampler.top_p <= 1, f"sampler.top_p must be in (0, 1], got {c.sampler.top_p}")
    k = c.steps_per_jit
    need(k >= 1, f"steps_per_jit must be >= 1, got {k}")
    for name in ("checkpoint_every", "eval_every"):
        need(
            c[name] >= 1 and c[name] % k == 0,
            f"{name}={c[name]} must be a positive multiple of steps_per_jit={k}",
        )
    need(
        c.total_steps % k == 0,
        f"total_steps={c.total_steps} must be a multiple of steps_per_jit={k}",
    )
    need(c.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {c.keep_checkpoints}")
    need(
        c.max_nonfinite_steps >= 1, f"max_nonfinite_steps must be >= 1, got {c.max_nonfinite_steps}"
    )
    need(
        c.dapo.max_extra_rounds >= 0,
        f"dapo.max_extra_rounds must be >= 0, got {c.dapo.max_extra_rounds}",
    )
    need(
        0 <= c.dapo.overlong_buffer < c.sampler.max_new_tokens,
        f"dapo.overlong_buffer={c.dapo.overlong_buffer} must be in [0, sampler.max_new_tokens)",
    )
    need(
        c.eb_clusters in ("none", "topic", "cell"),
        f"eb_clusters={c.eb_clusters!r} is not one of none, topic, cell",
    )
    need(c.eval_temperature >= 0, f"eval_temperature must be >= 0, got {c.eval_temperature}")
    need(c.eval_samples >= 1, f"eval_samples must be >= 1, got {c.eval_samples}")
    need(c.task.order in ("naive", "topic", "difficulty"), f"task.order={c.task.order!r} unknown")
    need(c.sft.steps >= 0, f"sft.steps must be >= 0, got {c.sft.steps}")
    per_call = c.sampler.prompts_per_call
    need(
        per_call >= 0 and (per_call == 0 or c.prompts_per_step % per_call == 0),
        f"sampler.prompts_per_call={per_call} must be 0 (all at once) or divide "
        f"prompts_per_step={c.prompts_per_step} (each round of P prompts is chunked)",
    )
    need(
        not (sampler_mesh_spec(c) and k != 1),
        f"sampler.mesh={c.sampler.mesh!r} needs steps_per_jit=1 (the K-step scan samples on "
        "the trainer's mesh)",
    )
    slots = c.sampler.get("slots", 0)
    need(
        isinstance(slots, int) and slots >= 0,
        f"sampler.slots={slots!r} must be an int >= 0 (0 = the static batch)",
    )
    _validate_pages(c.sampler, need)
    _validate_data_and_model(c, need)
    _validate_positions(c)
    _validate_estimator_options(c, need)
    _validate_staleness(c, need, num_devices)
    _validate_turns(c, need)
    _validate_lora(c.model.lora, need)
    if num_devices is not None:
        shape = mesh_shape(c, num_devices)
        batch = c.prompts_per_step * c.group_size
        need(
            batch % math.prod(shape) == 0,
            f"P*G={batch} rollouts do not split over the {math.prod(shape)}-device mesh",
        )
        _validate_slots(c, shape, need)
