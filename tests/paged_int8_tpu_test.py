"""The int8 paged decode kernel for TPU (kernels/paged_int8_tpu.py): run by Pallas' TPU
interpreter on CPU against the XLA int8 path and a float64 reference, and compiled by Mosaic
for v5p without a device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kv_int8_test import _case, _int8, _swap_pairs

from ebpo_jax.kernels import quant
from ebpo_jax.kernels.paged_int8_tpu import paged_int8_decode
from ebpo_jax.kernels.paged_xla import paged_decode_attention_xla
from ebpo_jax.kernels.ragged_paged_tpu import paged_decode_attention_tpu
from ebpo_jax.sampler import attention

# float32 sums over <= 80 tokens; outputs reach 25 (outlier heads), so 1e-4 is 4e-6 of the
# largest: each path is 1.6e-5 from float64, and they differ by 3.3e-5 (a few float32 ulps).
TOL = dict(rtol=1e-5, atol=1e-4)


def _float64(q, values, scales, table, lens):
    """softmax(q k / sqrt(D)) v per row and head in float64, K/V = int8 values x scales
    (head-major pages, as stored)."""
    R, H, D = q.shape
    kv = np.asarray(values, np.float64) * np.asarray(scales, np.float64)[..., None]
    kv = np.swapaxes(kv, 1, 2)  # [P, S, 2K, D]
    K = kv.shape[2] // 2
    table = np.minimum(np.asarray(table), len(kv) - 1)  # "none" columns: never read
    kv_RTCD = kv[table].reshape(R, -1, 2 * K, D)
    out = np.zeros((R, H, D))
    for r, n in enumerate(np.asarray(lens)):
        for h in range(H if n else 0):
            k = h // (H // K)
            s = kv_RTCD[r, :n, 2 * k] @ np.asarray(q[r, h], np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            out[r, h] = p @ kv_RTCD[r, :n, 2 * k + 1] / p.sum()
    return out


def _kernel_case(seed, **kw):
    """A ragged int8 case: lengths 1, a full last page, mid-page, idle; 4 query heads a kv head.
    As in the engine, a row's table holds the page id one past the pool after its pages."""
    q, kv, table, lens = _case(seed, rows=5, kv_heads=2, group=4, d=128, page_size=16, **kw)
    lens[:] = [37, 0, 5 * 16, 1, 16]
    table[np.arange(table.shape[1])[None] >= -(-lens[:, None] // 16)] = kv.shape[0]
    return jnp.asarray(q), _int8(kv), jnp.asarray(table), jnp.asarray(lens)


@pytest.mark.parametrize(
    "pages_per_block",
    [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)],
)
def test_kernel_in_the_interpreter_equals_the_xla_path_and_float64(pages_per_block):
    """Blocks of 1, 2 (not dividing the 5-page table) and 4 pages; idle row 1 gives 0."""
    q, kv8, table, lens = _kernel_case(0, num_pages=40, width=5)
    got = paged_int8_decode(
        q, kv8, table, lens, scale=128**-0.5, pages_per_block=pages_per_block,
        interpret=pltpu.InterpretParams(),
    )  # fmt: skip
    got = np.asarray(got)
    np.testing.assert_allclose(got, paged_decode_attention_xla(q, kv8, table, lens), **TOL)
    np.testing.assert_allclose(got, _float64(q, *kv8, table, lens), **TOL)
    np.testing.assert_array_equal(got[1], 0.0)
    # The case sees the scales: ignoring them, or swapping keys' and values', is far off.
    unscaled = _float64(q, kv8.values, np.ones_like(kv8.scales) / 127, table, lens)
    swapped = _float64(q, kv8.values, _swap_pairs(kv8.scales), table, lens)
    for wrong in (unscaled, swapped):
        assert np.abs(wrong - got).max(axis=(1, 2))[np.asarray(lens) > 0].min() > 1e-2


def test_bfloat16_queries_and_the_tpu_wrapper_route_int8_pages_to_the_kernel():
    """The engine's TPU entry point on int8 pages runs this kernel (interpreted here): its
    float32 math on bfloat16 queries is within bfloat16's output rounding of float64."""
    q, kv8, table, lens = _kernel_case(1, num_pages=40, width=5)
    q16 = q.astype(jnp.bfloat16)
    got = paged_decode_attention_tpu(q16, kv8, table, lens, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = _float64(q16.astype(jnp.float32), *kv8, table, lens)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=2e-2)
    assert attention.resolve("auto", "tpu") == "pallas_tpu"


@pytest.mark.slow
def test_kernel_compiles_for_v5p_in_the_engines_layout():
    """Mosaic lowers the kernel for v5p at Qwen3-8B's shapes as the pod's engine calls it (dp
    attention: one pool per chip with all 16 combined kv heads of 128, pages of 128), vmapped
    over the data shards: the program holds it as a tpu_custom_call, gathers no pool, and
    copies neither the int8 pages nor their scales (it reads them head-major, as stored)."""
    from paged_kernels_test import _topology_mesh

    mesh = _topology_mesh("v5p-8", (2, 2))
    shards = jax.sharding.PartitionSpec(("data", "tp"))
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(
        (4, *shape), dtype, sharding=jax.sharding.NamedSharding(mesh, shards)
    )
    pages = (1024, 16, 128)  # head-major: pages, combined heads, page_size
    args = (
        sds((64, 32, 128), jnp.bfloat16),
        quant.Int8Pages(sds((*pages, 128), jnp.int8), sds(pages, jnp.float32)),
        sds((64, 96), jnp.int32),
        sds((64,), jnp.int32),
    )
    attend = jax.vmap(lambda *a: paged_decode_attention_tpu(*a, row_axes=("data", "tp")))
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = jax.jit(attend).lower(*args).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "paged_int8_decode" in text
    assert "all-gather" not in text
    pool_bytes = 1024 * 128 * 16 * 128
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 64


@pytest.mark.slow
def test_the_engine_on_int8_pages_draws_the_xla_paths_rows_through_the_kernel(monkeypatch):
    """generate with attention="pallas_tpu" runs the kernel (interpreted) at every decode
    step: the same greedy tokens as the "xla" path and log-probs within float32 rounding."""
    from kv_int8_test import CONFIG, _generate

    from ebpo_jax import models
    from ebpo_jax.kernels import paged_int8_tpu, ragged_paged_tpu

    params = models.init_params(CONFIG, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    want = _generate(params, "int8")
    calls = []

    def interpreted(*args, **kw):
        calls.append(kw)
        return paged_int8_tpu.paged_int8_decode(*args, **kw | {"interpret": True})

    monkeypatch.setattr(ragged_paged_tpu, "paged_int8_decode", interpreted)
    got = _generate(params, "int8", attention="pallas_tpu")
    assert len(calls) >= CONFIG.num_layers  # traced at least once per layer
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dp_attention", [True, False], ids=["dp_attention", "heads_split"])
def test_the_engines_int8_decode_on_v5p_holds_the_pool_about_once(dp_attention):
    """The engine's decode loop with int8 pages, compiled for v5p on tp=4 (32 heads, 8 kv heads
    of 128, pages of 128): its temporaries hold the pool about once, with attention
    data-parallel (16 combined kv heads a chip) and with heads split (4 a chip).

    Two layouts made XLA convert the pool around every step's kernel call. Scales written as
    [C]-wide windows (each token's are now written element-wise): 1.55x the pool with dp
    attention. Pages stored token-major [P, S, C, D], whose (C, D) tile pads to int8's 32
    rows at 4 combined heads (they are now head-major): 3.0x with heads split."""
    from paged_kernels_test import _topology_mesh

    from ebpo_jax import models
    from ebpo_jax.pods import aot
    from ebpo_jax.sampler import SamplerSpec, Sampling
    from ebpo_jax.sharding import param_shardings

    mesh = _topology_mesh("v5p-8", (1, 4))
    mc = models.get_config("tiny", head_dim=128, num_kv_heads=8, num_heads=32, dtype="bfloat16")
    params = models.abstract_params(mc)
    params = aot.abstract(params, param_shardings(mc, params, mesh))
    spec = SamplerSpec(
        max_new_tokens=256, num_samples=2, eos_ids=(1,), sampling=Sampling(), page_size=128,
        kv_pages=2048, attention="pallas_tpu", dp_attention=dp_attention, kv_dtype="int8",
    )  # fmt: skip
    with jax.default_matmul_precision("default"):
        programs = aot.compile_sampler(spec, mc, mesh, params, 8, 128)
    decode = programs["decode"][2]
    assert "paged_int8_decode" in decode.as_text()
    tp = 1 if dp_attention else 4
    pool = programs["plan"].pages * aot.page_bytes_per_chip(mc, 128, tp=tp, kv_dtype="int8")
    assert decode.memory_analysis().temp_size_in_bytes < 1.2 * pool
