"""The policy view: for full fine-tuning and LoRA/QLoRA alike, which weights train, which
stay frozen, what the KL reference is, what the sampler runs, and which base a checkpoint's
adapters belong to.

Full fine-tuning: `TrainState.params` train; `ref_params` (a copy made at step 0, only when
the KL term needs it) is frozen and is the reference. LoRA: `params` are the adapters, `base`
(quantized for QLoRA) is frozen and is the reference (the adapters off), and the sampler runs
base + A B merged in the compute dtype. The loop, the step, the update and the shardings ask
this object; none of them branches on LoRA.
"""

import dataclasses
import functools
from typing import Any

import jax

from ebpo_jax import models, sharding
from ebpo_jax.models import lora as lora_lib
from ebpo_jax.models import lora_checkpoint, quantize
from ebpo_jax.schema import ConfigError
from ebpo_jax.trainer.state import TrainState, init_train_state

_ADAPTER_STREAM = 19  # fold_in(key(seed), ·) for the adapters' init: apart from the step rngs


def init_lora_state(
    base_params, optimizer, spec: lora_lib.LoraSpec, model_config, *, seed: int, num_clusters=1
) -> TrainState:
    """A fresh LoRA TrainState around the base weights; jit-able (build it with out_shardings)."""
    key = jax.random.fold_in(jax.random.key(seed), _ADAPTER_STREAM)
    adapters = lora_lib.init_adapters(model_config, spec, key)
    base = lora_lib.quantize_base(base_params, spec)
    return init_train_state(
        adapters, optimizer, seed=seed, num_clusters=num_clusters, with_ref=False, base=base
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """How a run's TrainState holds its policy (`lora` None: full fine-tuning)."""

    model_config: Any
    lora: lora_lib.LoraSpec | None = None
    with_ref: bool = False  # full fine-tuning: keep a frozen copy for the KL term

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    def init(self, params, optimizer, *, seed: int, num_clusters: int = 1) -> TrainState:
        """The step-0 TrainState around `params` (jit-able: build it with out_shardings)."""
        if self.is_lora:  # adapters trained; the base frozen, the KL reference
            return init_lora_state(
                params,
                optimizer,
                self.lora,
                self.model_config,
                seed=seed,
                num_clusters=num_clusters,
            )
        return init_train_state(
            params, optimizer, seed=seed, num_clusters=num_clusters, with_ref=self.with_ref
        )

    def trained(self, state: TrainState):
        """The weights the optimizer updates (the adapters under LoRA)."""
        return state.params

    def frozen(self, state: TrainState):
        """The weights the loss reads but never updates: the KL reference (None without KL in
        full fine-tuning) or, under LoRA, the base the adapters sit on (also the reference)."""
        return state.base if self.is_lora else state.ref_params

    def forward_params(self, trained, frozen):
        """The params `forward` runs the trained policy on (adapters attached to the base)."""
        return lora_lib.attach(frozen, trained, self.lora) if self.is_lora else trained

    def sampled(self, state: TrainState):
        """The weights the sampler runs: the params, or the base with A B merged in the compute
        dtype (faster to sample than the adapter path: benchmarks/lora_bench.py)."""
        if not self.is_lora:
            return state.params
        return lora_lib.merge(state.base, state.params, self.lora, dtype=self.model_config.dtype)

    def abstract_sampled(self, abstract_state: TrainState):
        """The (abstract) weights the sampler runs, for their shardings."""
        if not self.is_lora:
            return abstract_state.params
        return models.abstract_params(self.model_config)

    def sampler_abstract(self, param_dtype: str, abstract_state: TrainState):
        """The (abstract) weights the sampler holds in sampler.param_dtype's layout (int8:
        quantized arrays), for their shardings."""
        if param_dtype != "int8":
            return self.abstract_sampled(abstract_state)
        return int8_abstract(self.model_config)

    def checkpoint_extra(self, model, source: str) -> dict:
        """The checkpoint's extra entries: under LoRA, the base the adapters belong to."""
        if not self.is_lora:
            return {}
        return {lora_checkpoint.EXTRA_KEY: base_reference(model, source)}

    def check_checkpoint(self, extra: dict, entries: dict) -> None:
        """ConfigError when a checkpoint's adapters belong to another base or adapter spec than
        this run's `entries` (checkpoint_extra), or when LoRA is on for a full checkpoint or
        off for a LoRA one (either would look corrupt)."""
        saved = extra.get(lora_checkpoint.EXTRA_KEY)
        if self.is_lora:
            check_base_reference(saved or {}, entries[lora_checkpoint.EXTRA_KEY])
        elif saved is not None:
            raise ConfigError(
                f"the checkpoint holds LoRA adapters (model.lora.rank={saved.get('rank')}); "
                "resume with the same model.lora settings"
            )


class SamplerWeights:
    """The sampler's copy of the policy, made one way for the run and for AOT: `sampled` (the
    params, or LoRA's one jitted merge per step), cast to sampler.param_dtype (int8: quantized,
    models/quantize.py) on the trainer's mesh, then moved device to device onto the sampler's
    mesh when it has its own (or, `relaid`, its own layout: expert parallelism on the trainer's
    mesh)."""

    def __init__(self, policy: Policy, param_dtype: str, sh, relaid: bool = False):
        self.sh, self.is_lora = sh, policy.is_lora
        self.moves = sh.sampler_mesh is not sh.mesh or relaid
        self.sampled = jax.jit(policy.sampled) if policy.is_lora else policy.sampled
        # On the trainer's devices: half the bytes to move from float32 master weights.
        self.cast = _cast(policy, param_dtype, sh) if param_dtype else None

    def __call__(self, params):
        """The sampler's copy of `sampled` params (dispatched, not waited for)."""
        sh = self.sh
        if self.cast is not None:
            with jax.set_mesh(sh.mesh):
                params = self.cast(params)
        if self.moves:  # weights move device to device, not via the host
            params = jax.device_put(params, sh.sampler_params)
        return params

    def programs(self, state, build=None):
        """What `__call__(sampled(state))` runs, on the abstract `state`: each program traced
        and handed to `build(name, mesh, note, traced) -> Compiled or None` (None: lowered
        only), in order; returns the sampler's abstract params. The move onto a sampler mesh
        over the same devices is the resharding copy device_put compiles; onto other devices
        (rollout.max_staleness=1) it is a transfer, no program."""
        sh, params = self.sh, state.params
        devices = lambda mesh: {d.id for d in mesh.devices.flat}
        build = build or (lambda *_: None)

        def run(name, mesh, note, jitted, *args):
            with jax.set_mesh(mesh):
                traced = jitted.trace(*args)
                return sharding.abstract_outputs(traced, build(name, mesh, note, traced))

        if self.is_lora:
            params = run("lora merge", sh.mesh, "base + A B", self.sampled, state)
        if self.cast is not None:
            params = run("cast weights", sh.mesh, "to sampler.param_dtype", self.cast, params)
        if self.moves and devices(sh.sampler_mesh) & devices(sh.mesh):
            move = jax.jit(lambda p: p, out_shardings=sh.sampler_params)
            params = run("reshard weights", sh.sampler_mesh, "onto the sampler's mesh", move,
                         params)  # fmt: skip
        return sharding.abstract(params, sh.sampler_params)


def _cast(policy: Policy, dtype: str, sh):
    """The sampled weights in `dtype`, laid out as they are on the trainer's mesh (LoRA: the
    merged model's layout, not the adapters'; int8: the quantized arrays' like their weights)."""
    mc = policy.model_config
    if dtype == "int8":  # LoRA: the merged weights are quantized
        int8 = functools.partial(quantize.int8_weights, dtype=mc.dtype)
        return jax.jit(int8, out_shardings=int8_shardings(mc, sh.mesh))
    laid_out = sh.state.params
    if policy.is_lora:
        laid_out = sharding.param_shardings(mc, models.abstract_params(mc), sh.mesh)
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
    return jax.jit(cast, out_shardings=laid_out)


def int8_abstract(model_config):
    """The sampler's int8 weights, abstract: each projection a QArray of int8 values and
    scales, every other weight in the compute dtype."""
    abstract = models.abstract_params(model_config)
    return jax.eval_shape(lambda p: quantize.int8_weights(p, model_config.dtype), abstract)


def int8_shardings(model_config, mesh):
    """Where the sampler's int8 weights live on `mesh` (sharding.param_shardings: each QArray's
    values as its weight, its scales whole along the dims they reduce)."""
    return sharding.param_shardings(model_config, int8_abstract(model_config), mesh)


def base_reference(model, source: str) -> dict:
    """The checkpoint's `extra` entry naming the base: `source` (an HF folder, the SFT
    warm-start cache file or the seeded init) and the adapter hyper-parameters of the
    `model` config section that must match on resume."""
    lc = model.lora
    return {
        "source": source,
        "preset": model.preset,
        "base_dtype": lc.base_dtype,
        "rank": int(lc.rank),
        "alpha": float(lc.alpha),
        "targets": str(lc.targets),
    }


def check_base_reference(saved: dict, want: dict) -> None:
    """Raise ConfigError when a checkpoint's adapters were trained on another base or spec
    than `want` (this run's base_reference)."""
    diff = sorted(k for k in want if saved.get(k) != want[k])
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {want[k]!r}" for k in diff)
        raise ConfigError(f"LoRA checkpoint does not match this run's base ({pairs})")


def of(spec, model_config) -> Policy:
    """The run's Policy from its RunSpec."""
    return Policy(model_config, lora=spec.update.lora, with_ref=spec.with_ref)
