"""Where a run's numbers came from: library versions, machine type, CPU model and XLA flags,
the warm start's SHA-256 and the SHA-256 of the claims file in force when it trained."""

import os
import platform

# Columns added to every results.csv row (constant per run, not compared by --rerun).
PROCESS = ("jax", "jaxlib", "machine", "cpu", "xla_flags", "matmul_precision", "backend")
FIELDS = PROCESS + ("warm_start_sha256", "claims_sha256")  # the run's, from ablate.train_run


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


def cpu_family(model: str) -> str:
    """The CPU vendor of a model string ("amd", "intel", "arm"), else the string itself:
    float rounding of XLA:CPU kernels is the same within a family, not across."""
    low = str(model).lower()
    for family, marks in (("amd", ("amd", "epyc")), ("intel", ("intel", "xeon"))):
        if any(m in low for m in marks):
            return family
    return "arm" if any(m in low for m in ("neoverse", "arm", "graviton")) else low


def provenance() -> dict[str, str]:
    """The PROCESS fields of this process (imports jax; call it where jax is already in use)."""
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
