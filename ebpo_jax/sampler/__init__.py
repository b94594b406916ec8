"""Batched autoregressive sampling over a paged KV cache (one engine, one entry point).

spec: the typed SamplerSpec and the Generation; api: generate, and TurnSession (rows
continued over several calls with their pages kept); engine: prefill and the
decode loop; schedule: slots, admission and page ownership; pages: the page pools;
attention: ragged paged decode attention; selection: greedy / top-k / top-p token choice;
layout: rows, slots and pages over a mesh.
"""

from ebpo_jax.sampler.api import TurnSession, generate, generate_with_stats
from ebpo_jax.sampler.engine import Stats
from ebpo_jax.sampler.spec import PAD_ID, Generation, SamplerSpec, Sampling

__all__ = [
    "PAD_ID",
    "Generation",
    "SamplerSpec",
    "Sampling",
    "Stats",
    "TurnSession",
    "generate",
    "generate_with_stats",
]
