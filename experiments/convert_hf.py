"""Convert checkpoints: HF folder -> params (orbax dir or .npz) and back; export a LoRA run.

  python experiments/convert_hf.py --src=/ckpt/Qwen3-0.6B --dst=/tmp/qwen.npz [--dtype=float32]
  python experiments/convert_hf.py --src=/tmp/qwen.npz --dst=/tmp/qwen_hf --tokenizer_from=/ckpt/Qwen3-0.6B
  python experiments/convert_hf.py --src=/ckpt/Qwen3-8B --lora_run=/runs/lora --dst=/out/merged \
      --peft_dst=/out/adapter
A source folder with config.json is read as HF; anything else as our params (orbax dir or .npz).
Any path may be gs://: inputs are copied to this host first, outputs written here then uploaded.
With --lora_run, --src is the run's HF base: --dst gets the merged model as an HF folder
(tokenizer copied from --src), --peft_dst the adapters in PEFT's format.
"""

import dataclasses
import json
import os
import shutil
import tempfile

from absl import flags

from ebpo_jax import cli

_SRC = flags.DEFINE_string("src", None, "HF checkpoint folder, or params (.npz / orbax folder).")
_DST = flags.DEFINE_string("dst", None, "Output: params (.npz / orbax folder) or HF folder.")
_DTYPE = flags.DEFINE_string("dtype", None, "float32 | bfloat16 | float16 (default: source's).")
_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "HF output shard size in GiB.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer_from", None, "HF folder to copy tokenizer files and bos/eos/pad ids from."
)

_LORA_RUN = flags.DEFINE_string(
    "lora_run", None, "Trainer workdir of a LoRA run on the --src base: export its adapters."
)
_PEFT_DST = flags.DEFINE_string("peft_dst", None, "With --lora_run: also write a PEFT adapter.")

_CONFIG_KEY = "__model_config__"
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "generation_config", "vocab", "merges")


def _config_json(config) -> str:
    return json.dumps({**dataclasses.asdict(config), "rope_scaling": config.rope_scaling_dict})


def _config_from_json(text):
    from ebpo_jax.models import ModelConfig

    fields = json.loads(text)
    return ModelConfig(**{**fields, "rope_scaling": fields["rope_scaling"] or None})


def _bits(x):
    return x.view("uint16") if x.dtype.name == "bfloat16" else x


def save_params(config, params, dst):
    """Writes params to `dst`: one .npz (keys like layers/attn/q), else an orbax folder."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    pure = nnx.to_pure_dict(params)
    if dst.endswith(".npz"):
        flat = jax.tree_util.tree_flatten_with_path(pure)[0]
        # npz has no bfloat16: such arrays are stored as their uint16 bits (see load_params).
        arrays = {"/".join(k.key for k in path): _bits(np.asarray(v)) for path, v in flat}
        np.savez(dst, **arrays, **{_CONFIG_KEY: np.array(_config_json(config))})
        return
    os.makedirs(dst, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(os.path.abspath(dst), "params"), pure)
    with open(os.path.join(dst, "model_config.json"), "w") as f:
        f.write(_config_json(config))


def load_params(src):
    """Reads (config, params) written by save_params."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from ebpo_jax import models

    if src.endswith(".npz"):
        with np.load(src) as data:
            config = _config_from_json(str(data[_CONFIG_KEY]))
            arrays = {k: data[k] for k in data.files if k != _CONFIG_KEY}
        abstract = models.abstract_params(config)

        def leaf(path, x):
            name = "/".join(k.key for k in path)
            if name not in arrays:
                raise KeyError(f"{src}: array {name} missing")
            if arrays[name].shape != x.shape:
                raise ValueError(
                    f"{src}: array {name} has shape {arrays[name].shape}, expected {x.shape}"
                )
            if x.dtype == jnp.bfloat16:
                return jnp.asarray(arrays[name].view(jnp.bfloat16))
            return jnp.asarray(arrays[name], x.dtype)

        pure = jax.tree_util.tree_map_with_path(leaf, nnx.to_pure_dict(abstract))
    else:
        config_file = os.path.join(src, "model_config.json")
        if not os.path.exists(config_file):
            raise FileNotFoundError(f"{config_file} not found (not an HF folder nor our params)")
        with open(config_file) as f:
            config = _config_from_json(f.read())
        abstract = models.abstract_params(config)
        with ocp.StandardCheckpointer() as ckpt:
            pure = ckpt.restore(
                os.path.join(os.path.abspath(src), "params"), nnx.to_pure_dict(abstract)
            )
    nnx.replace_by_pure_dict(abstract, pure)
    return config, abstract


def export_lora(src, run, dst, peft_dst=None, *, dtype=None, max_shard_gb=5.0):
    """A LoRA run on the HF base `src`: merged HF model to `dst`, PEFT adapter to `peft_dst`."""
    from ebpo_jax import models
    from ebpo_jax.models import lora, lora_checkpoint, peft_export

    if not os.path.exists(os.path.join(src, "config.json")):
        raise FileNotFoundError(f"--src={src}: no config.json (--lora_run needs the HF base)")
    config, base = models.from_hf(src, dtype="float32")
    spec, adapters = lora_checkpoint.restore_adapters(run, config)
    if spec is None:
        raise ValueError(f"--lora_run={run}: its checkpoint holds full params, not adapters")
    if peft_dst:
        peft_export.to_peft(config, spec, adapters, peft_dst, base_model_name_or_path=src)
    merged = lora.merge(base, adapters, spec)
    _write_hf(config, merged, dst, dtype=dtype, max_shard_gb=max_shard_gb, tokenizer_from=src)
    return config


def convert(src, dst, *, dtype=None, max_shard_gb=5.0, tokenizer_from=None):
    """One conversion; the direction follows from whether `src` holds an HF config.json."""
    from ebpo_jax import models

    if os.path.exists(os.path.join(src, "config.json")):
        config, params = models.from_hf(src, dtype=dtype)
        save_params(config, params, dst)
    else:
        config, params = load_params(src)
        _write_hf(config, params, dst, dtype=dtype, max_shard_gb=max_shard_gb,
                  tokenizer_from=tokenizer_from)  # fmt: skip
    return config


def _write_hf(config, params, dst, *, dtype, max_shard_gb, tokenizer_from):
    """models.to_hf, with the special token ids and tokenizer files of `tokenizer_from`."""
    from ebpo_jax import models

    extra = {}
    source_config = os.path.join(tokenizer_from or "", "config.json")
    if tokenizer_from and os.path.exists(source_config):
        with open(source_config) as f:
            hf = json.load(f)
        extra = {k: hf[k] for k in _SPECIAL_IDS if k in hf}
    max_bytes = int(max_shard_gb * 2**30)
    models.to_hf(config, params, dst, dtype=dtype, max_shard_bytes=max_bytes, extra_config=extra)
    if tokenizer_from:
        for name in os.listdir(tokenizer_from):
            if name.startswith(_TOKENIZER_FILES):
                shutil.copy(os.path.join(tokenizer_from, name), dst)


def on_storage(fn, src, dst, **kw):
    """fn(src, dst, **kw) on local paths: gs:// inputs (src, tokenizer_from) copied to this
    host, a gs:// `dst` written to a temporary folder and uploaded after."""
    from ebpo_jax.runtime import storage

    cache = os.path.expanduser("~/.cache/ebpo_jax/hf")
    src = storage.local_copy(src, cache)
    if kw.get("tokenizer_from"):
        kw["tokenizer_from"] = storage.local_copy(kw["tokenizer_from"], cache)
    if not storage.is_remote(dst):
        return fn(src, dst, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(dst))
        config = fn(src, local, **kw)
        storage.upload(local, dst)
    return config


def check_inputs(src: str, *, tokenizer_from=None, lora_run=None) -> None:
    """Each input exists and --src is a checkpoint: else one line naming the flag and path."""
    from absl import app

    from ebpo_jax.runtime import storage

    given = {"src": src, "tokenizer_from": tokenizer_from, "lora_run": lora_run}
    for name, path in given.items():
        if path and not storage.exists(path):
            raise app.UsageError(f"--{name}={path}: no such file or folder")
    if storage.isdir(src) and not any(
        storage.exists(storage.join(src, f)) for f in ("config.json", "model_config.json")
    ):
        raise app.UsageError(
            f"--src={src}: neither an HF checkpoint (no config.json) nor params written by "
            "this script (no model_config.json)"
        )
    if not storage.isdir(src) and not src.endswith(".npz"):
        raise app.UsageError(f"--src={src}: a file, but not .npz params")


def main(argv):
    del argv
    check_inputs(_SRC.value, tokenizer_from=_TOKENIZER.value, lora_run=_LORA_RUN.value)
    if _LORA_RUN.value:
        merge = lambda src, dst, **kw: export_lora(src, _LORA_RUN.value, dst, _PEFT_DST.value, **kw)
        config = on_storage(
            merge, _SRC.value, _DST.value, dtype=_DTYPE.value, max_shard_gb=_SHARD_GB.value
        )
    else:
        config = on_storage(
            convert,
            _SRC.value,
            _DST.value,
            dtype=_DTYPE.value,
            max_shard_gb=_SHARD_GB.value,
            tokenizer_from=_TOKENIZER.value,
        )
    print(
        f"wrote {_DST.value} ({config.model_type}, {config.num_layers} layers, {config.param_dtype})"
    )


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    flags.mark_flags_as_required(["src", "dst"])
    cli.run(main)
