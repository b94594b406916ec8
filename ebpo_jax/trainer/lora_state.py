"""LoRA training state: adapters trained, the base frozen and shared with the KL reference
(what the run reads of it: trainer/policy.py).

Layout: `TrainState.params` = the adapters (so the optimizer, its moments, the gradient
and the checkpoint only ever see them), `TrainState.base` = the frozen base (quantized for
QLoRA), `TrainState.ref_params` = None (the reference policy is `base` with the adapters off:
no second copy of the weights).
"""

import os
import types

import jax
from flax import nnx

from ebpo_jax.checkpoint import Checkpointer, load_params
from ebpo_jax.config import ConfigError
from ebpo_jax.models import lora
from ebpo_jax.trainer.state import TrainState, init_train_state

_ADAPTER_STREAM = 19  # fold_in(key(seed), ·) for the adapters' init: apart from the step rngs
EXTRA_KEY = "lora_base"  # the checkpoint's extra entry that names the base (base_reference)


def spec_from(config) -> lora.LoraSpec | None:
    """The run's LoraSpec (`model.lora`), or None for full fine-tuning."""
    return lora.spec_from_config(config.model.lora)


def init_lora_state(
    base_params, optimizer, spec: lora.LoraSpec, model_config, *, seed: int, num_clusters=1
) -> TrainState:
    """A fresh LoRA TrainState around the base weights; jit-able (build it with out_shardings)."""
    key = jax.random.fold_in(jax.random.key(seed), _ADAPTER_STREAM)
    adapters = lora.init_adapters(model_config, spec, key)
    base = lora.quantize_base(base_params, spec)
    return init_train_state(
        adapters, optimizer, seed=seed, num_clusters=num_clusters, with_ref=False, base=base
    )


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


def check_base_reference(saved: dict, model, source: str) -> None:
    """Raise ConfigError when a checkpoint's adapters were trained on another base or spec."""
    want = base_reference(model, source)
    diff = sorted(k for k in want if saved.get(k) != want[k])
    if diff:
        pairs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {want[k]!r}" for k in diff)
        raise ConfigError(f"LoRA checkpoint does not match this run's base ({pairs})")


def restore_adapters(workdir: str, model_config):
    """(LoraSpec, adapters) of a trainer workdir's latest checkpoint; (None, None) when the
    run trained the full model (its checkpoint names no LoRA base)."""
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        ref = ckpt.saved_extra().get(EXTRA_KEY)
        if ref is None:
            return None, None
        spec = lora.spec_from_config(types.SimpleNamespace(**ref))
        state, _ = ckpt.restore()
    adapters = lora.abstract_adapters(model_config, spec)
    nnx.replace_by_pure_dict(adapters, _pure(state["params"]))
    return spec, adapters


def _pure(tree):
    """A restored nnx.State (each variable a {"value": array} dict) as a pure dict."""
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"value"}:
        return tree["value"]
    return {k: _pure(v) for k, v in tree.items()}


def policy_of_run(workdir: str, base_params, model_config):
    """The policy a trainer workdir's latest checkpoint holds: its params, or for a LoRA run
    `base_params` with the adapters merged in (float32 weights)."""
    spec, adapters = restore_adapters(workdir, model_config)
    if spec is None:
        return load_params(workdir)
    return lora.merge(base_params, adapters, spec)
