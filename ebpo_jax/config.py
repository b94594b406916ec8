"""Training config schema and validation: bad fields are one-line errors before any compile."""

import math
import os

import ml_collections

from ebpo_jax.data.config import data_config

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
    """A training config field is missing, misspelt or impossible."""


def default_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with defaults; config files start from this."""
    c = ml_collections.ConfigDict()
    c.workdir = "/tmp/ebpo_runs/run"
    c.seed = 0
    c.total_steps = 100
    c.prompts_per_step = 32  # P
    c.group_size = 8  # G
    c.estimator = "ebpo"  # any name in ebpo_jax.advantages' registry
    c.estimator_options = ml_collections.ConfigDict()  # keyword options for the estimator
    # EB priors: none (one global) | topic | cell (topic x difficulty; synthetic tasks only)
    c.eb_clusters = "none"
    c.checkpoint_every = 50
    c.keep_checkpoints = 3
    c.eval_every = 50
    c.eval_batch_size = 128
    # eval/pass@1 = mean reward over eval_samples samples per held-out problem at this
    # temperature (the paper's protocol: temperature 1.0); 0.0 = greedy, one sample.
    c.eval_temperature = 1.0
    c.eval_samples = 4
    c.steps_per_jit = 1  # K steps per lax.scan; 1 = jit -> host -> jit with per-phase timing
    c.max_nonfinite_steps = 5  # stop after this many non-finite steps in a row
    c.log_every = 1

    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"
    c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields, e.g. num_layers
    # A local HF checkpoint folder: weights (models.from_hf) and tokenizer; the preset is
    # unused and overrides may only change non-shape fields (dtype, remat, attention, ...).
    c.model.hf_path = ""
    # A local HF tokenizer folder for a randomly initialised preset (vocab from the tokenizer).
    c.model.tokenizer_path = ""

    # Math data (ebpo_jax.data); path "" = the synthetic arithmetic tasks of `task` below.
    c.data = data_config()

    c.task = ml_collections.ConfigDict()
    c.task.topics = ""  # comma-separated topic names; "" = every topic
    c.task.max_difficulty = 0  # 0 = every level
    c.task.seed = 0  # problem generation (the held-out split depends only on this)
    c.task.train_per_cell = 400
    c.task.test_per_cell = 20  # held-out problems per (topic, difficulty) cell
    c.task.order = "naive"  # naive | topic | difficulty (EBPO-naive/topic/diff curricula)

    c.sampler = ml_collections.ConfigDict()
    c.sampler.max_new_tokens = 16
    c.sampler.temperature = 1.0
    c.sampler.top_p = 1.0
    c.sampler.top_k = 0
    # Prompts per sampler call: 0 = all of a round's P prompts at once; else the rollout
    # generates P / prompts_per_call chunks one after another, so the KV cache is per chunk.
    c.sampler.prompts_per_call = 0
    c.sampler.mesh = ""  # e.g. "data=8,tp=4" (AOT report); "" = the trainer's mesh
    # Decode slots per sampler call: 0 = every row of the call decodes as one static batch
    # until the longest ends; S > 0 = continuous batching, S rows at a time, a slot refilled
    # as soon as its row ends. A multiple of the sampler mesh's data shards.
    c.sampler.slots = 0

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-6
    c.optimizer.weight_decay = 0.01
    c.optimizer.warmup_steps = 0  # in train steps
    c.optimizer.schedule = "constant"  # or "cosine" (decays to final_lr_frac over total_steps)
    c.optimizer.final_lr_frac = 0.1
    c.optimizer.clip_norm = 1.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.999

    c.loss = ml_collections.ConfigDict()
    c.loss.ppo_epochs = 1
    c.loss.num_minibatches = 1  # per PPO epoch; splits the P prompts
    c.loss.num_microbatches = 1  # gradient accumulation within a mini-batch
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.2
    c.loss.dual_clip = 0.0  # 0 = off
    c.loss.agg = "token-mean"
    c.loss.kl_coef = 0.0
    c.loss.kl_estimator = "k3"
    c.loss.entropy_coef = 0.0
    c.loss.logits_chunk = 0  # >0: completion logits in chunks of this many positions (big vocab)

    c.dapo = ml_collections.ConfigDict()
    c.dapo.dynamic_sampling = False  # drop all-equal groups, refill from further prompts
    c.dapo.max_extra_rounds = 2
    c.dapo.overlong_buffer = (
        0  # tokens before max_new_tokens where the soft penalty starts; 0 = off
    )
    c.dapo.overlong_penalty = 1.0
    c.dapo.mask_truncated = False  # no loss on responses cut at max_new_tokens

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # 0 = no warm start
    c.sft.batch_size = 64
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 20
    c.sft.cache_dir = ""  # "" = <workdir>/sft_cache

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1,)  # -1 = the remaining devices
    c.mesh.axes = ("data",)
    # 0 = the mesh spans every device (pods); n = the first n devices of this single process
    # (tests compare a 1-device run with an 8-device one on the same 8 fake CPU devices).
    c.mesh.devices = 0
    return c


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Lock a config so that assigning a misspelt field raises."""
    config.lock()
    return config


def _is_closed_dict(x) -> bool:
    """A schema sub-dict whose keys are fixed (the empty ones hold free-form options)."""
    return isinstance(x, ml_collections.ConfigDict) and bool(len(x))


def _unknown_fields(config, schema, prefix=""):
    """Dotted names present in config but not in schema (open dicts excepted)."""
    out = []
    for key in config.keys():  # noqa: SIM118 (ConfigDict)
        name = prefix + key
        if key not in schema:
            out.append(name)
        elif _is_closed_dict(schema[key]) and isinstance(config[key], ml_collections.ConfigDict):
            out += _unknown_fields(config[key], schema[key], name + ".")
    return out


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
    num_devices = mesh_devices(config, num_devices)
    shape = tuple(int(s) for s in config.mesh.shape)
    axes = tuple(config.mesh.axes)
    if len(shape) != len(axes):
        raise ConfigError(f"mesh.shape {shape} and mesh.axes {axes} differ in length")
    if sum(s == -1 for s in shape) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"mesh.shape {shape}: entries must be positive, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ConfigError(f"mesh.shape {shape} does not divide the {num_devices} devices")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"mesh.shape {shape} needs {math.prod(shape)} devices, found {num_devices}"
        )
    return shape


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
    need(loss.agg in LOSS_AGGS, f"loss.agg={loss.agg!r} is not one of {LOSS_AGGS}")
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
    sampler_mesh_spec(c)
    slots = c.sampler.get("slots", 0)
    need(
        isinstance(slots, int) and slots >= 0,
        f"sampler.slots={slots!r} must be an int >= 0 (0 = the static batch)",
    )
    _validate_data_and_model(c, need)

    from ebpo_jax import advantages  # the registry; imported late so this module stays light

    try:
        advantages.get(c.estimator)
    except (KeyError, ValueError) as e:
        raise ConfigError(
            f"estimator={c.estimator!r} is not in the advantages registry ({e})"
        ) from None
    if num_devices is not None:
        shape = mesh_shape(c, num_devices)
        batch = c.prompts_per_step * c.group_size
        need(
            batch % math.prod(shape) == 0,
            f"P*G={batch} rollouts do not split over the {math.prod(shape)}-device mesh",
        )
        _validate_slots(c, shape, need)
