"""EBPO inside tunix (google-tunix 0.1.7), in a venv of its own: tests/tunix_run.py there.

Slow: making the venv downloads tunix's dependencies (several minutes the first time). Set
EBPO_JAX_TUNIX_VENV to a venv that already has google-tunix 0.1.7 to skip that.
"""

import json
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest
from install_test import run

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUNIX = "google-tunix==0.1.7"


def _tunix_venv(where: pathlib.Path) -> pathlib.Path:
    """A venv with tunix; jax, flax and optax come from this suite's venv (a .pth), unchanged."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    site = next(where.glob("lib/python*/site-packages"))
    (site / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", TUNIX]
    subprocess.run(pip, check=True, timeout=1800)
    return where


@pytest.mark.slow
def test_ebpo_is_tunix_advantage_estimator_and_a_tiny_grpo_run_uses_it(tmp_path):
    venv = pathlib.Path(os.environ.get("EBPO_JAX_TUNIX_VENV") or _tunix_venv(tmp_path / "venv"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    script = [str(venv / "bin" / "python"), str(ROOT / "tests" / "tunix_run.py")]
    out = run(script, cwd=tmp_path, env=env, timeout=2400)  # minutes on a loaded 2-core CPU
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # 20 registry calls equal eb_advantage exactly; the GRPO run trained 4 steps of 2 rollout
    # micro-batches (one state update per step), evaluated twice without touching the state,
    # and replayed exactly (tunix_run.py asserts each).
    assert result == {
        "stream_batches": 20,
        "grpo": {"train_calls": 8, "eval_calls": 2, "params_moved": True},
    }
