"""XLA:CPU compiler flags the package sets by default, before the first backend starts."""

import importlib.metadata
import os
import sys

# YNNPACK dot fusions absorb the operand transposes that XLA otherwise materialises before
# every weight-gradient dot of the backward pass: 1.1-1.25x on the CPU update step of
# benchmarks/train_bench.py. Only set for the jaxlib line it was measured on, because an
# XLA_FLAGS entry that a later jaxlib does not know aborts the process at start-up.
_FLAGS = {"0.10.": ("--xla_cpu_experimental_ynn_fusion_type=dot",)}
OPT_OUT = "EBPO_JAX_CPU_FLAGS"  # set to 0 to leave XLA_FLAGS alone


def cpu_flags(jaxlib_version: str) -> tuple[str, ...]:
    """The default flags for this jaxlib version (none for versions not measured)."""
    return next((f for prefix, f in _FLAGS.items() if jaxlib_version.startswith(prefix)), ())


def add_cpu_flags(environ=os.environ) -> None:
    """Appends the default flags to XLA_FLAGS, keeping any the user set for the same option.

    Also skips libtpu's futile TPU probe on a machine without a TPU (platforms.py). XLA reads
    XLA_FLAGS once, when the first backend starts: after that this changes nothing.
    """
    from ebpo_jax.runtime.platforms import skip_absent_tpu

    if skip_absent_tpu(environ) and environ is os.environ and "jax" in sys.modules:
        # jax read JAX_PLATFORMS when it was imported (importing ebpo_jax imports it): set the
        # option itself too, which counts as long as no backend has started.
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    if environ.get(OPT_OUT, "1") == "0":
        return
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return
    flags = environ.get("XLA_FLAGS", "")
    for flag in cpu_flags(version):
        if flag.split("=")[0] + "=" not in flags:
            flags = f"{flags} {flag}".strip()
    if flags:
        environ["XLA_FLAGS"] = flags
