"""The run spec: a validated config resolved once into frozen, typed slices.

Config files stay ml_collections (`--config.x=` overrides); `resolve(config)` parses them into
the typed sections of `ebpo_jax.schema` (one-line `ConfigError`s naming the field), runs the
checks that need several sections (`ebpo_jax.config.checks`) and returns a `RunSpec`. Each
slice holds the sections its factory reads plus values derived from them (shapes, the
resolved mesh, the LoRA spec), never a copy of a setting: the rollout a `RolloutSpec`, the
update an `UpdateSpec`, the optimizer an `OptimSpec`, and so on. Nothing downstream reads
the ConfigDict.
"""

import dataclasses
import json
from typing import Any

from ebpo_jax import config as config_lib
from ebpo_jax import schema
from ebpo_jax.config import checks
from ebpo_jax.runtime import storage


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What the sampler draws each step: P prompts x G samples of up to N tokens."""

    prompts: int  # P
    group_size: int  # G
    max_new_tokens: int  # N
    prompts_per_call: int  # sampler.prompts_per_call resolved: P / calls; == P for one call
    sampler: schema.Sampler
    rollout: schema.Rollout
    dapo: schema.Dapo
    moe: schema.Moe

    @property
    def rounds(self) -> int:
        """P-prompt rounds one step's batch holds (1 + DAPO's extra rounds)."""
        return 1 + self.dapo.max_extra_rounds if self.dapo.dynamic_sampling else 1

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
    run: schema.Run  # estimator, eb_clusters
    estimator_options: schema.EstimatorOptions
    loss: schema.Loss
    dapo: schema.Dapo
    moe: schema.Moe
    lora: Any = None  # models.lora.LoraSpec: params are adapters on a frozen base; None = full

    @property
    def use_clusters(self) -> bool:
        """One EB prior per cluster id (eb_clusters != "none")."""
        return self.run.eb_clusters != "none"

    @property
    def updates(self) -> int:
        """Optimizer updates per step: PPO epochs x mini-batches."""
        return self.loss.ppo_epochs * self.loss.num_minibatches


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW with clipping and a warm-up + constant/cosine schedule, in optimizer updates."""

    optimizer: schema.Optimizer
    run: schema.Run  # total_steps: the schedule's length in train steps
    updates_per_step: int


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The trainer's mesh (-1 resolved when the device count is known) and the sampler's."""

    mesh: schema.Mesh  # axes, devices (0 = every device), the shape as configured
    shape: tuple[int, ...]  # resolved
    sampler: tuple[tuple[str, int], ...]  # sampler.mesh parsed; () = the trainer's mesh
    disjoint: bool = False  # the sampler's mesh on the devices after the trainer's (staleness 1)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out pass@1: `eval_samples` samples per problem at `eval_temperature` (0 = greedy)."""

    run: schema.Run  # eval_every, eval_batch_size, eval_temperature, eval_samples, seed
    max_new_tokens: int

    @property
    def samples_per_problem(self) -> int:
        return self.run.eval_samples if self.run.eval_temperature > 0 else 1


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the run trains on: a task family and the sections that family reads."""

    family: str  # task.family resolved: a name in trainer.task's registry
    batch_prompts: int  # prompts per step's batch (rounds x P)
    max_new_tokens: int
    run: schema.Run  # seed, eb_clusters, workdir
    model: schema.Model
    task: schema.Task
    data: schema.Data
    sft: schema.Sft
    eval: EvalSpec
    rollout: RolloutSpec | None = None  # a multi-turn family's evaluator runs episodes too


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, resolved and validated once."""

    workdir: str  # run.workdir made absolute
    remote: bool  # the workdir is on object storage (gs://): asked once, here
    run: schema.Run
    with_ref: bool  # the KL term needs the frozen reference policy
    rollout: RolloutSpec
    update: UpdateSpec
    optim: OptimSpec
    mesh: MeshSpec
    task: TaskSpec
    eval: EvalSpec
    wandb: schema.Wandb  # project "" = off
    config_json: str  # the config as written to workdir/config.json

    def to_json(self) -> str:
        return self.config_json


def task_family(c: schema.Config) -> str:
    """The task family: `task.family` if set, else math records with data.path, else arithmetic."""
    return c.task.family or ("math" if c.data.path else "arithmetic")


def rollout_spec(c: schema.Config) -> RolloutSpec:
    run = c.run
    return RolloutSpec(
        prompts=run.prompts_per_step,
        group_size=run.group_size,
        max_new_tokens=c.sampler.max_new_tokens,
        prompts_per_call=c.sampler.prompts_per_call or run.prompts_per_step,
        sampler=c.sampler,
        rollout=c.rollout,
        dapo=c.dapo,
        moe=c.model.moe,
    )


def lora_spec(c: schema.Config):
    """`model.lora` as a models.lora.LoraSpec; None when rank is 0 (full fine-tuning)."""
    from ebpo_jax.models import lora  # late: the spec module stays free of jax

    return lora.spec_from_config(c.model.lora)


def update_spec(c: schema.Config) -> UpdateSpec:
    return UpdateSpec(
        prompts=c.run.prompts_per_step,
        group_size=c.run.group_size,
        max_new_tokens=c.sampler.max_new_tokens,
        run=c.run,
        estimator_options=c.estimator_options,
        loss=c.loss,
        dapo=c.dapo,
        moe=c.model.moe,
        lora=lora_spec(c),
    )


def optim_spec(c: schema.Config) -> OptimSpec:
    return OptimSpec(
        optimizer=c.optimizer,
        run=c.run,
        updates_per_step=c.loss.ppo_epochs * c.loss.num_minibatches,
    )


def mesh_spec(c: schema.Config, d: checks.Derived) -> MeshSpec:
    """The meshes as the checks resolved them (the shape as configured before the devices)."""
    return MeshSpec(
        mesh=c.mesh,
        shape=d.mesh_shape or tuple(int(s) for s in c.mesh.shape),
        sampler=d.sampler_mesh,
        disjoint=c.rollout.max_staleness > 0,
    )


def task_spec(c: schema.Config, rollout: RolloutSpec, ev: EvalSpec) -> TaskSpec:
    return TaskSpec(
        family=task_family(c),
        batch_prompts=rollout.batch_prompts,
        max_new_tokens=c.sampler.max_new_tokens,
        run=c.run,
        model=c.model,
        task=c.task,
        data=c.data,
        sft=c.sft,
        eval=ev,
        rollout=rollout,
    )


def resolve(config, num_devices: int | None = None) -> RunSpec:
    """Validate `config` (ConfigError on the first bad field) and freeze it into a RunSpec.

    With `num_devices` the mesh's -1 is resolved and the batch is checked against the mesh.
    """
    c, derived = config_lib.validated(config, num_devices)
    workdir = storage.absolute(c.run.workdir)  # a relative one is the cwd's; gs:// as given
    rollout, ev = rollout_spec(c), EvalSpec(run=c.run, max_new_tokens=c.sampler.max_new_tokens)
    return RunSpec(
        run=c.run,
        with_ref=c.loss.kl_coef > 0,
        rollout=rollout,
        optim=optim_spec(c),
        mesh=mesh_spec(c, derived),
        task=task_spec(c, rollout, ev),
        eval=ev,
        wandb=c.wandb,
        config_json=config.to_json(indent=2),
        update=update_spec(c),
        workdir=workdir,
        remote=storage.is_remote(workdir),
    )


def describe(spec: Any) -> dict:
    """A spec as plain JSON-able data (for logs and tests)."""
    return json.loads(json.dumps(dataclasses.asdict(spec), default=lambda x: x.to_dict()))
