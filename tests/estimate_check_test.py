"""Measured phase times beside the step-time estimate (issue 52): medians, lengths, this
CPU's peak numbers, the report for micro, and experiments/estimate_check.py end to end."""

import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import micro
from ebpo_jax.pods import estimate_check as ec
from ebpo_jax.pods.aot_report import SamplerLayout, step_time_estimate
from ebpo_jax.pods.hardware import ChipSpec
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows():
    """metrics.jsonl rows of a 5-step run: step 1 compiled, step 3 saved."""
    rows = [{"step": 0, "eval/pass@1": 0.0}]
    for step, (roll, upd) in enumerate([(9.0, 7.0), (0.2, 0.1), (0.4, 0.3), (0.3, 0.2)], 1):
        rows.append({
            "step": step, "phase/rollout_s": roll, "phase/update_s": upd,
            "perf/step_time_s": roll + upd, "response_length/mean": 3.0 + step % 2,
            "response_length/truncated_frac": 0.5,
        })  # fmt: skip
    rows[3]["phase/checkpoint_s"] = 1.5
    return rows


def test_measured_phases_are_medians_after_the_compiled_step():
    got = ec.measured_phases(_rows())
    assert got["rollout"] == pytest.approx(0.3) and got["update"] == pytest.approx(0.2)
    assert got["step"] == pytest.approx(0.5) and got["checkpoint"] == 1.5
    lengths = ec.measured_lengths(_rows(), prompt_tokens=5)
    assert lengths.response_mean == pytest.approx(3.5) and lengths.at_limit == 0.5
    assert lengths.prompt_tokens == 5


def test_this_cpus_peak_numbers_are_measured_and_plausible(monkeypatch):
    chip = ec.measure_cpu(n=256, read_mib=16, repeats=2)
    assert chip.generation == "cpu" and chip.hbm_bytes > 1 << 30
    assert 1e8 < chip.peak_flops < 1e13 and 1e8 < chip.hbm_bandwidth < 1e12
    monkeypatch.setattr(ec, "measure_cpu", lambda: chip)
    assert ec.device_chip(jax.devices("cpu")[0]) is chip


class _Device:
    platform, device_kind = "tpu", "TPU v5p"


def test_a_tpu_is_looked_up_by_its_kind():
    assert ec.device_chip(_Device()).generation == "v5p"


def test_the_report_puts_micros_measured_phases_beside_its_estimate():
    c = micro.get_config()
    c.unlock()
    c.mesh.devices = 1
    spec = resolve(c, 1)
    task = build_task(spec.task, log=lambda _: None)
    chip = ChipSpec("cpu", 1 << 34, 5e10, 1e10, 1, 1)
    lengths = ec.measured_lengths(_rows(), prompt_tokens=5)
    est = ec.estimate(spec, task.model_config, chip, 5, lengths)
    one = SamplerLayout(shards=1, tp=1)
    ref = step_time_estimate(spec, task.model_config, chip, prompt_len=5, layout=one,
                             lengths=lengths)  # fmt: skip
    assert est["decode_s_before"] == ref["decode_s_before"] > 0
    text = ec.report(ec.measured_phases(_rows()), est, spec, chip)
    rollout = next(line for line in text.splitlines() if line.startswith("rollout"))
    assert "0.3000" in rollout and f"decode_s_before* {est['decode_s_before']:.3g}" in rollout
    assert "checkpoint" in text and "not modelled" in text
    ratio = float(text.split("measured / estimated step: ")[1].split()[0])
    expected = 0.5 / (est["decode_s_before"] + est["update_s_before"])
    assert math.isclose(ratio, expected, rel_tol=1e-2)
    assert np.isfinite(ec.as_json({"step": 0.5}, est, chip)["estimate_s"]["update_s_before"])


@pytest.mark.slow  # 220 s on a heavily loaded 2-core CPU: trains micro for 4 steps
def test_estimate_check_prints_measured_beside_estimated_for_micro():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, "experiments/estimate_check.py", "--steps=4"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("rollout") and "decode_s_before*" in line for line in lines)
    assert any(line.startswith("update") and "update_s_before*" in line for line in lines)
    assert "measured / estimated step" in run.stdout and "measured now" in run.stdout
