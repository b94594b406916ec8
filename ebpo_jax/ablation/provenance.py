"""Where a run's numbers came from: library versions, the ebpo_jax code it imported, machine
type, CPU model and XLA flags, the warm start's SHA-256 and the SHA-256 of the claims file in
force when it trained."""

import functools
import hashlib
import os
import platform
import subprocess

from ebpo_jax.ablation.registration import git

# Columns added to every results.csv row (constant per run, not compared by --rerun).
PROCESS = ("jax", "jaxlib", "code", "code_sha256", "machine", "cpu", "xla_flags")
PROCESS += ("matmul_precision", "backend")
FIELDS = PROCESS + ("warm_start_sha256", "claims_sha256")  # the run's, from executor.train_run


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


def source_sha256(package_dir: str) -> str:
    """SHA-256 over the package's .py files (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    paths = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, package_dir).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


@functools.cache
def code_version() -> dict[str, str]:
    """The ebpo_jax source this process runs: its git commit ("+dirty" when the package's files
    differ from it) and the SHA-256 of its .py files. Cached at the first call, because the
    checkout may move on while a long-lived grid process keeps the modules it imported."""
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = git(package_dir, "rev-parse", "HEAD")
        dirty = git(package_dir, "status", "--porcelain", "--", ".")
    except (subprocess.CalledProcessError, FileNotFoundError):  # no git, or not a checkout
        commit, dirty = "", ""
    return {"code": commit + ("+dirty" if dirty else ""), "code_sha256": source_sha256(package_dir)}


def provenance() -> dict[str, str]:
    """The PROCESS fields of this process (imports jax; call it where jax is already in use)."""
    import jax
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        **code_version(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "matmul_precision": jax.config.jax_default_matmul_precision or "",
        "backend": f"{jax.default_backend()} x{jax.device_count()}",
    }
