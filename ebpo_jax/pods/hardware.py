"""Accelerator facts the AOT report reads (TPU chips in aot_report, GPUs in gpu_topology)."""

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per-chip facts: HBM, bf16 peak, HBM and interconnect bandwidth, and how names count it."""

    generation: str
    hbm_bytes: int
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    cores_in_name: int  # `v5p-64` counts TensorCores: 2 per chip on v4/v5p
    torus_dims: int  # 3 for v4/v5p, 2 for v5e/v6e
    ici_bandwidth: float = 0.0  # bytes/s a chip sends over all its links (half the bidirectional)
    chips_per_host: int = 4  # a multi-host TPU slice's VMs hold 4 chips; a GPU node 8
