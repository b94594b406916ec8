"""Where a run's numbers came from: library versions, machine type, CPU model and XLA flags."""

import os
import platform

# Columns added to every results.csv row (constant per run, not compared by --rerun).
FIELDS = ("jax", "jaxlib", "machine", "cpu", "xla_flags", "matmul_precision", "backend")


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo ("" when the file or the field is missing)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor()


def provenance() -> dict[str, str]:
    """The FIELDS of this process (imports jax; call it where jax is already in use)."""
    import jax
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "matmul_precision": jax.config.jax_default_matmul_precision or "",
        "backend": f"{jax.default_backend()} x{jax.device_count()}",
    }
