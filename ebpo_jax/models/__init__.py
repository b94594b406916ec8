"""Llama-3 / Qwen3 decoder in Flax NNX with a functional (params-pytree) interface."""

from ebpo_jax.models.config import PRESETS, ModelConfig, get_config
from ebpo_jax.models.hf import from_hf, load_tokenizer, to_hf
from ebpo_jax.models.model import (
    CacheSlots,
    GroupedRows,
    Segments,
    abstract_params,
    decode_step,
    forward,
    forward_cached,
    forward_grouped,
    head_logprobs,
    init_cache,
    init_params,
    output_embedding,
    prefill,
    split_layers,
)

__all__ = [
    "PRESETS",
    "CacheSlots",
    "GroupedRows",
    "ModelConfig",
    "Segments",
    "abstract_params",
    "decode_step",
    "forward",
    "forward_cached",
    "forward_grouped",
    "from_hf",
    "get_config",
    "head_logprobs",
    "init_cache",
    "init_params",
    "load_tokenizer",
    "output_embedding",
    "prefill",
    "split_layers",
    "to_hf",
]
