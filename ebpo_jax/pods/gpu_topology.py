"""NVIDIA GPU nodes as compile-only devices on a CPU host: names, chip facts, target configs.

`8xH100`, `8xH200` or `2x8xH100` (nodes x GPUs per node) becomes
`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="<nodes>x1x<gpus>",
target_config=<GpuTargetConfig text proto>)`: the CUDA PJRT plugin (`pip install -e
'.[gpu-aot]'`) then compiles for those devices with none present, as libtpu does for TPU
topologies. The topology string is slices x hosts per slice x devices per host; a node is its
own NVLink domain, so n nodes are n slices of one 8-GPU host.

The process must keep JAX on the CPU (`JAX_PLATFORMS=cpu`, set by experiments/aot_compile.py)
and never initialise the CUDA backend. Compiling without a device means no autotuning (XLA
takes its default GEMM configs) and, probably, cuDNN workspace not counted in temp bytes.
"""

import dataclasses
import re

from ebpo_jax.pods.hardware import ChipSpec, GiB

# The fraction of device memory JAX may use: XLA_PYTHON_CLIENT_MEM_FRACTION in the GPU
# configs' launch line (JAX's default, 0.75, would leave a quarter of every GPU unused).
MEM_FRACTION = 0.95
# NVLink 4 sends 450 GB/s per GPU (900 GB/s bidirectional, the H100/H200 SXM data sheets).
NVLINK = 450e9


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """One GPU model: the report's facts and the XLA target description it compiles for."""

    name: str  # as typed in topology names
    description: str  # the CUDA device name, `device_kind` of the compile-only devices
    memory_bytes: int
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    core_count: int  # streaming multiprocessors
    l2_cache_bytes: int
    clock_ghz: float

    @property
    def chip(self) -> ChipSpec:
        """The ChipSpec aot.run reads: HBM as the budget JAX gets (MEM_FRACTION of the card)."""
        hbm = int(self.memory_bytes * MEM_FRACTION)
        return ChipSpec(self.name, hbm, self.peak_flops, self.hbm_bandwidth, 1, 3, NVLINK, 8)


# SXM5 parts; both are compute capability 9.0 with 132 SMs. Peaks are NVIDIA's dense bf16
# figures (989 TFLOP/s; the 1979 in the data sheets assumes 2:4 sparsity).
GPUS = {
    "h100": GpuModel(
        "h100", "NVIDIA H100 80GB HBM3", 80 * GiB, 989e12, 3.35e12, 132, 50 * 2**20, 1.98
    ),
    "h200": GpuModel("h200", "NVIDIA H200", 141 * GiB, 989e12, 4.8e12, 132, 50 * 2**20, 1.98),
}
_NAME_RE = re.compile(r"^(?:(\d+)x)?(\d+)x(h100|h200)$")


def known_topologies() -> str:
    return f"GPU nodes [<nodes>x]<gpus>x<model>, model in {'/'.join(GPUS)}, e.g. 8xH100, 2x8xH100"


def parse(name: str):
    """(GpuModel, nodes, gpus per node) for a name like `8xH100` or `2x8xH100`, else None."""
    m = _NAME_RE.match(name.strip().lower())
    if not m:
        return None
    nodes, gpus = int(m.group(1) or 1), int(m.group(2))
    if nodes < 1 or gpus < 1:
        raise ValueError(f"topology {name!r}: node and GPU counts must be >= 1")
    return GPUS[m.group(3)], nodes, gpus


def target_config(gpu: GpuModel) -> str:
    """The GpuTargetConfig text proto (xla/stream_executor/device_description.proto) for `gpu`.

    Per-SM limits are Hopper's (sm_90): 228 KiB shared memory per SM, 227 KiB per block
    opt-in, 64K registers, 2048 threads.
    """
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {gpu.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.hbm_bandwidth)}
  l2_cache_size: {gpu.l2_cache_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    minor: 0
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{gpu.description}"
"""


def cuda_plugin_available() -> str | None:
    """None when CUDA topologies can be built here, else the reason they cannot."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return "the CUDA plugin is not installed (pip install -e '.[gpu-aot]')"
    return None


def topology_devices(name: str):
    """(ChipSpec, `<model>:<nodes>x1x<gpus>` name, compile-only CUDA devices) for `name`."""
    from jax.experimental import topologies

    gpu, nodes, gpus = parse(name)
    topo = f"{nodes}x1x{gpus}"
    desc = topologies.get_topology_desc(
        platform="cuda", topology=topo, target_config=target_config(gpu)
    )
    return gpu.chip, f"{gpu.name}:{topo}", list(desc.devices)
