"""The paper's EBPO recipe on LLaMA-3.1-8B for a v5p-64 slice (32 chips); see qwen3_8b.py.

The paper trains LLaMA3.1-8B, so the preset is `llama3_1_8b` (llama3 RoPE scaling, 128k
positions; plain Llama-3-8B stops at 8192 positions, under the 12288-token rows). Every
other number is qwen3_8b.py's, explained there; 128k vocabulary, 32 layers of 96 MiB
per row under full remat.
The variants (`:paper`, the default carried prior; `:authors`, the released code that
produced the paper's numbers; `:aot`) and `loss.dual_clip = 3.0` (the authors' runs) are
qwen3_8b.py's.
"""

from ebpo_jax.config import finalize, load_sibling


def _qwen3_8b():
    return load_sibling(__file__, "qwen3_8b.py")


def get_config(variant=None):
    return finalize(_qwen3_8b().recipe("llama3_1_8b", variant))
