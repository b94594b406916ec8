"""Grouped matmul of expert-sorted rows: XLA's ragged_dot, or the Pallas megablox kernel on TPU.

`grouped_matmul(x_MK, w_GKN, group_sizes_G)` multiplies rows [start_g, start_g + size_g) of
x by w[g]. "xla" is `jax.lax.ragged_dot` (every backend, partitioned by GSPMD under a mesh);
"megablox" is `jax.experimental.pallas.ops.tpu.megablox.gmm` (with its custom VJP), whose
dims must be multiples of its tiles: rows, K and N are zero-padded and the pad dropped.
"""

import jax
import jax.numpy as jnp

from ebpo_jax.models import attention, invariant

IMPLS = ("xla", "megablox", "auto")
# megablox's (rows, contraction, output) tile; K and N may be ragged against it.
TILING = (128, 128, 128)


def resolve(impl: str, platform: str | None = None) -> str:
    """The kernel `impl` means: itself, or for "auto" megablox when compiling for TPU, else xla.

    (grouped_matmul also keeps "auto" on xla where K or N is not a multiple of 128.)
    """
    if impl not in IMPLS:
        raise ValueError(f"moe_impl={impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    platform = attention.compile_platform() if platform is None else platform
    return "megablox" if platform == "tpu" else "xla"


def _megablox(x_MK, w_GKN, group_sizes_G, interpret):
    from jax.experimental.pallas.ops.tpu.megablox import ops  # Pallas TPU import, on demand

    (M, K), N = x_MK.shape, w_GKN.shape[-1]
    tm = min(TILING[0], -(-M // 8) * 8)
    # TPU blocks are multiples of (8, 128); the backward reuses the tiling with K and N
    # swapped, so both are zero-padded to the tile (padding adds zeros to the products).
    pad = lambda n, t: -n % t
    x_MK = jnp.pad(x_MK, ((0, pad(M, tm)), (0, pad(K, TILING[1]))))
    w_GKN = jnp.pad(w_GKN, ((0, 0), (0, pad(K, TILING[1])), (0, pad(N, TILING[2]))))
    tiling = (tm, TILING[1], TILING[2])
    out = ops.gmm(x_MK, w_GKN, group_sizes_G, x_MK.dtype, tiling, None, None, False, interpret)
    return out[:M, :N]


def _fits_tiles(x_MK, w_GKN) -> bool:
    """K and N are multiples of megablox's tiles: no padding copy of the weights."""
    return x_MK.shape[1] % TILING[1] == 0 and w_GKN.shape[-1] % TILING[2] == 0


def grouped_matmul(x_MK, w_GKN, group_sizes_G, impl: str = "xla", *, interpret=None):
    """[M, N]: row block g of x_MK (group_sizes_G[g] rows, in order) times w_GKN[g].

    Rows past sum(group_sizes_G) give zeros on the XLA path, unspecified values on megablox.
    `interpret` (megablox): None = interpret unless compiling for TPU (so CPU tests run it).
    """
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    kernel = resolve(impl)
    if impl == "auto" and not _fits_tiles(x_MK, w_GKN):
        kernel = "xla"  # e.g. experts' hidden dim split over tp into a non-multiple of 128
    if kernel == "megablox":
        if interpret is None:
            interpret = attention.compile_platform() != "tpu"
        return _megablox(x_MK, w_GKN, group_sizes_G, interpret)
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G, preferred_element_type=x_MK.dtype)


def invariant_grouped(block_fn, x_MK, group_sizes_G, num_groups: int):
    """[M, N]: block_fn(rows [TILE, K], group g) -> [TILE, N] over each group's rows in blocks
    of models.invariant.TILE, so a row's result does not depend on how many share its group.

    Rows past sum(group_sizes_G) give zeros. At most M / TILE + G blocks, padded with zeros.
    """
    T, M, G = invariant.TILE, x_MK.shape[0], num_groups
    sizes_G = group_sizes_G.astype(jnp.int32)
    start_G = jnp.cumsum(sizes_G) - sizes_G
    blocks_G = (sizes_G + T - 1) // T
    end_G = jnp.cumsum(blocks_G)  # blocks of groups 0..g
    b_B = jnp.arange(-(-M // T) + G)
    g_B = jnp.minimum(jnp.searchsorted(end_G, b_B, side="right"), G - 1)
    within_BT = (b_B - (end_G[g_B] - blocks_G[g_B]))[:, None] * T + jnp.arange(T)[None]
    ok_BT = (within_BT < sizes_G[g_B][:, None]) & (b_B < end_G[-1])[:, None]
    row_BT = jnp.where(ok_BT, start_G[g_B][:, None] + within_BT, M)
    x_BTK = jnp.where(ok_BT[..., None], x_MK[jnp.minimum(row_BT, M - 1)], 0)
    y_BTN = jax.lax.map(lambda a: block_fn(*a), (x_BTK, g_B))
    out = jnp.zeros((M, y_BTN.shape[-1]), y_BTN.dtype)
    return out.at[row_BT.reshape(-1)].set(y_BTN.reshape(-1, y_BTN.shape[-1]), mode="drop")
