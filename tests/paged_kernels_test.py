"""Paged decode attention: the XLA gather path against the TPU kernel's own reference, the
mesh wrapper against the unsharded path, and the TPU kernel's compile for v5p."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_tiny_decode
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models
from ebpo_jax.kernels.paged_shard import per_shard, shard_paged
from ebpo_jax.kernels.paged_xla import paged_decode_attention_xla
from ebpo_jax.pods import aot_report


def make_case(seed, rows, heads, kv_heads, head_dim, page_size, pages_per_row, lens, spare=3):
    """q, a shuffled pool with spare pages, page tables and lengths (float32)."""
    rng = np.random.default_rng(seed)
    pages = rows * pages_per_row + spare
    q = rng.standard_normal((rows, heads, head_dim), np.float32)
    kv = rng.standard_normal((pages, page_size, 2 * kv_heads, head_dim), np.float32)
    table = rng.permutation(pages)[: rows * pages_per_row].reshape(rows, pages_per_row)
    lens = np.asarray(lens, np.int32)
    assert lens.max() <= pages_per_row * page_size
    return jnp.asarray(q), jnp.asarray(kv), jnp.asarray(table, jnp.int32), jnp.asarray(lens)


def kernel_reference(q, kv, table, lens, scale):
    """The TPU kernel module's own reference, one query token per row (jitted: its Python loop
    over rows needs concrete lengths, which stay numpy constants)."""
    R = q.shape[0]
    cu, lens = np.arange(R + 1, dtype=np.int32), np.asarray(lens)
    ref = lambda q, kv, table: ref_ragged_paged_attention(
        q, kv, lens, table, cu, np.array([R], np.int32), sm_scale=scale
    )
    return jax.jit(ref)(q, kv, table)


# (page size, pages per row, heads, kv heads, lengths): lengths end mid-page, on a page
# boundary, at one token, and fill few or all of the row's pages.
CASES = [
    (8, 3, 8, 2, [24, 9, 1, 16]),
    (16, 4, 8, 1, [50, 3, 64, 17, 33, 1]),
    pytest.param(4, 5, 4, 4, [1, 7, 8, 20, 13], marks=pytest.mark.slow),
    pytest.param(1, 6, 6, 3, [6, 2, 5], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("page_size, pages_per_row, heads, kv_heads, lens", CASES)
def test_xla_path_equals_the_kernel_modules_reference(
    page_size, pages_per_row, heads, kv_heads, lens
):
    q, kv, table, kv_lens = make_case(
        0, len(lens), heads, kv_heads, 16, page_size, pages_per_row, lens
    )
    scale = 16**-0.5
    want = kernel_reference(q, kv, table, kv_lens, scale)
    got = paged_decode_attention_xla(q, kv, table, kv_lens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_xla_path_against_float64_softmax_with_idle_rows():
    """Brute force in numpy: row r attends to its own first kv_len tokens; idle rows give 0."""
    lens = [5, 0, 12, 1]
    q, kv, table, kv_lens = make_case(1, 4, 4, 2, 8, 4, 3, lens)
    got = np.asarray(paged_decode_attention_xla(q, kv, table, kv_lens, scale=0.3))
    qn, kvn, tn = (np.asarray(x, np.float64) for x in (q, kv, table))
    for r, n in enumerate(lens):
        tokens = kvn[tn[r].astype(int)].reshape(-1, 4, 8)[:n]
        for h in range(4):
            k, v = tokens[:, 2 * (h // 2)], tokens[:, 2 * (h // 2) + 1]
            s = 0.3 * k @ qn[r, h]
            want = np.exp(s - s.max()) / np.exp(s - s.max()).sum() @ v if n else np.zeros(8)
            np.testing.assert_allclose(got[r, h], want, atol=1e-5, rtol=1e-5)


def test_bad_layout_is_a_one_line_error():
    q, kv, table, lens = make_case(0, 2, 4, 2, 8, 4, 2, [3, 4])
    with pytest.raises(ValueError, match="kv_pages_PSCD combined heads 3"):
        paged_decode_attention_xla(q, kv[:, :, :3], table, lens)
    with pytest.raises(ValueError, match="kv_lens_R shape"):
        paged_decode_attention_xla(q, kv, table, lens[:1])


@pytest.mark.slow
def test_mesh_wrapper_gives_each_row_shard_its_own_pool_slab():
    """data=4 x tp=2: rows and pages split over data (local page indices), heads over tp."""
    shards, slab, rows = 4, 6, 8
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((rows, 4, 8), np.float32))
    kv = jnp.asarray(rng.standard_normal((shards * slab, 4, 4, 8), np.float32))
    local = np.stack([rng.permutation(slab)[:3] for _ in range(rows)]).astype(np.int32)
    lens = jnp.asarray([1, 12, 5, 0, 9, 4, 11, 7], jnp.int32)
    shard_of_row = np.arange(rows) // (rows // shards)
    want = paged_decode_attention_xla(
        q, kv, jnp.asarray(local + slab * shard_of_row[:, None]), lens
    )
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tp"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: shard_paged(paged_decode_attention_xla, *a))(
            q, kv, jnp.asarray(local), lens
        )
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize(
    "D, pages, row_axes, local_heads",
    [
        # The engine's default: D over data, heads over tp. custom_vmap traces the unbatched
        # function too (here unsplit: 6 pages over 4 shards); the program runs the batching
        # rule's call, one shard's pool and its tp half of the heads.
        (4, 6, ("data", "fsdp"), 2),
        # dp attention: D = data x tp shards, one per device, each with all of its heads.
        (8, 4, ("data", "tp"), 4),
    ],
)
def test_vmapped_over_shards_runs_each_shard_on_its_devices(D, pages, row_axes, local_heads):
    """The engine's call: vmap over a leading shard axis D, one pool per shard."""
    R = 4
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((D, R, 4, 8), np.float32))
    kv = jnp.asarray(rng.standard_normal((D, pages, 4, 4, 8), np.float32))
    table = jnp.asarray(
        np.stack([[rng.permutation(pages)[:3] for _ in range(R)] for _ in range(D)])
    )
    lens = jnp.asarray(rng.integers(0, 13, (D, R)), jnp.int32)
    want = jax.vmap(paged_decode_attention_xla)(q, kv, table, lens)
    seen = []

    def local(*a):
        seen.append(a[1].shape)
        return paged_decode_attention_xla(*a)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tp"))
    attend = jax.vmap(per_shard(local, row_axes))
    with jax.set_mesh(mesh):
        got = jax.jit(attend)(q, kv, table, lens)
    assert seen[-1] == (pages, 4, local_heads, 8)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(attend(q, kv, table, lens), want, atol=1e-6)


def _topology_mesh(topology: str, shape) -> Mesh:
    """A (data, tp) mesh over the first devices of a compile-only topology (skips without
    its compiler)."""
    reason = aot_report.compiler_unavailable(topology)
    if reason:
        pytest.skip(f"no compiler for {topology} here: {reason}")
    _, _, devices = aot_report.topology_devices(topology)
    n = shape[0] * shape[1]
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(np.array(devices[:n]).reshape(shape), ("data", "tp"), axis_types=auto)


def _qwen3_8b_layer(mesh, lead, rows, pages, page_size, pages_per_row):
    """Abstract per-layer decode inputs at Qwen3-8B's head shapes (32 heads, 8 kv heads of
    128), with leading axes `lead` ((D,): the engine's one pool per data shard)."""
    data = "data" if "data" in mesh.axis_names else None
    tp = "tp" if "tp" in mesh.axis_names else None
    sh = (data,) + (None,) * len(lead) if lead else (data,)
    n = len(lead)

    def sds(shape, dtype, *rest):
        spec = P(*sh[: n + 1], *rest) if n else P(data, *rest)
        return jax.ShapeDtypeStruct((*lead, *shape), dtype, sharding=NamedSharding(mesh, spec))

    return (
        sds((rows, 32, 128), jnp.bfloat16, tp, None),
        sds((pages, page_size, 16, 128), jnp.bfloat16, None, tp, None),
        sds((rows, pages_per_row), jnp.int32, None),
        sds((rows,), jnp.int32),
    )


@pytest.mark.parametrize(
    "shape, lead", [pytest.param((1, 1), (), marks=pytest.mark.slow), ((2, 2), (2,))]
)
def test_tpu_kernel_compiles_for_v5p(shape, lead):
    """The real kernel, not interpreted: traced under a v5p mesh, compiled for it here, as
    called on one shard or vmapped over the engine's leading shard axis."""
    from ebpo_jax.kernels.ragged_paged_tpu import paged_decode_attention_tpu

    mesh = _topology_mesh("v5p-8", shape)
    args = _qwen3_8b_layer(mesh, lead, rows=64, pages=1024, page_size=64, pages_per_row=48)
    fn = jax.vmap(paged_decode_attention_tpu) if lead else paged_decode_attention_tpu
    t0 = time.perf_counter()
    # Mosaic rejects bf16 matmuls at the "highest" precision conftest sets.
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = jax.jit(fn).lower(*args).compile()
    print(f"compiled in {time.perf_counter() - t0:.1f} s")
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 1 and "ragged_paged_attention" in text
    assert "all-gather" not in text  # each device attends over its own pool slab
    pool = int(np.prod(lead)) * 1024 * 64 * 16 * 128 * 2 // mesh.size
    assert compiled.memory_analysis().temp_size_in_bytes < pool // 4


@pytest.mark.slow
def test_mesh_wrapper_inside_a_callers_shard_map_runs_the_local_kernel():
    """Axes the caller made manual are not split again."""
    q, kv, table, lens = make_case(3, 8, 4, 2, 8, 4, 2, [3, 8, 1, 0, 5, 2, 7, 4], spare=0)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    calls = []

    def local(*a):
        calls.append(a[0].shape)
        return paged_decode_attention_xla(*a)

    spec = (P("data"), P(), P("data"), P("data"))  # a replicated pool: global page ids
    inner = lambda q, kv, t, n: shard_paged(local, q, kv, t, n)
    with jax.set_mesh(mesh):
        got = jax.shard_map(inner, mesh=mesh, in_specs=spec, out_specs=P("data"))(
            q, kv, table, lens
        )
    assert calls == [(2, 4, 8)]
    np.testing.assert_allclose(got, paged_decode_attention_xla(q, kv, table, lens), atol=1e-6)


def test_block_sizes_follow_the_page_size():
    from ebpo_jax.kernels.ragged_paged_tpu import block_sizes

    assert block_sizes(128, 96, 256) == (4, 32)  # 512-token blocks
    assert block_sizes(16, 768, 8) == (16, 8)  # at most 16 pages, at most the rows
    assert block_sizes(1024, 12, 64) == (1, 32)
    assert block_sizes(64, 3, 64) == (3, 32)  # no more pages than a row has


@pytest.mark.slow
@pytest.mark.parametrize(
    "page_size, pages_per_row, heads, kv_heads, lens",
    [
        (8, 3, 4, 2, [24, 9, 1]),
        (4, 20, 8, 2, [80, 3, 41]),  # a padded page table
    ],
)
def test_gpu_kernel_in_the_interpreter_equals_the_xla_path(
    page_size, pages_per_row, heads, kv_heads, lens
):
    """The Triton kernel's own code run by Pallas' interpreter, on the shared layout."""
    from ebpo_jax.kernels.paged_gpu import paged_decode_attention_gpu

    lens = [*lens, 0]  # an idle row
    args = make_case(4, len(lens), heads, kv_heads, 16, page_size, pages_per_row, lens)
    got = paged_decode_attention_gpu(*args, interpret=True)
    np.testing.assert_allclose(got, paged_decode_attention_xla(*args), atol=1e-5, rtol=1e-5)


def test_gpu_kernel_compiles_for_h200():
    """The Triton kernel, vmapped over the engine's shard axis, on a tp=8 H200 node."""
    from ebpo_jax.kernels.paged_gpu import paged_decode_attention_gpu

    mesh = _topology_mesh("8xH200", (1, 8))
    args = _qwen3_8b_layer(mesh, (1,), rows=64, pages=1024, page_size=16, pages_per_row=96)
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = jax.jit(jax.vmap(paged_decode_attention_gpu)).lower(*args).compile()
    assert "paged_attention_block_h" in compiled.as_text()


@pytest.mark.slow
def test_dp_attention_keeps_one_pool_at_four_kv_heads_per_tp_chip():
    """data=1 x tp=4 with 8 kv heads: split over tp the pool is converted around the kernel
    (about 3x it in temporaries); with rows split over tp instead each chip holds all 16
    combined heads of its rows, one pool, and each layer moves q, k, v in one all-to-all and
    the output back in one (no weights gathered)."""
    mesh = _topology_mesh("v5p-8", (1, 4))
    decode, pool = compile_tiny_decode(mesh, "pallas_tpu", dp_attention=True)
    text = decode.as_text()
    assert "ragged_paged_attention" in text
    assert decode.memory_analysis().temp_size_in_bytes < 1.3 * pool
    layers = models.get_config("tiny").num_layers
    moves = re.findall(r"= (\S+) all[-_]to[-_]all(?:-start)?\(", text)
    assert len([m for m in moves if m.startswith("bf16")]) == 2 * layers, moves
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert not [g for g in gathers if g.startswith("bf16[1,")], gathers  # a layer's weight
    split, split_pool = compile_tiny_decode(mesh, "pallas_tpu")
    assert split.memory_analysis().temp_size_in_bytes > 2 * split_pool


@pytest.mark.slow
def test_engine_decode_keeps_one_pool_in_the_kernels_layout():
    """The engine's decode loop on v5p with the kernel: its temporaries hold the pool about
    once (no layout conversion around the kernel) at 8 combined kv heads per chip."""
    decode, pool = compile_tiny_decode(_topology_mesh("v5p-8", (2, 2)), "pallas_tpu")
    assert "ragged_paged_attention" in decode.as_text()
    assert decode.memory_analysis().temp_size_in_bytes < 1.3 * pool
