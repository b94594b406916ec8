"""The paper's EBPO recipe on Qwen3-14B for a v5p-64 slice (32 chips); see qwen3_8b.py.

Only the model differs from qwen3_8b.py, whose comment block explains every number. The
same layout holds: pure FSDP (14.8B params + Adam + reference in bf16 are ~4 GB per chip),
one 12288-token row per chip per micro-batch, full remat (40 layers x 120 MiB per row).
The variants (`:paper`, the default carried prior; `:authors`, the released code that
produced the paper's numbers; `:aot`) and `loss.dual_clip = 3.0` (the authors' runs) are
qwen3_8b.py's.
"""

from ebpo_jax.config import finalize, load_sibling


def _qwen3_8b():
    return load_sibling(__file__, "qwen3_8b.py")


def get_config(variant=None):
    return finalize(_qwen3_8b().recipe("qwen3_14b", variant))
