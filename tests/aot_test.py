"""AOT: topology names, analytic parameter counts, and a tiny config compiled for TPU v5e 2x2."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ebpo_jax import models
from ebpo_jax.pods import aot_report as aot


@pytest.mark.parametrize(
    "name, chip_name",
    [
        ("v5p-8", "v5p:2x2x1"),
        ("v5p-16", "v5p:2x2x2"),
        ("v5p-64", "v5p:2x4x4"),  # 64 TensorCores = 32 chips
        ("v5p-128", "v5p:4x4x4"),
        ("v5p-256", "v5p:4x4x8"),
        ("v4-32", "v4:2x2x4"),
        ("v5e-4", "v5e:2x2"),
        ("v5e-32", "v5e:4x8"),
        ("v5e-64", "v5e:8x8"),  # v5e names count chips
        ("v5litepod-16", "v5e:4x4"),
        ("v6e-64", "v6e:8x8"),
        ("v6e-256", "v6e:16x16"),
        ("V5P:2x4x4", "v5p:2x4x4"),
        ("v5e:2x4", "v5e:2x4"),
    ],
)
def test_topology_names_translate_to_chip_topologies(name, chip_name):
    spec, got = aot.chip_topology(name)
    assert got == chip_name
    chips = int(np.prod([int(x) for x in got.split(":")[1].split("x")]))
    if "-" in name:
        assert chips * spec.cores_in_name == int(name.split("-")[1])


@pytest.mark.parametrize(
    "name", ["v5p-64x", "tpu-64", "v7-64", "v5p-6", "v5e-2", "v5p:2x4", "v5e:2x2x1"]
)
def test_unknown_topology_is_a_clear_error_listing_known_names(name):
    with pytest.raises(ValueError, match="known: .*v5p-64"):
        aot.chip_topology(name)


def test_unknown_programs_is_refused_before_anything_is_built():
    from ebpo_jax.pods import aot as aot_compile

    with pytest.raises(ValueError, match=r"programs='both': expected one of \('all', 'update'"):
        aot_compile.run(None, "v5e-4", aot_compile.Workload(8), programs="both")


@pytest.mark.parametrize("preset", ["tiny", "tiny_qwen3", "qwen3_8b", "llama3_1_8b"])
def test_parameter_counts_match_the_model(preset):
    mc = models.get_config(preset)
    params = models.abstract_params(mc)  # shapes only: an 8B model costs nothing here
    sizes = {
        jax.tree_util.keystr(p): int(np.prod(x.shape))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert aot.total_params(mc) == sum(sizes.values())
    mats = ("'q'", "'k'", "'v'", "'o'", "'gate'", "'up'", "'down'")
    layers = sum(
        n for k, n in sizes.items() if k.startswith("['layers']") and any(m in k for m in mats)
    )
    assert aot.matmul_params(mc)["layers"] == layers


def test_report_fits_and_time_at_peak():
    r = aot.ProgramReport(
        "p", "fsdp=4", 10, 6, 4, 3, 1, hbm_bytes=16, flops_per_device=2e12, peak_flops=1e12
    )
    assert r.peak_bytes == 15 and r.fits and r.time_at_peak_s == 2.0
    r.temp_bytes = 5
    assert not r.fits
    assert "NO" in aot.format_table([r])


_TINY = """
import importlib.util, os
def get_config():
    path = os.path.join({root!r}, "configs", "tiny.py")
    spec = importlib.util.spec_from_file_location("tiny_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.unlock()
    c.mesh.shape, c.mesh.axes = (2, 2), ("fsdp", "tp")
    c.model.overrides.vocab_size = 256
    c.loss.kl_coef = 0.001
    return c
"""


@pytest.fixture(scope="module")
def tiny_config_file(tmp_path_factory):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path_factory.mktemp("cfg") / "tiny_aot.py"
    path.write_text(_TINY.format(root=root))
    return root, path


MULTI_TURN = ["--config.task.env=calculator", "--config.rollout.max_turns=2"]


@pytest.mark.parametrize(
    "extra,programs",
    [
        ([], ["sampler decode"]),
        pytest.param(
            MULTI_TURN,
            ["sampler first turn", "sampler decode"],
            marks=pytest.mark.slow,
            id="multiturn",
        ),
    ],
)
def test_tiny_config_compiles_for_tpu_v5e_2x2(tiny_config_file, tmp_path, extra, programs):
    reason = aot.libtpu_available()
    if reason:
        pytest.skip(f"no TPU compiler here: {reason}")
    root, cfg = tiny_config_file
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        f"{root}/experiments/aot_compile.py",
        f"--config={cfg}",
        "--topology=v5e-4",
        "--prompt_len=16",
        "--sampler_mesh=data=4",
        f"--out={out}",
        *extra,
    ]
    env = dict(os.environ, EBPO_JAX_COMPILATION_CACHE=str(tmp_path / "xla"))
    run = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=600, cwd=root, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (tmp_path / "xla").exists()  # nothing it compiles could be read back
    report = json.loads(out.read_text())
    assert report["chip_topology"] == "v5e:2x2" and report["device_kind"] == "TPU v5 lite"
    names = [p["name"] for p in report["programs"]]
    assert names == ["train update", "reshard weights", "sampler prefill", *programs]
    for p in report["programs"]:
        assert p["fits"] and p["hbm_bytes"] == 16 * 2**30
        assert p["argument_bytes"] > 0
    assert "train update" in run.stdout and "t@peak" in run.stdout


def test_splash_attention_compiles_to_the_pallas_kernel_for_tpu():
    reason = aot.libtpu_available()
    if reason:
        pytest.skip(f"no TPU compiler here: {reason}")
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ebpo_jax.models import splash

    _, _, devices = aot.topology_devices("v5e-4")
    mesh = Mesh(
        np.array(devices).reshape(2, 2),
        ("fsdp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    sh = NamedSharding(mesh, P("fsdp", None, "tp", None))
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((4, 1024, 4, 128), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((4, 1024), jnp.bool_, sharding=NamedSharding(mesh, P("fsdp")))

    def grad_q(q, k, v, s):  # forward and backward kernels, per shard under shard_map
        loss = lambda q: splash.attention(q, k, v, s, scale=0.1).astype(jnp.float32).sum()
        return jax.grad(loss)(q)

    # A TPU mesh: compiled, not interpreted, though this host is a CPU. Mosaic rejects bf16
    # matmuls at the "highest" precision conftest sets (forward and backward kernels alike).
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = jax.jit(grad_q).lower(q, kv, kv, seg).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2
    # Per device the [T, T] scores never exist: 1024^2 x 4 heads x 4 bytes would be 16 MiB.
    assert compiled.memory_analysis().temp_size_in_bytes < 8 * 2**20


def test_slot_schedule_and_step_estimate_by_hand():
    """Rows of 3, 1, 2 tokens in 2 slots: 2 steps of 3 blocks (slots at 11, then 12)."""
    from ebpo_jax.pods.aot_report import _slot_schedule

    blocks, refills = _slot_schedule(np.array([[3, 1, 2]]), 2, prompt_tokens=10, block=4)
    np.testing.assert_array_equal(blocks, [3, 3])
    np.testing.assert_array_equal(refills, [True, True])
    # Every row at the limit and a slot per row: the static schedule, N - 1 steps per call.
    lengths = aot.Lengths(at_limit=1.0)
    np.testing.assert_array_equal(lengths.draw(8, 16), 16)
    assert 3.9 < aot.Lengths(response_mean=4.0).draw(4000, 16).mean() < 4.1
