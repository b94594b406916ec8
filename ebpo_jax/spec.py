"""The run spec: a validated config resolved once into frozen, typed slices.

Config files stay ml_collections (`--config.x=` overrides); `resolve(config)` validates them
(one-line `ConfigError`s naming the field) and returns a `RunSpec`. Every factory takes only
its slice: the rollout a `RolloutSpec`, the update an `UpdateSpec`, the optimizer an
`OptimSpec`, and so on. Nothing downstream reads the ConfigDict.
"""

import dataclasses
import json
import os
from typing import Any

import ml_collections

from ebpo_jax import config as config_lib


def _frozen(d) -> ml_collections.FrozenConfigDict:
    return ml_collections.FrozenConfigDict(d)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What the sampler draws each step: P prompts x G samples of up to N tokens."""

    prompts: int  # P
    group_size: int  # G
    max_new_tokens: int  # N
    temperature: float
    top_p: float
    top_k: int
    prompts_per_call: int  # P / calls; == P for one call
    dynamic_sampling: bool  # DAPO: drop all-equal groups, refill from extra rounds
    max_extra_rounds: int
    max_staleness: int = 0  # 1: rollout t+1 sampled with params t while update t runs
    param_dtype: str = ""  # the sampler's copy of the weights; "" = the trainer's dtype
    slots: int = 0  # decode slots per sampler call (continuous batching); 0 = static batch
    page_size: int = 16  # tokens per KV page
    kv_pages: int = 0  # KV pages per sampler call; 0 = enough for every slot's longest row
    max_turns: int = 1  # model turns per episode (a task with an environment)
    turn_tokens: int = 0  # tokens per model turn; 0 = max_new_tokens
    env_workers: int = 2  # environment worker processes (0 = in process)
    env_timeout_s: float = 10.0  # per environment call
    routing_replay: bool = False  # record each token's experts (mixture of experts)

    @property
    def rounds(self) -> int:
        """P-prompt rounds one step's batch holds (1 + DAPO's extra rounds)."""
        return 1 + self.max_extra_rounds if self.dynamic_sampling else 1

    @property
    def batch_prompts(self) -> int:
        """Prompts in one step's batch (rounds x P)."""
        return self.rounds * self.prompts


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """Advantages, reward shaping and the PPO update: epochs x mini-batches x micro-batches."""

    prompts: int  # P
    group_size: int  # G
    max_new_tokens: int  # N
    estimator: str
    estimator_options: ml_collections.FrozenConfigDict
    use_clusters: bool  # one EB prior per cluster id (eb_clusters != "none")
    loss: str  # a name in ebpo_jax.losses' registry
    ppo_epochs: int
    num_minibatches: int
    num_microbatches: int
    clip_low: float
    clip_high: float
    dual_clip: float  # 0 = off
    agg: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    logits_chunk: int
    tokens_per_microbatch: int  # > 0: packed update (trainer/packing.py)
    pack_row_len: int
    overlong_buffer: int
    overlong_penalty: float
    mask_truncated: bool
    recompute_old_logprobs: bool  # old log-probs from the trainer's forward, not the sampler's
    is_correction: str  # none | tis | mis (ebpo_jax.importance)
    is_level: str
    is_cap: float
    is_low: float
    is_high: float
    lora: Any = None  # models.lora.LoraSpec: params are adapters on a frozen base; None = full
    routing_replay: bool = False  # forwards replay the rollout's recorded experts
    lb_coef: float = 0.0  # router load-balancing loss weight (mixture of experts)

    @property
    def updates(self) -> int:
        """Optimizer updates per step: PPO epochs x mini-batches."""
        return self.ppo_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW with clipping and a warm-up + constant/cosine schedule, in optimizer updates."""

    learning_rate: float
    weight_decay: float
    warmup_steps: int  # train steps
    schedule: str
    final_lr_frac: float
    clip_norm: float
    b1: float
    b2: float
    total_steps: int
    updates_per_step: int


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The trainer's mesh (-1 resolved when the device count is known) and the sampler's."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    devices: int  # 0 = every device
    sampler: tuple[tuple[str, int], ...]  # () = the trainer's mesh
    disjoint: bool = False  # the sampler's mesh on the devices after the trainer's (staleness 1)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the run trains on: a task family and the sections that family reads."""

    family: str  # a name in trainer.task's registry
    seed: int
    batch_prompts: int  # prompts per step's batch (rounds x P)
    eb_clusters: str
    max_new_tokens: int
    model: ml_collections.FrozenConfigDict
    task: ml_collections.FrozenConfigDict
    data: ml_collections.FrozenConfigDict
    sft: ml_collections.FrozenConfigDict
    workdir: str
    eval: "EvalSpec"
    rollout: "RolloutSpec | None" = None  # a multi-turn family's evaluator runs episodes too


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out pass@1: `samples` samples per problem at `temperature` (0 = greedy, one)."""

    every: int
    batch_size: int
    temperature: float
    samples: int
    seed: int
    max_new_tokens: int

    @property
    def samples_per_problem(self) -> int:
        return self.samples if self.temperature > 0 else 1


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, resolved and validated once."""

    workdir: str
    seed: int
    total_steps: int
    steps_per_jit: int  # K steps per lax.scan (jittable reward only)
    max_nonfinite_steps: int
    with_ref: bool  # the KL term needs the frozen reference policy
    rollout: RolloutSpec
    update: UpdateSpec
    optim: OptimSpec
    mesh: MeshSpec
    task: TaskSpec
    eval: EvalSpec
    checkpoint: CheckpointSpec
    log_samples_every: int  # 0 = never: sample completions to samples.jsonl
    wandb: ml_collections.FrozenConfigDict  # project "" = off
    config_json: str  # the config as written to workdir/config.json
    log_every: int = 10  # progress lines without a terminal: every N steps
    log_every_s: float = 30.0  # ... and at least every this many seconds

    def to_json(self) -> str:
        return self.config_json


def task_family(config) -> str:
    """The task family: `task.family` if set, else math records with data.path, else arithmetic."""
    family = config.task.get("family", "")
    return family or ("math" if config.data.path else "arithmetic")


def rollout_spec(c) -> RolloutSpec:
    s = c.sampler
    return RolloutSpec(
        prompts=c.prompts_per_step,
        group_size=c.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=int(s.top_k),
        prompts_per_call=s.prompts_per_call or c.prompts_per_step,
        dynamic_sampling=bool(c.dapo.dynamic_sampling),
        max_extra_rounds=c.dapo.max_extra_rounds,
        max_staleness=int(c.rollout.max_staleness),
        param_dtype=c.sampler.param_dtype,
        slots=int(c.sampler.slots),
        page_size=int(c.sampler.get("page_size", 16)),
        kv_pages=int(c.sampler.get("kv_pages", 0)),
        max_turns=int(c.rollout.get("max_turns", 1)),
        turn_tokens=int(c.rollout.get("turn_tokens", 0)),
        env_workers=int(c.rollout.get("env_workers", 2)),
        env_timeout_s=float(c.rollout.get("env_timeout_s", 10.0)),
        routing_replay=bool(c.model.get("moe", {}).get("routing_replay", False)),
    )


def lora_spec(c):
    """`model.lora` as a models.lora.LoraSpec; None when rank is 0 (full fine-tuning)."""
    from ebpo_jax.models import lora  # late: the spec module stays free of jax

    return lora.spec_from_config(c.model.lora)


def update_spec(c) -> UpdateSpec:
    lc = c.loss
    return UpdateSpec(
        prompts=c.prompts_per_step,
        group_size=c.group_size,
        max_new_tokens=c.sampler.max_new_tokens,
        estimator=c.estimator,
        estimator_options=_frozen(c.estimator_options),
        use_clusters=c.eb_clusters != "none",
        loss=lc.name,
        ppo_epochs=lc.ppo_epochs,
        num_minibatches=lc.num_minibatches,
        num_microbatches=lc.num_microbatches,
        clip_low=lc.clip_low,
        clip_high=lc.clip_high,
        dual_clip=lc.dual_clip,
        agg=lc.agg,
        kl_coef=lc.kl_coef,
        kl_estimator=lc.kl_estimator,
        entropy_coef=lc.entropy_coef,
        logits_chunk=lc.logits_chunk,
        tokens_per_microbatch=lc.tokens_per_microbatch,
        pack_row_len=lc.pack_row_len,
        overlong_buffer=c.dapo.overlong_buffer,
        overlong_penalty=c.dapo.overlong_penalty,
        mask_truncated=bool(c.dapo.mask_truncated),
        recompute_old_logprobs=bool(lc.recompute_old_logprobs),
        is_correction=lc.is_correction,
        is_level=lc.is_level,
        is_cap=float(lc.is_cap),
        is_low=float(lc.is_low),
        is_high=float(lc.is_high),
        lora=lora_spec(c),
        routing_replay=bool(c.model.get("moe", {}).get("routing_replay", False)),
        lb_coef=float(c.model.get("moe", {}).get("lb_coef", 0.0)),
    )


def optim_spec(c) -> OptimSpec:
    o = c.optimizer
    return OptimSpec(
        learning_rate=o.learning_rate,
        weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        final_lr_frac=o.final_lr_frac,
        clip_norm=o.clip_norm,
        b1=o.b1,
        b2=o.b2,
        total_steps=c.total_steps,
        updates_per_step=c.loss.ppo_epochs * c.loss.num_minibatches,
    )


def mesh_spec(c, num_devices: int | None = None) -> MeshSpec:
    shape = tuple(int(s) for s in c.mesh.shape)
    if num_devices is not None:
        shape = config_lib.mesh_shape(c, num_devices)
    return MeshSpec(
        axes=tuple(c.mesh.axes),
        shape=shape,
        devices=int(c.mesh.get("devices", 0)),
        sampler=tuple(config_lib.sampler_mesh_spec(c)),
        disjoint=c.rollout.max_staleness > 0,
    )


def eval_spec(c) -> EvalSpec:
    return EvalSpec(
        every=c.eval_every,
        batch_size=c.eval_batch_size,
        temperature=c.eval_temperature,
        samples=c.eval_samples,
        seed=c.seed,
        max_new_tokens=c.sampler.max_new_tokens,
    )


def task_spec(c, rollout: RolloutSpec, ev: EvalSpec) -> TaskSpec:
    return TaskSpec(
        family=task_family(c),
        seed=c.seed,
        batch_prompts=rollout.batch_prompts,
        eb_clusters=c.eb_clusters,
        max_new_tokens=c.sampler.max_new_tokens,
        model=_frozen(c.model),
        task=_frozen(c.task),
        data=_frozen(c.data),
        sft=_frozen(c.sft),
        workdir=c.workdir,
        eval=ev,
        rollout=rollout,
    )


def resolve(config, num_devices: int | None = None) -> RunSpec:
    """Validate `config` (ConfigError on the first bad field) and freeze it into a RunSpec.

    With `num_devices` the mesh's -1 is resolved and the batch is checked against the mesh.
    """
    config_lib.validate(config, num_devices)
    c = config
    rollout, ev = rollout_spec(c), eval_spec(c)
    return RunSpec(
        workdir=os.path.abspath(c.workdir),  # a relative one (runs/tiny) is the cwd's
        seed=c.seed,
        total_steps=c.total_steps,
        steps_per_jit=c.steps_per_jit,
        max_nonfinite_steps=c.max_nonfinite_steps,
        with_ref=c.loss.kl_coef > 0,
        rollout=rollout,
        update=update_spec(c),
        optim=optim_spec(c),
        mesh=mesh_spec(c, num_devices),
        task=task_spec(c, rollout, ev),
        eval=ev,
        checkpoint=CheckpointSpec(every=c.checkpoint_every, keep=c.keep_checkpoints),
        log_samples_every=c.log_samples_every,
        wandb=_frozen(c.wandb),
        config_json=c.to_json(indent=2),
        log_every=c.log_every,
        log_every_s=float(c.get("log_every_s", 30.0)),
    )


def describe(spec: Any) -> dict:
    """A spec as plain JSON-able data (for logs and tests)."""
    return json.loads(json.dumps(dataclasses.asdict(spec), default=lambda x: x.to_dict()))
