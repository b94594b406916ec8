"""Which JAX backends a process may start: no TPU probe on a machine without a TPU.

With libtpu installed (the `[tpu]` extra, or `[test]` for the AOT tests) JAX tries the TPU
backend at start-up even on a laptop, and libtpu prints `INVALID_ARGUMENT ...
TPU_WORKER_HOSTNAMES` error lines before falling back to the CPU. `skip_absent_tpu()` sets
`JAX_PLATFORMS=cpu` in exactly that case: libtpu importable, no TPU device node, no GPU
plugin, and JAX_PLATFORMS not set by the user (setting it, even to "", turns this off).
"""

import glob
import importlib.util
import os

# Device nodes of Cloud TPU VMs: /dev/accel* (v2-v4), /dev/vfio/<n> (v5e, v5p, v6e).
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def has_tpu_device(globs=TPU_DEVICE_GLOBS) -> bool:
    """Whether this machine exposes a TPU device node."""
    return any(glob.glob(g) for g in globs)


def skip_absent_tpu(environ=os.environ, *, tpu_present: bool | None = None) -> bool:
    """Set JAX_PLATFORMS=cpu when only libtpu's futile probe would run; returns whether it did.

    Must run before JAX starts a backend: the entry points call it through
    `cpu_flags.add_cpu_flags()`; importing ebpo_jax does not (no import side effects). The
    `make train` venv has no libtpu at all: the [test] extra that brings it gets `.venv-test`.
    """
    if "JAX_PLATFORMS" in environ or not _installed("libtpu"):
        return False
    if any(_installed(p) for p in GPU_PLUGINS):
        return False
    if has_tpu_device() if tpu_present is None else tpu_present:
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
