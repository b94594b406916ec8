"""Grouped matmul of expert-sorted rows: XLA's ragged_dot, or the Pallas megablox kernel on TPU.

`grouped_matmul(x_MK, w_GKN, group_sizes_G)` multiplies rows [start_g, start_g + size_g) of
x by w[g]. "xla" is `jax.lax.ragged_dot` (every backend, partitioned by GSPMD under a mesh);
"megablox" is `jax.experimental.pallas.ops.tpu.megablox.gmm` (with its custom VJP), whose
row count must be a multiple of its row tile: rows are padded to it and the pad dropped.
"""

import jax
import jax.numpy as jnp

from ebpo_jax.models import attention

IMPLS = ("xla", "megablox", "auto")
# megablox's (rows, contraction, output) tile; K and N may be ragged against it.
TILING = (128, 128, 128)


def resolve(impl: str, platform: str | None = None) -> str:
    """The kernel `impl` means: itself, or for "auto" megablox when compiling for TPU, else xla."""
    if impl not in IMPLS:
        raise ValueError(f"moe_impl={impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    platform = attention.compile_platform() if platform is None else platform
    return "megablox" if platform == "tpu" else "xla"


def _tile(n: int, most: int) -> int:
    """The largest power-of-two tile <= most dividing n (n itself when it is smaller)."""
    if n <= most:
        return n
    tile = most
    while n % tile and tile > 8:
        tile //= 2
    return tile if n % tile == 0 else most


def _megablox(x_MK, w_GKN, group_sizes_G, interpret):
    from jax.experimental.pallas.ops.tpu.megablox import ops  # Pallas TPU import, on demand

    M, K = x_MK.shape
    tm = min(TILING[0], -(-M // 8) * 8)
    pad = -M % tm
    x_MK = jnp.pad(x_MK, ((0, pad), (0, 0)))
    tiling = (tm, _tile(K, TILING[1]), _tile(w_GKN.shape[-1], TILING[2]))
    out = ops.gmm(x_MK, w_GKN, group_sizes_G, x_MK.dtype, tiling, None, None, False, interpret)
    return out[:M]


def grouped_matmul(x_MK, w_GKN, group_sizes_G, impl: str = "xla", *, interpret=None):
    """[M, N]: row block g of x_MK (group_sizes_G[g] rows, in order) times w_GKN[g].

    Rows past sum(group_sizes_G) give zeros on the XLA path, unspecified values on megablox.
    `interpret` (megablox): None = interpret unless compiling for TPU (so CPU tests run it).
    """
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    kernel = resolve(impl)
    if kernel == "megablox":
        if interpret is None:
            interpret = attention.compile_platform() != "tpu"
        return _megablox(x_MK, w_GKN, group_sizes_G, interpret)
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G, preferred_element_type=x_MK.dtype)
