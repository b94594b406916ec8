"""The checks that need several config sections, in one place: each a one-line ConfigError.

A single field's range is its `check` in `ebpo_jax.schema`; what the data or the model turn
out to hold at run time is checked where they are read. `check(config, num_devices)` runs
every rule here over a parsed `schema.Config`, after `derive` has asked the modules that own
the sampler's mesh, the attention kernel and the estimator's options once (`Derived`).
"""

import inspect
import json
import math
import os
from typing import NamedTuple

from ebpo_jax.schema import Config, ConfigError


def need(ok, msg: str) -> None:
    """ConfigError(msg) unless ok."""
    if not ok:
        raise ConfigError(msg)


def mesh_devices(c: Config, num_devices: int) -> int:
    """How many devices the mesh spans: `mesh.devices`, or all `num_devices` when it is 0."""
    n = int(c.mesh.devices)
    if n < 0 or n > num_devices:
        raise ConfigError(f"mesh.devices={n} must be in [0, {num_devices}] (0 = every device)")
    return n or num_devices


class Derived(NamedTuple):
    """What the rules read besides the sections, asked once of the modules that know it."""

    sampler_mesh: tuple[tuple[str, int], ...]  # sampler.mesh parsed; () = the trainer's mesh
    splash: bool  # the model's full-sequence attention is splash
    estimator_options: dict  # estimator_options as the estimator's keywords (None = unset)
    mesh_shape: tuple[int, ...] | None = None  # -1 resolved, once the device count is known


def derive(c: Config, num_devices: int | None = None) -> Derived:
    """The meshes (the trainer's once the device count is known), the attention kernel and
    the estimator's options, each asked once.

    Splash is `model.overrides.attention`, or "auto" once the run has its devices (the
    platform's kernel); False when that is not known yet. `num_devices` is every device
    there is; `mesh.devices` may pick fewer.
    """
    from ebpo_jax.models import attention  # late: this module stays free of jax
    from ebpo_jax.sharding import parse_mesh, resolve_shape

    devices = None if num_devices is None else mesh_devices(c, num_devices)
    shape, axes = c.mesh.shape, c.mesh.axes
    need(len(shape) == len(axes), f"mesh.shape {shape} and mesh.axes {axes} differ in length")
    try:
        sampler = tuple(parse_mesh(c.sampler.mesh))
    except ValueError:
        raise ConfigError(f"sampler.mesh={c.sampler.mesh!r} is not like 'data=8,tp=4'") from None
    try:
        shape = None if devices is None else resolve_shape(shape, devices)
    except ValueError as e:
        raise ConfigError(f"mesh.shape: {e}") from None
    attention_name = c.model.overrides.get("attention", "xla")
    if attention_name == "auto" and num_devices is not None:
        attention_name = attention.resolve(attention_name)
    splash = attention_name == "splash"
    return Derived(sampler, splash, c.estimator_options.as_kwargs(), shape)


def model_setting(c: Config, name: str, hf_names: tuple[str, ...] = (), hf_absent=None):
    """ModelConfig field `name` as the config gives it: model.overrides, else the HF
    checkpoint's config.json (its first key of `hf_names`, default `name`; `hf_absent` when it
    has none, None when it cannot be read) or the preset's value, else the field's default."""
    m = c.model
    if name in m.overrides:
        return m.overrides[name]
    if m.hf_path:
        from ebpo_jax.runtime import storage  # late: gs:// clients only when a path needs them

        try:
            hf = json.loads(storage.read_text(os.path.join(m.hf_path, "config.json")))
            return next((hf[k] for k in hf_names or (name,) if k in hf), hf_absent)
        except (OSError, ValueError, AttributeError, TypeError):
            return None  # models.hf names the broken file when the task is built
    from ebpo_jax.models.config import PRESETS, ModelConfig

    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset={m.preset!r} is not one of {sorted(PRESETS)}")
    return PRESETS[m.preset].get(name, ModelConfig.__dataclass_fields__[name].default)


def model_max_positions(c: Config) -> int | None:
    """The model's max_position_embeddings as the config gives it (hf config.json or preset)."""
    return model_setting(c, "max_position_embeddings")


def _overrides(c: Config) -> None:
    """model.overrides names ModelConfig fields only."""
    from ebpo_jax.models.config import ModelConfig  # late: this module stays free of jax

    fields = sorted(ModelConfig.__dataclass_fields__)
    bad = sorted(set(c.model.overrides) - set(fields))
    need(not bad, f"model.overrides: unknown ModelConfig field(s) {bad}; known: {fields}")


def check_positions(max_new_tokens: int, prompt_len: int, max_positions: int) -> None:
    """ConfigError unless prompt_len + sampler.max_new_tokens fits the model's positions."""
    need_pos = prompt_len + max_new_tokens
    if need_pos > max_positions:
        raise ConfigError(
            f"sampler.max_new_tokens={max_new_tokens}: prompts of {prompt_len} "
            f"tokens + completions need {need_pos} positions, the model has {max_positions} "
            "(model max_position_embeddings)"
        )


def _positions(c: Config) -> None:
    """Prompt + completion within the model's positions (prompt width: data.max_prompt_len,
    or at least one token for the synthetic tasks, whose width is checked at task build)."""
    max_pos = model_max_positions(c)
    if max_pos is not None:
        prompt_len = c.data.max_prompt_len if c.data.path else 1
        check_positions(c.sampler.max_new_tokens, prompt_len, int(max_pos))


def _batch_split(c: Config) -> None:
    """P prompts over mini-batches, micro-batches and sampler calls; logits chunks over N."""
    run, loss, n = c.run, c.loss, c.sampler.max_new_tokens
    need(
        run.prompts_per_step % loss.num_minibatches == 0,
        f"prompts_per_step={run.prompts_per_step} is not divisible by "
        f"loss.num_minibatches={loss.num_minibatches}",
    )
    per_mb = run.prompts_per_step // loss.num_minibatches
    need(
        per_mb % loss.num_microbatches == 0,
        f"prompts per mini-batch ({per_mb}) is not divisible by "
        f"loss.num_microbatches={loss.num_microbatches}",
    )
    need(
        loss.logits_chunk >= 0 and (loss.logits_chunk == 0 or n % loss.logits_chunk == 0),
        f"loss.logits_chunk={loss.logits_chunk} must be 0 or divide sampler.max_new_tokens={n}",
    )
    per_call = c.sampler.prompts_per_call
    need(
        per_call >= 0 and (per_call == 0 or run.prompts_per_step % per_call == 0),
        f"sampler.prompts_per_call={per_call} must be 0 (all at once) or divide "
        f"prompts_per_step={run.prompts_per_step} (each round of P prompts is chunked)",
    )
    need(
        0 <= c.dapo.overlong_buffer < n,
        f"dapo.overlong_buffer={c.dapo.overlong_buffer} must be in [0, sampler.max_new_tokens)",
    )


def _steps(c: Config, d: Derived) -> None:
    """Checkpoints, evaluations and the run's end fall on K-step boundaries."""
    run = c.run
    k = run.steps_per_jit
    for name in ("checkpoint_every", "eval_every"):
        every = getattr(run, name)
        need(
            every >= 1 and every % k == 0,
            f"{name}={every} must be a positive multiple of steps_per_jit={k}",
        )
    need(
        run.total_steps % k == 0,
        f"total_steps={run.total_steps} must be a multiple of steps_per_jit={k}",
    )
    need(
        not (d.sampler_mesh and k != 1),
        f"sampler.mesh={c.sampler.mesh!r} needs steps_per_jit=1 (the K-step scan samples on "
        "the trainer's mesh)",
    )


def _loss_choice(c: Config) -> None:
    """The surrogate's name and the importance-sampling correction."""
    from ebpo_jax import losses  # late: the registry imports jax

    loss = c.loss
    need(
        loss.name in losses.names(),
        f"loss.name={loss.name!r} is not in the policy-loss registry ({', '.join(losses.names())})",
    )
    need(
        0 < loss.is_low <= 1 <= loss.is_high,
        f"loss.is_low={loss.is_low}, loss.is_high={loss.is_high}: need 0 < is_low <= 1 <= is_high",
    )
    need(
        loss.is_correction == "none" or loss.recompute_old_logprobs,
        f"loss.is_correction={loss.is_correction!r} needs loss.recompute_old_logprobs=True "
        "(without it the old log-probs are the sampler's and every weight is 1)",
    )
    need(
        loss.clip_cov_lb < loss.clip_cov_ub,
        f"loss.clip_cov_lb={loss.clip_cov_lb} must be below loss.clip_cov_ub={loss.clip_cov_ub}",
    )


def _batch_invariant(c: Config) -> None:
    """model.batch_invariant: the sampler's log-probs are the old ones (trainer/update.py's
    exact_on_policy), so the recompute, IS weights and routing replay are redundant; the
    sampler must run the trainer's very weights."""
    if not c.model.batch_invariant:
        return
    on = "model.batch_invariant=True"
    need(
        not c.loss.recompute_old_logprobs,
        f"{on}: loss.recompute_old_logprobs=True is redundant (the sampler's log-probs equal "
        "the trainer's; mismatch/* comes from the first mini-batch); set it False",
    )
    need(
        c.loss.is_correction == "none",
        f"{on}: loss.is_correction={c.loss.is_correction!r} is redundant (every weight is "
        "exactly 1); set it 'none'",
    )
    need(
        not c.model.moe.routing_replay,
        f"{on}: model.moe.routing_replay=True is redundant (the trainer routes as the sampler "
        "did); set it False",
    )
    dtype = c.sampler.param_dtype
    need(
        dtype in ("", model_setting(c, "param_dtype")),
        f"{on}: sampler.param_dtype={dtype!r} samples with other weights than the trainer's; "
        "set it ''",
    )
    need(
        c.sampler.kv_dtype == "",
        f"{on}: sampler.kv_dtype={c.sampler.kv_dtype!r} samples from rounded keys and values, "
        "the trainer from exact ones; set it ''",
    )
    need(
        c.model.lora.rank == 0,
        f"{on}: model.lora.rank={c.model.lora.rank}: the sampler runs the merged weights, the "
        "trainer the adapters; their log-probs differ",
    )


def _packing(c: Config) -> None:
    """loss.tokens_per_microbatch / pack_row_len; the prompt width is checked by packing.layout."""
    loss, max_new_tokens = c.loss, c.sampler.max_new_tokens
    budget, row = loss.tokens_per_microbatch, loss.pack_row_len
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


def _data_and_model(c: Config) -> None:
    """Math data vs the synthetic tasks: files exist, and the trainer options they allow."""
    from ebpo_jax.data import DataError
    from ebpo_jax.data.config import validate_data_config

    d, m = c.data, c.model
    if m.hf_path:
        from ebpo_jax.runtime import storage

        need(
            storage.isfile(os.path.join(m.hf_path, "config.json")),
            f"model.hf_path={m.hf_path!r} is not an HF checkpoint folder (no config.json)",
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
    _math_trainer(c)
    try:
        validate_data_config(d)
    except DataError as e:
        raise ConfigError(str(e)) from None


def _difficulty_file(c: Config) -> None:
    """A difficulty file orders the generated tasks; math records carry their own."""
    f = c.task.difficulty_file
    if not f:
        return
    need(
        not c.data.path,
        f"task.difficulty_file={f!r} is for the generated tasks; math records carry their "
        "difficulty (experiments/estimate_difficulty.py --data, data.order)",
    )
    from ebpo_jax.runtime import storage

    need(f == "auto" or storage.exists(f), f"task.difficulty_file={f!r}: no such file")


def _sft_export(c: Config) -> None:
    """A grid's warm starts go to a local folder, committed with its results."""
    from ebpo_jax.runtime import storage

    f = c.sft.export_dir
    need(
        not (f and storage.is_remote(f)),
        f"sft.export_dir={f!r}: warm starts are exported to a local folder (a grid's "
        "warm_starts/, committed with its results), not to object storage",
    )


def _math_trainer(c: Config) -> None:
    """The trainer options math records allow (a host reward, their own tokenizer)."""
    m, d = c.model, c.data
    need(
        bool(m.hf_path or m.tokenizer_path),
        f"data.path={d.path!r} needs a tokenizer: set model.hf_path or model.tokenizer_path",
    )
    need(
        c.run.eb_clusters != "cell",
        "eb_clusters='cell' needs the synthetic tasks; with data.path use 'topic' or 'none'",
    )
    _host_steps(c.run.steps_per_jit, "data.path is scored by a host reward")
    _host_dynamic_sampling(c, "data.path is scored by a host reward")
    need(
        c.sft.steps == 0,
        f"sft.steps={c.sft.steps}: the SFT warm start is for the synthetic tasks, not data.path",
    )


def _host_steps(steps_per_jit: int, why: str) -> None:
    """What runs on the host between two jits (jit -> host -> jit) needs one step per call."""
    need(steps_per_jit == 1, f"steps_per_jit={steps_per_jit}: {why}, so it must be 1")


def host_reward_steps(steps_per_jit: int) -> None:
    """train(host_reward=...): a Python reward on host arrays, one step per call."""
    _host_steps(steps_per_jit, "a host_reward scores each rollout on the host")


def _host_dynamic_sampling(c: Config, why: str) -> None:
    """DAPO's refill rounds scored on the host (trainer/refill.py) run in the K = 1 runner."""
    need(
        not (c.dapo.dynamic_sampling and c.rollout.max_staleness),
        f"dapo.dynamic_sampling with rollout.max_staleness={c.rollout.max_staleness}: {why}, "
        "so its refill rounds need max_staleness=0",
    )


def _estimator_options(c: Config, d: Derived) -> None:
    """Every option set (not None) is a keyword the estimator takes."""
    from ebpo_jax import advantages  # the registry; imported late so this module stays light

    name = c.run.estimator
    try:
        fn = advantages.get(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"estimator={name!r} is not in the advantages registry ({e})") from None
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for option, value in sorted(d.estimator_options.items()):
        need(
            value is None or takes_any or option in params,
            f"estimator_options.{option}={value!r}: estimator {name!r} takes no option {option!r}",
        )


def _staleness(c: Config, d: Derived, num_devices: int | None) -> None:
    """rollout.max_staleness and sampler.param_dtype: what the one-step-off pipeline needs."""
    k = c.run.steps_per_jit
    need(
        not (c.sampler.param_dtype and k != 1),
        f"sampler.param_dtype={c.sampler.param_dtype!r} needs steps_per_jit=1",
    )
    if c.rollout.max_staleness == 0:
        return
    need(k == 1, f"rollout.max_staleness=1 needs steps_per_jit=1, got {k}")
    sampler = d.sampler_mesh
    need(
        bool(sampler),
        "rollout.max_staleness=1 needs sampler.mesh (e.g. 'data=4'): the sampler runs on the "
        "devices after the trainer's",
    )
    if num_devices is not None:
        import jax  # late: this module stays free of jax; the run has its devices by now

        need(
            jax.process_count() == 1,
            f"rollout.max_staleness=1 runs in one process only, not {jax.process_count()}",
        )
        trainer = mesh_devices(c, num_devices)
        sizes = [n for _, n in sampler]
        rest = num_devices - trainer
        samp = rest if -1 in sizes else math.prod(sizes)
        need(
            0 < samp <= rest,
            f"rollout.max_staleness=1: mesh.devices={trainer} + sampler.mesh={c.sampler.mesh!r} "
            f"need more than the {num_devices} devices (set mesh.devices to the trainer's share)",
        )


# The task families whose rollouts are episodes with an environment (trainer.task_multiturn).
MULTI_TURN_FAMILIES = ("calculator", "guess")


def _turns(c: Config) -> None:
    """rollout.turn_tokens within the episode's budget; a multi-turn family's settings."""
    t, n = c.rollout.turn_tokens, c.sampler.max_new_tokens
    need(
        isinstance(t, int) and 0 <= t <= n,
        f"rollout.turn_tokens={t!r} must be in [0, sampler.max_new_tokens={n}]",
    )
    with_env = c.task.family in MULTI_TURN_FAMILIES or bool(c.task.env)
    need(
        with_env or c.rollout.max_turns == 1,
        f"rollout.max_turns={c.rollout.max_turns} needs an environment: set task.env or a "
        f"multi-turn task.family {MULTI_TURN_FAMILIES}",
    )
    if not with_env:
        return
    what = f"task.env={c.task.env!r}" if c.task.env else f"task.family={c.task.family!r}"
    need(c.rollout.max_turns >= 2, f"{what} is multi-turn: set rollout.max_turns >= 2")
    _host_steps(c.run.steps_per_jit, f"{what} runs its episodes on the host")
    _host_dynamic_sampling(c, f"{what} runs its episodes on the host")
    _turn_sampler(c, what)


def _turn_sampler(c: Config, what: str) -> None:
    """The sampler and MoE settings the turn loop cannot honour (tasks/episodes.py)."""
    need(
        not c.model.moe.routing_replay,
        f"model.moe.routing_replay: {what} records no experts (an episode's tokens come from "
        "several sampler calls); set it False",
    )
    if not c.rollout.keep_kv:
        return  # each turn is a `generate` call: slots and pages as in a single-turn run
    for name in ("slots", "kv_pages"):
        value = getattr(c.sampler, name)
        need(
            value == 0,
            f"sampler.{name}={value}: {what} keeps each row's KV pages across turns "
            "(rollout.keep_kv), which needs every row at once with its pages reserved (0); "
            "set rollout.keep_kv=False for turns that re-prefill with it",
        )


def _policy_experts(c: Config, key: str) -> int:
    """The policy's num_experts (None: its config.json unreadable); ConfigError naming `key`
    when it has none."""
    experts = model_setting(c, "num_experts", ("num_experts", "num_local_experts"), 0)
    source = (
        f"model.hf_path={c.model.hf_path!r}"
        if c.model.hf_path
        else f"model.preset={c.model.preset!r}"
    )
    need(experts != 0, f"{key} needs a mixture-of-experts policy: {source} has no experts")
    return experts


def _replay_model(c: Config) -> None:
    """Routing replay records and replays experts: the policy must have some."""
    if c.model.moe.routing_replay:
        _policy_experts(c, "model.moe.routing_replay")


def _replay_attention(c: Config, d: Derived) -> None:
    """Routing replay through a padded forward (the padded update, the old-log-prob recompute)
    needs a model attention that takes the recorded experts: not splash."""
    loss = c.loss
    padded = loss.tokens_per_microbatch == 0 or loss.recompute_old_logprobs
    name = c.model.overrides.get("attention", "xla")
    need(
        not (c.model.moe.routing_replay and padded and d.splash),
        f"model.moe.routing_replay with model.overrides.attention={name!r} (splash): the padded "
        "forward (loss.tokens_per_microbatch=0 or loss.recompute_old_logprobs) needs 'xla' or "
        "'cudnn'",
    )


def _splash_widths(c: Config, d: Derived) -> None:
    """Splash runs over the prompt width (the sampler's prefill) and prompt + completion (the
    update): each at most a block or a multiple of it (math records: data.max_prompt_len)."""
    if not (c.data.path and d.splash):
        return
    from ebpo_jax.models.splash import BLOCK  # Pallas TPU import, only when asked for

    prompt = c.data.max_prompt_len
    for name, width in (
        ("data.max_prompt_len", prompt),
        ("data.max_prompt_len + sampler.max_new_tokens", prompt + c.sampler.max_new_tokens),
    ):
        need(
            width <= BLOCK or width % BLOCK == 0,
            f"{name} = {width}: attention 'splash' needs at most {BLOCK} tokens or a multiple "
            f"of {BLOCK}",
        )


def _lora_targets(c: Config) -> None:
    """model.lora.targets: a comma-separated subset of models.lora.TARGETS, none repeated."""
    from ebpo_jax.models import lora  # late: this module stays free of jax

    lc = c.model.lora
    targets = [t.strip() for t in str(lc.targets).split(",") if t.strip()]
    bad = sorted(set(targets) - set(lora.TARGETS)) or sorted(
        {t for t in targets if targets.count(t) > 1}
    )
    need(
        bool(targets) and not bad,
        f"model.lora.targets={lc.targets!r}: unknown or repeated {bad}; "
        f"expected a comma-separated subset of {','.join(lora.TARGETS)}",
    )


def _devices(c: Config, d: Derived) -> None:
    """The rollout batch and continuous batching's slots split over the mesh's data shards."""
    shape = d.mesh_shape
    batch = c.run.prompts_per_step * c.run.group_size
    need(
        batch % math.prod(shape) == 0,
        f"P*G={batch} rollouts do not split over the {math.prod(shape)}-device mesh",
    )
    spec = d.sampler_mesh or tuple(zip(c.mesh.axes, shape, strict=True))
    shards = math.prod(n for axis, n in spec if axis in ("data", "fsdp"))
    row_shards = shards * (dict(spec).get("tp", 1) if c.sampler.dp_attention else 1)
    per_call = c.sampler.prompts_per_call or c.run.prompts_per_step
    need(
        not c.sampler.dp_attention or per_call * c.run.group_size % row_shards == 0,
        f"sampler.dp_attention: the {per_call} x {c.run.group_size} rows of a sampler call "
        f"must split over the sampler mesh's {row_shards} data x tp chips",
    )
    pages = c.sampler.kv_pages
    need(
        pages % row_shards == 0,
        f"sampler.kv_pages={pages} must be a multiple of the sampler mesh's {row_shards} row "
        "shards (each holds its share of the pages)",
    )
    slots = c.sampler.slots
    if not slots:
        return
    need(
        slots % row_shards == 0 and per_call % shards == 0,
        f"sampler.slots={slots} and the {per_call} prompts per sampler call must be multiples "
        f"of the sampler mesh's {row_shards} row shards and {shards} data shards",
    )


def _context(c: Config) -> None:
    """Context parallelism (a `context` mesh axis): packed rows split into 2 x context chunks,
    and attention that orders keys by slot (XLA; splash masks by array order only)."""
    sizes = dict(zip(c.mesh.axes, c.mesh.shape, strict=False))
    context = int(sizes.get("context", 1))
    if context in (1, -1):  # -1: resolved against the devices; packing.layout checks the row
        return
    row = c.loss.pack_row_len
    need(
        row % (2 * context) == 0,
        f"loss.pack_row_len={row} must be a multiple of 2 x the mesh's context axis "
        f"({2 * context}): each context shard holds two equal chunks of a row",
    )
    attention = dict(c.model.overrides).get("attention", "auto")
    need(
        attention != "splash" or c.loss.tokens_per_microbatch == 0,
        "model.overrides.attention='splash' with a context mesh axis and packed rows: the "
        "zig-zag rows need causality by slot; use 'xla' or 'auto'",
    )
    need(
        bool(c.sampler.mesh),
        f"mesh.axes has context={context}: set sampler.mesh (e.g. 'data=4,tp=8'); on the "
        "trainer's mesh the context chips would all decode the same rows",
    )


def _batch_invariant_mesh(c: Config, d: Derived) -> None:
    """model.batch_invariant holds where each contraction runs whole on one device: the
    trainer's and the sampler's meshes split rows only (data, fsdp), never tp or context."""
    if not c.model.batch_invariant:
        return
    meshes = (("mesh", tuple(zip(c.mesh.axes, c.mesh.shape))), ("sampler.mesh", d.sampler_mesh))
    for name, pairs in meshes:
        split = [f"{a}={n}" for a, n in pairs if a in ("tp", "context") and n != 1]
        need(
            not split,
            f"model.batch_invariant=True with {name} {', '.join(split)}: tensor and context "
            "parallelism split a contraction over devices; use data / fsdp axes only",
        )


def _sampler_heads(c: Config, d: Derived) -> None:
    """The sampler's mesh (sampler.mesh, else the trainer's) splits whole heads over its tp."""
    from ebpo_jax.sampler.layout import heads_split_error  # late: this module stays free of jax

    if d.sampler_mesh:
        key, tp = f"sampler.mesh={c.sampler.mesh!r}", dict(d.sampler_mesh).get("tp", 1)
    else:
        key, tp = f"mesh.shape={c.mesh.shape}", dict(zip(c.mesh.axes, c.mesh.shape)).get("tp", 1)
    heads = model_setting(c, "num_heads", ("num_attention_heads",))
    kv_heads = model_setting(c, "num_kv_heads", ("num_key_value_heads",), heads)
    if tp > 1 and heads and kv_heads:  # None: models.hf names an unreadable config.json
        error = heads_split_error(heads, kv_heads, tp)
        need(error is None, f"{key}: {error}")


def _expert_parallel(c: Config, d: Derived) -> None:
    """sampler.expert_parallel: a mixture of experts whose experts split evenly over the
    sampler mesh's data shards, and not batch-invariant numerics."""
    if not c.sampler.expert_parallel:
        return
    experts = _policy_experts(c, "sampler.expert_parallel")
    need(
        not c.model.batch_invariant,
        "sampler.expert_parallel with model.batch_invariant: the reduce-scatter adds a token's "
        "experts in another order than the trainer's forward; turn one off",
    )
    pairs = d.sampler_mesh or tuple(zip(c.mesh.axes, d.mesh_shape or c.mesh.shape))
    shards = [n for axis, n in pairs if axis in ("data", "fsdp")]
    if experts and -1 not in shards:  # None: models.hf names an unreadable config.json
        key = "sampler.mesh" if d.sampler_mesh else "mesh.shape"
        need(
            experts % math.prod(shards) == 0,
            f"sampler.expert_parallel: the model's {experts} experts do not split over {key}'s "
            f"{math.prod(shards)} data shards",
        )


def check(c: Config, num_devices: int | None = None) -> Derived:
    """Every cross-section rule; ConfigError (one line) on the first broken one. Returns what
    the rules derived (the resolved meshes), which the run spec carries."""
    d = derive(c, num_devices)
    _batch_split(c)
    _batch_invariant(c)
    _loss_choice(c)
    _packing(c)
    _steps(c, d)
    _overrides(c)
    _positions(c)
    _estimator_options(c, d)
    _staleness(c, d, num_devices)
    _turns(c)
    _replay_model(c)
    _replay_attention(c, d)
    _splash_widths(c, d)
    _lora_targets(c)
    _context(c)
    _batch_invariant_mesh(c, d)
    _sampler_heads(c, d)
    _expert_parallel(c, d)
    _sft_export(c)
    if num_devices is not None:
        _devices(c, d)
    _difficulty_file(c)  # last: these read files
    _data_and_model(c)
    return d
