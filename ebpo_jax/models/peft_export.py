"""LoRA adapters in PEFT's format (adapter_model.safetensors + adapter_config.json).

`peft.PeftModel.from_pretrained(hf_model, path)` loads the result onto the base exported by
`models.to_hf`; PEFT computes W x + (alpha / r) B A x, the same model as `lora.merge`.
"""

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.lora import TARGETS, LoraSpec

_HF_MODULE = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_PREFIX = "base_model.model.model.layers.{i}."


def peft_tensors(config: ModelConfig, spec: LoraSpec, adapters) -> dict[str, np.ndarray]:
    """PEFT key -> float32 array: lora_A.weight [r, in], lora_B.weight [out, r] per layer.

    Our A [L, *in, r] and B [L, r, *out] flatten their head dims in C order, as hf.py's
    layouts do for the base weights (q_proj row h * head_dim + d is our [h, d]).
    """
    out = {}
    for t in spec.targets:
        group, name, _ = TARGETS[t]
        ab = adapters["layers"][group][name]
        a = np.asarray(jax.device_get(ab["a"].get_value()), np.float32)
        b = np.asarray(jax.device_get(ab["b"].get_value()), np.float32)
        for i in range(config.num_layers):
            key = _PREFIX.format(i=i) + _HF_MODULE[t]
            out[key + ".lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, spec.rank).T)
            out[key + ".lora_B.weight"] = np.ascontiguousarray(b[i].reshape(spec.rank, -1).T)
    return out


def to_peft(
    config: ModelConfig, spec: LoraSpec, adapters, path: str, *, base_model_name_or_path=""
) -> None:
    """Writes adapter_model.safetensors and adapter_config.json (float32) into `path`.

    Adapters trained on a QLoRA base (int8 / nf4) are exported as they are; PEFT applies
    them to the unquantized base it is given.
    """
    os.makedirs(path, exist_ok=True)
    save_file(
        peft_tensors(config, spec, adapters),
        os.path.join(path, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(_HF_MODULE[t].split(".")[1] for t in spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
