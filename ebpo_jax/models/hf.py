"""Hugging Face interop: read/write Llama-3 and Qwen3 config.json + safetensors, tensor by tensor."""

import json
import math
import os
import re
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ebpo_jax import sharding
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.model import abstract_params
from ebpo_jax.runtime import storage

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Floating safetensors dtypes we convert exactly enough; quantised ones (I8, F8_*) are refused.
_LOADABLE = ("F64", "F32", "BF16", "F16")
_INDEX = "model.safetensors.index.json"

# Our param path -> (HF tensor name, layout). Layouts: "same"; "linear" (HF [out, in] is our
# [in, out]); "heads_in" (HF [N*Dh, D] is our [D, N, Dh]); "heads_out" (HF [D, H*Dh] is our
# [H, Dh, D]). Names with {i} are stacked over layers on our side (over the sparse / dense
# layers for the `moe` / `dense_mlp` stacks of a mixture of experts), {e} over experts.
_TENSORS = {
    ("embed",): ("model.embed_tokens.weight", "same"),
    ("final_norm", "scale"): ("model.norm.weight", "same"),
    ("lm_head",): ("lm_head.weight", "linear"),
    ("layers", "attn_norm", "scale"): ("model.layers.{i}.input_layernorm.weight", "same"),
    ("layers", "mlp_norm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", "same"),
    ("layers", "attn", "q"): ("model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
    ("layers", "attn", "k"): ("model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
    ("layers", "attn", "v"): ("model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
    ("layers", "attn", "o"): ("model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
    ("layers", "attn", "q_norm", "scale"): ("model.layers.{i}.self_attn.q_norm.weight", "same"),
    ("layers", "attn", "k_norm", "scale"): ("model.layers.{i}.self_attn.k_norm.weight", "same"),
    ("layers", "mlp", "gate"): ("model.layers.{i}.mlp.gate_proj.weight", "linear"),
    ("layers", "mlp", "up"): ("model.layers.{i}.mlp.up_proj.weight", "linear"),
    ("layers", "mlp", "down"): ("model.layers.{i}.mlp.down_proj.weight", "linear"),
    ("dense_mlp", "gate"): ("model.layers.{i}.mlp.gate_proj.weight", "linear"),
    ("dense_mlp", "up"): ("model.layers.{i}.mlp.up_proj.weight", "linear"),
    ("dense_mlp", "down"): ("model.layers.{i}.mlp.down_proj.weight", "linear"),
    ("moe", "router"): ("model.layers.{i}.mlp.gate.weight", "linear"),
    ("moe", "gate"): ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "linear"),
    ("moe", "up"): ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "linear"),
    ("moe", "down"): ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "linear"),
}
_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def _layer_ids(config: ModelConfig, stack: str) -> list[int] | None:
    """HF layer index of each row of a stacked param (None: not stacked over layers)."""
    kinds = config.layer_kinds
    if stack == "layers":
        return list(range(config.num_layers))
    if stack in ("moe", "dense_mlp"):
        want = "moe" if stack == "moe" else "dense"
        return [i for i, kind in enumerate(kinds) if kind == want]
    return None


def _hf_tensors(config: ModelConfig, ours: tuple, shape: tuple):
    """[(HF tensor name, index into our array, our per-tensor shape)] for one param."""
    name, _ = _TENSORS[ours]
    ids = _layer_ids(config, ours[0])
    if ids is None:
        return [(name, (), tuple(shape))]
    out = []
    for row, i in enumerate(ids):
        if "{e}" in name:
            out += [(name.format(i=i, e=e), (row, e), tuple(shape[2:])) for e in range(shape[1])]
        else:
            out.append((name.format(i=i), (row,), tuple(shape[1:])))
    return out


def _hf_shape(layout, shape):
    if layout == "same":
        return tuple(shape)
    if layout == "linear":
        return tuple(shape[::-1])
    if layout == "heads_in":
        D, N, Dh = shape
        return (N * Dh, D)
    H, Dh, D = shape
    return (D, H * Dh)


def _from_hf_layout(layout, w, shape):
    if layout == "same":
        return w
    if layout == "linear":
        return w.T
    if layout == "heads_in":
        D, N, Dh = shape
        return w.reshape(N, Dh, D).transpose(2, 0, 1)
    H, Dh, D = shape
    return w.reshape(D, H, Dh).transpose(1, 2, 0)


def _to_hf_layout(layout, w):
    if layout == "same":
        return w
    if layout == "linear":
        return w.T
    if layout == "heads_in":
        D, N, Dh = w.shape
        return w.transpose(1, 2, 0).reshape(N * Dh, D)
    H, Dh, D = w.shape
    return w.transpose(2, 0, 1).reshape(D, H * Dh)


class HFCheckpointError(ValueError):
    """A checkpoint folder's config.json, index or tensors are unusable; names file and field."""


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _NP_DTYPES:
        raise ValueError(f"dtype {dtype!r} can't be honoured; supported: {sorted(_NP_DTYPES)}")
    return name


def config_from_hf_dict(hf: dict, *, dtype=None, source="config.json") -> ModelConfig:
    """ModelConfig from a transformers config dict (rope_parameters or rope_theta/rope_scaling)."""
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: model_type {model_type!r} unsupported; expected one of {sorted(_ARCHITECTURES)}"
        )
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(flag):
            raise HFCheckpointError(f"{source}: {flag}=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFCheckpointError(
            f"{source}: hidden_act={hf['hidden_act']!r} unsupported (only silu)"
        )
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise HFCheckpointError(
            f"{source}: rope_type {rope_type!r} unsupported (default or llama3)"
        )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [k for k in required if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise HFCheckpointError(
            f"{source}: field {missing[0]} is missing or not a positive integer "
            f"(got {hf.get(missing[0])!r})"
        )
    heads = hf["num_attention_heads"]
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = _dtype_name(dtype)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        rope_scaling=tuple(sorted(rope.items())) if rope_type == "llama3" else None,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        model_type=model_type,
        **_moe_from_hf(hf, model_type),
        param_dtype=dtype,
        dtype=dtype,
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
    )


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The ModelConfig MoE fields of a qwen3_moe config.json ({} for dense types)."""
    if model_type != "qwen3_moe":
        return {}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return {
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
    }


def config_to_hf_dict(config: ModelConfig, dtype: str) -> dict:
    """transformers config.json; writes rope both ways so old and new readers agree."""
    scaling = config.rope_scaling_dict
    out = {
        "architectures": [_ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **scaling},
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling or None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if config.model_type == "llama":
        out["mlp_bias"] = False
    if config.is_moe:
        out.update({f: getattr(config, f) for f in _MOE_FIELDS})
        out["mlp_only_layers"] = list(config.mlp_only_layers)
        out["use_sliding_window"] = False
    return out


def _param_paths(config):
    """[(our path tuple, keypath, leaf ShapeDtypeStruct)] for every parameter of `config`."""
    abstract = abstract_params(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    paths = [tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)) for path, _ in flat]
    return paths, [leaf for _, leaf in flat], treedef


def _inside(folder: str, name: str, source: str) -> str:
    """`folder/name`, refusing a name that leaves the folder ("../x", "/abs", a symlink out)."""
    root = os.path.realpath(folder)
    file = os.path.realpath(os.path.join(folder, name))
    if os.path.isabs(name) or os.path.commonpath([root, file]) != root:
        raise HFCheckpointError(
            f"{source}: weight file {name!r} is outside the checkpoint folder {folder}"
        )
    return os.path.join(folder, name)


def _read_index(index: str) -> dict[str, str]:
    """The weight_map of a safetensors index file, every entry a file name inside its folder."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFCheckpointError(
            f"{index}: not a safetensors index with a weight_map ({e})"
        ) from None
    if not isinstance(weight_map, dict):
        raise HFCheckpointError(f"{index}: weight_map is not an object")
    folder = os.path.dirname(index)
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise HFCheckpointError(f"{index}: weight_map[{tensor!r}] is not a file name")
        _inside(folder, file, f"{index}: weight_map[{tensor!r}]")
    return weight_map


class _Reader:
    """Resolves HF tensor names to files (index.json or single file) and reads them lazily."""

    def __init__(self, path, stack: ExitStack):
        self.path, self.stack, self.handles = path, stack, {}
        self.source = path  # what names a bad weight file (the index, once read)
        index = os.path.join(path, _INDEX)
        if os.path.exists(index):
            self.weight_map = _read_index(index)
            self.source = index
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors or {_INDEX} in {path}")
            self.weight_map = {}
            for name in files:
                for key in self._open(name).keys():  # noqa: SIM118 (safe_open is not iterable)
                    self.weight_map[key] = name
            self.source = ", ".join(files)

    def _open(self, name):
        if name not in self.handles:
            file = _inside(self.path, name, self.source)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file} (listed in {_INDEX}) does not exist")
            self.handles[name] = self.stack.enter_context(safe_open(file, framework="numpy"))
        return self.handles[name]

    def read(self, name, expected_shape, np_dtype):
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.source}: tensor {name} is missing")
        file = self.weight_map[name]
        where = f"{os.path.join(self.path, file)}: tensor {name}"
        tensor = self._open(file).get_slice(name)
        if tuple(tensor.get_shape()) != tuple(expected_shape):
            raise HFCheckpointError(
                f"{where} has shape {tuple(tensor.get_shape())}, expected {expected_shape}"
            )
        if tensor.get_dtype() not in _LOADABLE:
            raise HFCheckpointError(
                f"{where} has dtype {tensor.get_dtype()}; only {_LOADABLE} can be loaded"
            )
        return self._open(file).get_tensor(name).astype(np_dtype, copy=False)


def staged(path: str) -> str:
    """A local folder with the checkpoint at `path`: itself, or a `gs://` one copied to
    ~/.cache/ebpo_jax/hf on this host.

    Every host copies the whole folder rather than one host reading and broadcasting: the
    loader reads every tensor on every host anyway (then keeps its shards), object storage
    serves all hosts in parallel at full bandwidth, and no host waits on another.
    """
    return storage.local_copy(path, os.path.expanduser("~/.cache/ebpo_jax/hf"))


def from_hf(path: str, dtype=None, *, mesh=None, rules=None) -> tuple[ModelConfig, object]:
    """Loads a local HF Llama-3/Qwen3 checkpoint folder; params in `dtype` (default: the file's).

    With `mesh`, each parameter goes straight to its sharding (ebpo_jax.sharding rules), so no
    device ever holds the whole model. A `gs://` folder is copied to this host first
    (`staged`).
    """
    path = staged(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{config_file} not found")
    try:
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise HFCheckpointError(f"{config_file}: not a JSON object ({e})") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{config_file}: not a JSON object")
    config = config_from_hf_dict(raw, dtype=dtype, source=config_file)
    np_dtype = _NP_DTYPES[config.param_dtype]
    paths, leaves, treedef = _param_paths(config)
    if mesh is None:
        placements = [None] * len(leaves)
    else:
        abstract = jax.tree_util.tree_unflatten(treedef, leaves)
        placements = jax.tree.leaves(sharding.param_shardings(config, abstract, mesh, rules))
    with ExitStack() as stack:
        reader = _Reader(path, stack)
        # Refuse tensors we would drop (biases, extra modules) before reading any weights.
        known = {"model.layers.{i}.self_attn.rotary_emb.inv_freq", "lm_head.weight"}
        names = known | {_TENSORS[p][0] for p in paths}
        pattern = re.compile(
            "|".join(
                re.escape(n).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+") for n in names
            )
        )
        for name in reader.weight_map:
            if not pattern.fullmatch(name):
                raise HFCheckpointError(
                    f"{path}: unexpected tensor {name} ({reader.weight_map[name]})"
                )
        out = []
        for ours, leaf, placement in zip(paths, leaves, placements):
            layout = _TENSORS[ours][1]
            # Fill a stacked array tensor by tensor: one HF tensor in flight at a time.
            array = np.empty(leaf.shape, np_dtype)
            for name, where, shape in _hf_tensors(config, ours, leaf.shape):
                w = reader.read(name, _hf_shape(layout, shape), np_dtype)
                array[where] = _from_hf_layout(layout, w, shape)
            out.append(jax.device_put(array, placement))
    return config, jax.tree_util.tree_unflatten(treedef, out)


def to_hf(
    config: ModelConfig,
    params,
    path: str,
    *,
    dtype=None,
    max_shard_bytes=5 * 2**30,
    extra_config=None,
) -> None:
    """Writes config.json and safetensors (sharded with an index past max_shard_bytes)."""
    dtype = _dtype_name(dtype or config.param_dtype)
    np_dtype = _NP_DTYPES[dtype]
    expected, _, _ = _param_paths(config)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    got = [tuple(k.key for k in p if isinstance(k, jax.tree_util.DictKey)) for p, _ in flat]
    if got != expected:
        raise ValueError(
            f"params do not match the config: got {sorted(got)}, expected {sorted(expected)}"
        )
    os.makedirs(path, exist_ok=True)

    def tensors():
        for ours, (_, leaf) in zip(expected, flat):
            layout = _TENSORS[ours][1]
            w = np.asarray(jax.device_get(leaf)).astype(np_dtype)
            for name, where, _ in _hf_tensors(config, ours, w.shape):
                yield name, np.ascontiguousarray(_to_hf_layout(layout, w[where]))

    # Shards are flushed as they fill, so only one shard is held in host memory; their final
    # names (…-of-N) are known only at the end.
    written, shard, size = [], {}, 0

    def flush():
        file = os.path.join(path, f"shard-{len(written):05d}.tmp")
        save_file(shard, file, metadata={"format": "pt"})
        written.append((file, list(shard), sum(v.nbytes for v in shard.values())))

    for name, w in tensors():
        if shard and size + w.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name], size = w, size + w.nbytes
    flush()
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for n, (tmp, names, _) in enumerate(written):
            file = f"model-{n + 1:05d}-of-{len(written):05d}.safetensors"
            os.replace(tmp, os.path.join(path, file))
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": sum(w[2] for w in written)}, "weight_map": weight_map}
        with open(os.path.join(path, _INDEX), "w") as f:
            json.dump(index, f, indent=2)
    hf = {**config_to_hf_dict(config, dtype), **(extra_config or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


def param_count(config: ModelConfig) -> int:
    return sum(math.prod(leaf.shape) for leaf in _param_paths(config)[1])


def load_tokenizer(path: str):
    """The checkpoint folder's tokenizer, through transformers.AutoTokenizer (local files only)."""
    path = staged(path)
    import transformers

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path} not found")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
