"""Batched autoregressive sampling over a paged KV cache (one engine, one entry point).

spec: the typed SamplerSpec and the Generation (tokens, log-probs, lengths, the decode's
stats, recorded routing); api: generate, one call of a Session, which also continues rows
over several calls with their pages kept (multi-turn) and gives AOT its programs; engine:
prefill and the decode loop; schedule: slots, admission and page ownership; pages: the page pools;
attention: ragged paged decode attention; selection: greedy / top-k / top-p token choice;
layout: rows, slots and pages over a mesh.
"""

from ebpo_jax.sampler.api import Session, generate
from ebpo_jax.sampler.engine import Stats
from ebpo_jax.sampler.spec import PAD_ID, Generation, SamplerSpec, Sampling

__all__ = [
    "PAD_ID",
    "Generation",
    "SamplerSpec",
    "Sampling",
    "Session",
    "Stats",
    "generate",
]
