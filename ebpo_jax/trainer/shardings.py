"""The meshes of a run and one bundle of shardings, all from the rules table.

The loop, the step builder and `aot.py` take the same `Shardings`, so the ahead-of-time
check compiles the programs that run: the state laid out by the rules, prompt batches and
rollout rows over the batch axes, and the sampler's copy of the weights on its own mesh.
"""

import math
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import config as config_lib
from ebpo_jax import sharding
from ebpo_jax.models import moe
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.spec import MeshSpec, RunSpec
from ebpo_jax.trainer import policy
from ebpo_jax.trainer.state import TrainState


def make_sampler_mesh(spec: MeshSpec, mesh, devices=None) -> jax.sharding.Mesh:
    """`sampler.mesh` over the trainer mesh's devices, or the trainer mesh itself.

    With `spec.disjoint` (rollout.max_staleness=1) it spans the devices after the trainer's
    in `devices` (default: every device; one process only), so both programs run at once.
    """
    if not spec.sampler:
        return mesh
    pool = mesh.devices.flat
    if spec.disjoint:  # one process only: config.checks
        taken = {d.id for d in mesh.devices.flat}
        pool = [d for d in (jax.devices() if devices is None else devices) if d.id not in taken]
        sizes = [n for _, n in spec.sampler]
        if -1 not in sizes:
            pool = pool[: math.prod(sizes)]
    try:
        return sharding.make_mesh(list(spec.sampler), pool)
    except ValueError as e:
        raise config_lib.ConfigError(f"sampler.mesh: {e}") from None


def rollout_shardings(rows: NamedSharding, routing: bool = False) -> Rollout:
    """A Rollout of shardings: per-prompt fields as `rows` (sharding.rows_sharding), the
    scalars replicated; `routing`: the rollout carries recorded experts (routing replay),
    else that field is None."""
    rep = NamedSharding(rows.mesh, P())
    scalars = ("generated_tokens", "all_same_frac")
    out = Rollout(*(rep if f in scalars else rows for f in Rollout._fields))
    return out._replace(routing=rows if routing else None)


def state_shardings(model_config, optimizer, state: TrainState, mesh) -> TrainState:
    """Shardings of an (abstract) TrainState: params, ref params, LoRA base and Adam moments
    by `model_config.sharding_rules` (the config's table), everything else replicated."""
    lay = lambda tree: sharding.param_shardings(model_config, tree, mesh)  # None: None
    return state_layout(optimizer, state, lay(state.params), lay(state.base), mesh)


def state_layout(optimizer, state: TrainState, params, base, mesh) -> TrainState:
    """Shardings of an (abstract) TrainState whose weights lie as `params` (the ref params
    too) and `base` (the LoRA base, or None): the Adam moments follow the params, and the EB
    accumulators, step, rng and counters are replicated."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, state.opt_state, params, transform_non_params=lambda _: rep
    )
    return state._replace(
        params=params,
        opt_state=opt_sh,
        eb_state=jax.tree.map(lambda _: rep, state.eb_state),
        step=rep,
        rng=rep,
        ref_params=None if state.ref_params is None else params,
        nonfinite_run=rep,
        generated_tokens=rep,
        base=base,
    )


class Shardings(NamedTuple):
    """Where every array of a run lives."""

    mesh: Any  # the trainer's
    sampler_mesh: Any  # the sampler's (the trainer's unless sampler.mesh is set)
    state: Any  # TrainState of shardings
    rollout: Rollout  # the update's input, on the trainer mesh
    sampler_rollout: Rollout  # the rollout's output, on the sampler mesh
    sampler_params: Any  # the sampler's copy of the policy
    replicated: NamedSharding
    prompt_rows: int  # prompts in one step's batch (rounds x P)

    def batches(self, tree, *, axis: int = 1, on_sampler: bool = False):
        """Prompt batches ([K]-stacked: rows on axis 1) split over the batch axes."""
        mesh = self.sampler_mesh if on_sampler else self.mesh
        return sharding.batch_sharded(tree, mesh, self.prompt_rows, axis=axis, strict=False)

    def place_batches(self, tree):
        """Host prompt batches ([K]-stacked, the same on every process), placed as `batches`."""
        return sharding.put_batch(tree, self.mesh, self.prompt_rows, axis=1, strict=False)


def sampler_model_config(spec: RunSpec, model_config):
    """The model config the sampler lays its weights out by: with sampler.expert_parallel,
    the experts split over its data axes (models/moe.py), as sampler.Session runs them."""
    if not spec.rollout.sampler.expert_parallel:
        return model_config
    return moe.expert_parallel_config(model_config)


def bundle(
    spec: RunSpec, view: policy.Policy, optimizer, abstract_state, mesh, devices=None
) -> Shardings:
    """The shardings of a run whose policy `view` holds `abstract_state` (a TrainState of
    arrays or ShapeDtypeStructs).

    `devices`: all devices of the run (default: jax.devices()), for a disjoint sampler mesh.
    """
    s_mesh = make_sampler_mesh(spec.mesh, mesh, devices)
    sampled = view.sampler_abstract(spec.rollout.sampler.param_dtype, abstract_state)
    # Every weight tree laid out by the one rules table: the trainer's on its mesh, the
    # sampler's copy on the sampler's; the rows of a rollout over each mesh's batch axes.
    mc, P_ = view.model_config, spec.rollout.prompts
    params = sharding.param_shardings(mc, abstract_state.params, mesh)
    base = sharding.param_shardings(mc, abstract_state.base, mesh)  # None: no LoRA base
    sampler_params = sharding.param_shardings(sampler_model_config(spec, mc), sampled, s_mesh)
    rows, s_rows = sharding.rows_sharding(mesh, P_), sharding.rows_sharding(s_mesh, P_)
    routing = spec.rollout.moe.routing_replay
    return Shardings(
        mesh=mesh,
        sampler_mesh=s_mesh,
        state=state_layout(optimizer, abstract_state, params, base, mesh),
        sampler_params=sampler_params,
        rollout=rollout_shardings(rows, routing),
        sampler_rollout=rollout_shardings(s_rows, routing),
        replicated=NamedSharding(mesh, P()),
        prompt_rows=spec.rollout.batch_prompts,
    )
