"""Test set-up: 8 fake CPU devices, float32 matmuls at full precision."""

import os

# Must happen before jax is imported anywhere: multi-device code is tested on
# 8 fake CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# With libtpu installed (the [tpu] extra) JAX would probe for a TPU at every start;
# TPU topologies for the AOT tests are still built on a CPU-only backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from ebpo_jax.cpu_flags import add_cpu_flags

add_cpu_flags()  # the flags the entry points set, so tests run what users run

import jax

jax.config.update("jax_default_matmul_precision", "highest")


def load_experiment(name: str):
    """experiments/<name>.py as a module, loaded once per process (its absl flags can be
    defined only once); test files share it through sys.modules."""
    import importlib.util
    import sys

    key = f"experiments.{name}"
    if key not in sys.modules:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(repo, "experiments", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]
