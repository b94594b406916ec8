"""What `generate` takes and returns: the typed sampler spec and the Generation.

Padding convention of a `Generation` (rows = prompts x samples, prompt-major):
  tokens[r, :lengths[r]] are the generated tokens (the last one is the stop id if the row
  stopped on one); tokens[r, lengths[r]:] == 0 (pad id 0).
  logprobs[r, t] is log p(tokens[r, t] | prompt, tokens[r, :t]) under the policy at
  temperature 1 over the full vocabulary, whatever temperature/top-k/top-p sampled it;
  0 at padding.
"""

from typing import NamedTuple

import jax
import numpy as np

from ebpo_jax import schema
from ebpo_jax.kernels import quant
from ebpo_jax.sampler import selection

PAD_ID = 0
ATTENTION_IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


_config = schema.default_of(schema.Sampler)  # the defaults are the config's, declared once


class Sampling(NamedTuple):
    """How a token is chosen from the logits; temperature 0 is greedy."""

    temperature: float = _config("temperature")
    top_k: int = _config("top_k")  # 0 = off
    top_p: float = _config("top_p")


class SamplerSpec(NamedTuple):
    """Everything static about one `generate` call (hashable: one jit per spec).

    Limits: max_new_tokens N per row, stop ids. Slots: rows decoded at once (0 or >= rows:
    every row at once, the static batch; fewer: a slot is refilled as its row ends). Pages:
    the KV cache is `kv_pages` pages of `page_size` tokens over all data shards (0 = enough
    for every slot's longest row, so admission never waits).
    """

    max_new_tokens: int
    num_samples: int = 1
    eos_ids: tuple = ()  # stop ids (an int or None are accepted too)
    sampling: Sampling = Sampling()
    slots: int = _config("slots")
    page_size: int = _config("page_size")
    kv_pages: int = _config("kv_pages")
    attention: str = _config("attention")  # paged decode attention: attention.IMPLS or "auto"
    # KV pages: "" = the model's compute dtype; "int8" = int8 values with a float32 scale per
    # token and kv head beside them (kernels/quant.py), half the bytes of bfloat16.
    kv_dtype: str = _config("kv_dtype")
    # Rows and their pages split over the mesh's tp axis too (attention data-parallel over
    # the tp chips, each holding every kv head of its rows); the weights stay split over tp.
    dp_attention: bool = _config("dp_attention")
    # Mixture of experts: the experts split over the data axes (models/moe.py, expert
    # parallelism); the sampler's weights must lie so (trainer/shardings.py).
    expert_parallel: bool = _config("expert_parallel")
    # A decode step runs on the smallest of `live_buckets` batch sizes (slots x j / buckets
    # per shard) that holds its live rows, so a step with few live rows computes few; each
    # size compiles its own forward. 1: every slot at every step.
    live_buckets: int = _config("live_buckets")
    # Mixture of experts: the Generation's routing holds every input token's experts.
    record_routing: bool = schema.default_of(schema.Moe)("routing_replay")

    @classmethod
    def from_config(
        cls,
        sampler: schema.Sampler,
        moe: schema.Moe = schema.Moe(),
        *,
        num_samples: int = 1,
        eos_ids=(),
        max_new_tokens: int = 0,
    ) -> "SamplerSpec":
        """One call as the `sampler` and `model.moe` sections say (all but `UNCARRIED`);
        `max_new_tokens` > 0 replaces sampler.max_new_tokens (a multi-turn run's turn)."""
        carried = {f: getattr(sampler, f) for f in cls._fields if hasattr(sampler, f)}
        carried["max_new_tokens"] = max_new_tokens or sampler.max_new_tokens
        return cls(
            **carried,
            num_samples=num_samples,
            eos_ids=tuple(int(e) for e in np.atleast_1d(eos_ids)),
            sampling=Sampling(sampler.temperature, sampler.top_k, sampler.top_p),
            record_routing=moe.routing_replay,
        )


# `sampler.*` fields a call does not take: the rollout's chunking, the sampler's mesh and its
# copy of the weights are the trainer's (trainer/shardings.py, trainer/step.py).
UNCARRIED = ("prompts_per_call", "mesh", "param_dtype")


class Generation(NamedTuple):
    """Sampled completions; the module docstring gives the padding convention."""

    tokens: jax.Array  # [rows, N] int32
    logprobs: jax.Array  # [rows, N] float32
    lengths: jax.Array  # [rows] int32, generated tokens including the stop id
    stats: object = None  # engine.Stats of the decode that made it
    # spec.record_routing: {"prompt": [rows, sparse layers, Tp, k], "comp": [rows, sparse
    # layers, N, k]}, every input token's experts; None when not recorded.
    routing: object = None


def check_int(name, value, minimum):
    """ValueError unless `value` is an int >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def validated(spec: SamplerSpec, vocab_size: int) -> SamplerSpec:
    """The spec with plain Python values, after one-line checks of every field."""
    if not isinstance(spec, SamplerSpec):
        raise TypeError(f"spec must be a sampler.SamplerSpec, got {type(spec).__name__}")
    check_int("max_new_tokens", spec.max_new_tokens, 1)
    check_int("num_samples", spec.num_samples, 1)
    check_int("slots", spec.slots, 0)
    check_int("page_size", spec.page_size, 1)
    check_int("kv_pages", spec.kv_pages, 0)
    check_int("live_buckets", spec.live_buckets, 1)
    for name in ("record_routing", "dp_attention", "expert_parallel"):
        if not isinstance(getattr(spec, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(spec, name)!r}")
    if spec.attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention={spec.attention!r}; expected one of {ATTENTION_IMPLS}")
    if spec.kv_dtype not in quant.DTYPES:
        raise ValueError(f"kv_dtype={spec.kv_dtype!r}; expected one of {quant.DTYPES}")
    s = spec.sampling
    eos = selection.validate_sampling(s.temperature, s.top_p, s.top_k, spec.eos_ids, vocab_size)
    sampling = Sampling(float(s.temperature), int(s.top_k), float(s.top_p))
    return spec._replace(eos_ids=eos, sampling=sampling)
