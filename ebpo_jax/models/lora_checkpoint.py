"""A LoRA run's checkpoint: the base it names, its adapters, and the policy they make.

A LoRA checkpoint holds the adapters only; its extra entry `EXTRA_KEY` names the base they
were trained on, so a resume or an evaluation refuses another base.
"""

import os
import types

from flax import nnx

from ebpo_jax.models import lora
from ebpo_jax.runtime.checkpoint import Checkpointer, load_params

EXTRA_KEY = "lora_base"  # the checkpoint's extra entry that names the base
# (trainer/policy.py's base_reference)


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
