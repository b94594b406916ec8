"""GPU nodes compiled for on a CPU host: names, target configs, cuDNN lowering, a tiny AOT run.

The compile tests need the CUDA plugin (`pip install -e '.[gpu-aot]'`, in a venv of its own)
and are skipped without it; the default suite's venv does not have it.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_tiny_decode

from ebpo_jax import models
from ebpo_jax.pods import aot_report, gpu_topology

needs_cuda = pytest.mark.skipif(
    gpu_topology.cuda_plugin_available() is not None,
    reason=f"no CUDA compiler here: {gpu_topology.cuda_plugin_available()}",
)


@pytest.mark.parametrize(
    "name, model, nodes, gpus",
    [("8xH100", "h100", 1, 8), ("8xh200", "h200", 1, 8), ("2x8xH100", "h100", 2, 8)],
)
def test_gpu_topology_names(name, model, nodes, gpus):
    gpu, n, g = gpu_topology.parse(name)
    assert (gpu.name, n, g) == (model, nodes, gpus)
    assert gpu.chip.hbm_bytes == int(gpu.memory_bytes * gpu_topology.MEM_FRACTION)


def test_non_gpu_names_are_left_to_tpu_and_listed_in_errors():
    assert gpu_topology.parse("v5p-64") is None and gpu_topology.parse("8xA100") is None
    with pytest.raises(ValueError, match="2x8xH100"):
        aot_report.chip_topology("8xA100")


def test_target_config_carries_the_card():
    text = gpu_topology.target_config(gpu_topology.GPUS["h200"])
    assert 'device_description_str: "NVIDIA H200"' in text
    assert "memory_bandwidth: 4800000000000" in text
    assert f"device_memory_size: {141 * 2**30}" in text
    assert "major: 9" in text and "core_count: 132" in text


@needs_cuda
@pytest.mark.parametrize("name, devices, processes", [("8xH100", 8, 1), ("2x8xH200", 16, 2)])
def test_compile_only_gpu_devices(name, devices, processes):
    _, chip_name, devs = aot_report.topology_devices(name)
    assert len(devs) == devices and len({d.process_index for d in devs}) == processes
    assert devs[0].platform == "gpu" and devs[0].device_kind.startswith("NVIDIA H")
    assert chip_name.endswith(f"{processes}x1x8")


def _gpu_mesh(axes=("fsdp",)):
    _, _, devs = aot_report.topology_devices("8xH100")
    return jax.sharding.Mesh(
        np.array(devs).reshape(8), axes, axis_types=(jax.sharding.AxisType.Auto,)
    )


@needs_cuda
@pytest.mark.parametrize("attn", ["cudnn", "auto"])
def test_model_attention_lowers_to_cudnn_flash(attn):
    """forward and forward_grouped, values and gradients: cuDNN's fused kernels, no [T, T]."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    config = models.get_config("tiny_qwen3", num_layers=1, attention=attn, head_dim=64)
    mesh = _gpu_mesh()
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        models.abstract_params(config),
    )
    rows = NamedSharding(mesh, P("fsdp"))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=rows)
    Tp, N, T = 512, 1024, 2048

    def forward_loss(params, tokens, lengths):
        mask = jnp.arange(T)[None] < lengths[:, None]
        return models.forward(config, params, tokens, mask=mask, return_hidden=True).sum()

    def grouped_loss(params, prompt, plen, comp, clen):
        out_P, out_B = models.forward_grouped(
            config, params, models.GroupedRows(prompt, plen, comp, clen), return_hidden=True
        )
        return out_P.sum() + out_B.sum()

    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        fwd = jax.jit(jax.grad(forward_loss)).lower(params, i32(8, T), i32(8)).compile()
        grouped = (
            jax.jit(jax.grad(grouped_loss))
            .lower(params, i32(8, Tp), i32(8), i32(32, N), i32(32))
            .compile()
        )
    for compiled in (fwd, grouped):
        text = compiled.as_text()
        assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    # Per device one row of [T, T] float32 scores for 4 heads would be 64 MiB.
    assert fwd.memory_analysis().temp_size_in_bytes < 32 * 2**20


@needs_cuda
def test_decode_stays_on_xla_attention():
    """forward_cached (one query row over the cache) uses no cuDNN call, whatever attention says."""
    config = models.get_config("tiny", attention="cudnn")
    params = models.abstract_params(config)
    cache = jax.eval_shape(lambda: models.init_cache(config, 8, 64))
    tok = jax.ShapeDtypeStruct((8, 1), jnp.int32)
    mask = jax.ShapeDtypeStruct((8, 64), jnp.bool_)
    step = lambda p, t, c, m: models.forward_cached(config, p, t, c, models.CacheSlots(5, t, m))
    with jax.set_mesh(_gpu_mesh(("data",))):
        text = jax.jit(step).lower(params, tok, cache, mask).compile().as_text()
    assert "__cudnn$fmha" not in text


_TINY = """
import importlib.util, os
def get_config():
    path = os.path.join({root!r}, "configs", "tiny.py")
    spec = importlib.util.spec_from_file_location("tiny_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.unlock()
    c.mesh.shape, c.mesh.axes = (8,), ("fsdp",)
    c.model.overrides.vocab_size = 256
    c.model.overrides.attention = "auto"
    c.model.overrides.scan_unroll = 1
    c.loss.kl_coef = 0.001
    return c
"""


@needs_cuda
def test_tiny_config_compiles_for_8xh100(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = tmp_path / "tiny_gpu.py"
    cfg.write_text(_TINY.format(root=root))
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        f"{root}/experiments/aot_compile.py",
        f"--config={cfg}",
        "--topology=8xH100",
        "--prompt_len=16",
        "--sampler_mesh=data=4,tp=2",  # tiny has 2 kv heads
        f"--out={out}",
    ]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["chip_topology"] == "h100:1x1x8"
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3"
    names = [p["name"] for p in report["programs"]]
    assert names == ["train update", "reshard weights", "sampler prefill", "sampler decode"]
    budget = int(80 * 2**30 * gpu_topology.MEM_FRACTION)
    for p in report["programs"]:
        assert p["fits"] and p["hbm_bytes"] == budget and p["argument_bytes"] > 0
    assert report["programs"][0]["peak_flops"] == 989e12


@needs_cuda
@pytest.mark.slow
def test_engine_decode_holds_one_pool_on_gpu():
    """The engine's decode for H100 keeps one pool: no per-step copy of it (XLA:GPU copies
    the operands of a lax.cond, which admitting rows once used)."""
    _, _, devs = aot_report.topology_devices("8xH100")
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.sharding.Mesh(np.array(devs).reshape(4, 2), ("data", "tp"), axis_types=auto)
    decode, pool = compile_tiny_decode(mesh, "xla")
    assert decode.memory_analysis().temp_size_in_bytes < 1.3 * pool
