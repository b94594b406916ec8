"""platforms.skip_absent_tpu: JAX_PLATFORMS=cpu only when libtpu would probe for nothing."""

import os
import subprocess
import sys

from ebpo_jax.runtime import platforms


def test_skip_absent_tpu_rules(monkeypatch):
    monkeypatch.setattr(platforms, "_installed", lambda m: m == "libtpu")
    env = {}
    assert platforms.skip_absent_tpu(env, tpu_present=False) and env == {"JAX_PLATFORMS": "cpu"}
    env = {}
    assert not platforms.skip_absent_tpu(env, tpu_present=True) and env == {}  # a TPU VM
    env = {"JAX_PLATFORMS": ""}
    assert not platforms.skip_absent_tpu(env, tpu_present=False)  # the user's choice stands
    assert env == {"JAX_PLATFORMS": ""}
    monkeypatch.setattr(platforms, "_installed", lambda m: m in ("libtpu", "jax_cuda12_plugin"))
    env = {}
    assert not platforms.skip_absent_tpu(env, tpu_present=False) and env == {}  # a GPU machine
    monkeypatch.setattr(platforms, "_installed", lambda m: False)
    assert not platforms.skip_absent_tpu({}, tpu_present=False)  # no libtpu: nothing to skip


def test_no_libtpu_error_lines_on_a_cpu_machine():
    if platforms.has_tpu_device():
        return
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from ebpo_jax.runtime.cpu_flags import add_cpu_flags; add_cpu_flags(); import jax; "
                "print(jax.devices()[0].platform)"
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    assert out.stdout.strip() == "cpu"
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "libtpu" not in out.stderr, out.stderr
