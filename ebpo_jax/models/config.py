"""Decoder hyper-parameters (a hashable dataclass) and named presets."""

import dataclasses
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")
_REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
_MOE_IMPLS = ("xla", "megablox", "auto")
_ATTENTION = ("xla", "splash", "cudnn", "auto")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-3 / Qwen3 decoder shape; frozen so it can be a jit static argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    # Hashable form of HF's rope_scaling dict: sorted (key, value) pairs, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    # Layers per iteration of the full-sequence forward's layer scan. Unrolling lets XLA fuse
    # across layers (1.1-1.3x on the CPU update step of benchmarks/train_bench.py) at the
    # cost of compile time; the KV-cache path always scans single layers (unrolled was slower).
    scan_unroll: int = 1
    max_position_embeddings: int = 8192
    # Full-sequence attention (models/attention.py): "xla" einsums, "splash" (Pallas, TPU),
    # "cudnn" (flash attention, GPU; bf16/fp16), "auto" (cudnn on GPU, splash on TPU, else
    # xla). The KV-cache decode path always uses the XLA attention.
    attention: str = "xla"
    # (logical axis, mesh axes) pairs replacing ebpo_jax.sharding.DEFAULT_RULES; None = default.
    sharding_rules: tuple[tuple[str, Any], ...] | None = None
    # Mixture of experts (Qwen3-MoE; num_experts 0 = dense): HF's field meanings. A layer i
    # is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Grouped matmul of the experts (models/gmm.py): "xla" ragged_dot, "megablox" (Pallas,
    # TPU), "auto" (megablox when compiling for TPU, else xla).
    moe_impl: str = "xla"
    # Batch-invariant numerics (models/invariant.py): a token's logits depend only on its
    # own row; attention, MoE and paged decode then take their invariant XLA paths.
    batch_invariant: bool = False

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.sharding_rules is not None:
            rules = tuple(
                (name, tuple(axes) if isinstance(axes, list) else axes)
                for name, axes in self.sharding_rules
            )
            object.__setattr__(self, "sharding_rules", rules)
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {_DTYPES}"
                )
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(
                f"ModelConfig.batch_invariant={self.batch_invariant!r}; expected a bool"
            )
        if self.remat not in _REMAT:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {_REMAT}")
        if isinstance(self.scan_unroll, bool) or not (
            isinstance(self.scan_unroll, int) and self.scan_unroll >= 1
        ):
            raise ValueError(f"ModelConfig.scan_unroll={self.scan_unroll!r}; expected an int >= 1")
        if self.attention not in _ATTENTION:
            raise ValueError(
                f"ModelConfig.attention={self.attention!r}; expected one of {_ATTENTION}"
            )
        if self.model_type not in _MODEL_TYPES:
            raise ValueError(
                f"ModelConfig.model_type={self.model_type!r}; expected one of {_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        self._check_moe()
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type={rope_type!r} unsupported; expected 'default' or 'llama3'")

    def _check_moe(self):
        if self.moe_impl not in _MOE_IMPLS:
            raise ValueError(
                f"ModelConfig.moe_impl={self.moe_impl!r}; expected one of {_MOE_IMPLS}"
            )
        if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError(
                f"model_type={self.model_type!r} with num_experts={self.num_experts}: "
                "qwen3_moe needs num_experts >= 1, the dense types 0"
            )
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"moe_intermediate_size={self.moe_intermediate_size} and decoder_sparse_step="
                f"{self.decoder_sparse_step} must be >= 1"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of {self.num_layers}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer "moe" or "dense" (HF Qwen3MoeDecoderLayer's rule)."""
        return tuple(
            "moe"
            if self.is_moe
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            else "dense"
            for i in range(self.num_layers)
        )

    @property
    def layer_runs(self) -> tuple[tuple[str, int, int, int], ...]:
        """Maximal runs of one layer kind: (kind, first layer, end layer, index in its stack)."""
        kinds, runs, start, done = self.layer_kinds, [], 0, {"moe": 0, "dense": 0}
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or kinds[i] != kinds[start]:
                runs.append((kinds[start], start, i, done[kinds[start]]))
                done[kinds[start]] += i - start
                start = i
        return tuple(runs)

    @property
    def num_sparse_layers(self) -> int:
        return self.layer_kinds.count("moe")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)


_LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "model_type": "llama",
    "max_position_embeddings": 8192,
    "param_dtype": "bfloat16",
    "dtype": "bfloat16",
    "remat": "dots_with_no_batch_dims_saveable",
}
_QWEN3 = {
    "vocab_size": 151936,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "qk_norm": True,
    "model_type": "qwen3",
    "max_position_embeddings": 40960,
    "param_dtype": "bfloat16",
    "dtype": "bfloat16",
    "remat": "dots_with_no_batch_dims_saveable",
}
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", norm_topk_prob=True)
_TINY_MOE = dict(
    _QWEN3_MOE,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=192,
    num_experts=8,
    num_experts_per_tok=2,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=512,
    param_dtype="float32",
    dtype="float32",
    remat="none",
)
_LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Hyper-parameters copied from each model's config.json on the Hugging Face hub.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    },
    "tiny_qwen3": dict(
        _QWEN3,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        param_dtype="float32",
        dtype="float32",
        remat="none",
    ),
    # Every layer sparse, k * moe_intermediate_size = the tiny default's intermediate_size
    # (configs/tiny.py overrides the rest): the CPU MoE policy.
    "tiny_moe": _TINY_MOE,
    # Layer 0 dense, then sparse every other layer: the mixed layout's scan runs.
    "tiny_moe_mixed": dict(_TINY_MOE, num_layers=4, decoder_sparse_step=2, mlp_only_layers=(0,)),
    "llama3_8b": _LLAMA3_8B,
    "llama3_1_8b": dict(_LLAMA3_8B, rope_scaling=_LLAMA31_SCALING, max_position_embeddings=131072),
    "qwen3_0_6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3_1_7b": dict(
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3_8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3_14b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=40,
        num_heads=40,
        tie_word_embeddings=False,
    ),
    "qwen3_30b_a3b": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        tie_word_embeddings=False,
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """Returns the preset `name` with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown ModelConfig field(s) {bad}; known: {sorted(fields)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
