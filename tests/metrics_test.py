"""Tests for the metrics writer (JSON lines + TensorBoard) and the progress bar."""

import glob
import json
import os
import pathlib
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import metrics as M


def _step_metrics(step: int) -> dict:
    return {
        "reward/mean": jnp.float32(0.25 * step),
        "reward/std": np.float64(0.5),
        "perf/generated_tokens_total": jnp.int32(100 * step),
        "actor/kl": jnp.array([1e-3 * step], jnp.bfloat16),
        "eval/pass@1": 0.125 if step % 2 == 0 else None,
    }


def test_metric_names_are_the_issue_list():
    assert len(M.METRIC_NAMES) == len(set(M.METRIC_NAMES)) == 23
    assert M.METRIC_NAMES[0] == "step" and "eval/pass@1" in M.METRIC_NAMES
    for name in ("adv/zero_frac", "eb/tau2", "actor/grad_norm", "perf/tokens_per_s"):
        assert name in M.METRIC_NAMES


def test_writes_one_json_object_per_step_with_python_scalars(tmp_path):
    with M.MetricsWriter(str(tmp_path)) as w:
        for s in range(3):
            w.write(s, _step_metrics(s))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["reward/mean"] == 0.5 and isinstance(records[2]["reward/mean"], float)
    assert records[2]["perf/generated_tokens_total"] == 200
    assert isinstance(records[2]["perf/generated_tokens_total"], int)
    assert records[1]["eval/pass@1"] is None and records[2]["eval/pass@1"] == 0.125
    assert records[2]["actor/kl"] == pytest.approx(2e-3, rel=1e-2)
    assert M.read_metrics(str(tmp_path)) == records


def test_non_finite_and_non_scalar_values(tmp_path):
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        rec = w.write(0, {"actor/pg_loss": jnp.float32(jnp.nan), "perf/step_time_s": np.inf})
        assert rec == {"step": 0, "actor/pg_loss": None, "perf/step_time_s": None}
        with pytest.raises(ValueError, match="reward/mean"):
            w.write(1, {"reward/mean": jnp.zeros(3)})
    # Strict JSON: no NaN/Infinity tokens in the file.
    json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=pytest.fail)


def test_resume_drops_steps_from_the_resumed_step_on(tmp_path):
    uninterrupted, interrupted = tmp_path / "a", tmp_path / "b"
    with M.MetricsWriter(str(uninterrupted)) as w:
        for s in range(6):
            w.write(s, _step_metrics(s))
    # The interrupted run got to step 4 but its last checkpoint was at step 3.
    with M.MetricsWriter(str(interrupted)) as w:
        for s in range(5):
            w.write(s, _step_metrics(s))
    with M.MetricsWriter(str(interrupted), start_step=3) as w:
        assert [r["step"] for r in M.read_metrics(str(interrupted))] == [0, 1, 2]
        for s in range(3, 6):
            w.write(s, _step_metrics(s))
    assert (interrupted / "metrics.jsonl").read_text() == (
        uninterrupted / "metrics.jsonl"
    ).read_text()
    # A fresh run (start_step=0) in a used workdir starts the file over.
    with M.MetricsWriter(str(interrupted)) as w:
        w.write(0, {"reward/mean": 1.0})
    assert M.read_metrics(str(interrupted)) == [{"step": 0, "reward/mean": 1.0}]


def _read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Scalars of TFRecord event files, parsed with tensorboardX's own protos."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = pathlib.Path(path).read_bytes()
        pos = 0
        while pos < len(data):  # record: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 16 + n
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_events_written(tmp_path):
    with M.MetricsWriter(str(tmp_path)) as w:
        for s in range(3):
            w.write(s, _step_metrics(s))
    scalars = _read_scalars(tmp_path / "tb")
    assert scalars["reward/mean"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    # tensorboardX sanitises tag characters: "eval/pass@1" is shown as "eval/pass_1".
    assert [s for s, _ in scalars["eval/pass_1"]] == [0, 2]
    assert "step" not in scalars


def test_progress_bar_shows_reward_pass_rate_and_speed(capsys):
    bar = M.ProgressBar(total=4, disable=False)
    bar.update(0, {"reward/mean": 0.5, "perf/tokens_per_s": 1234.0, "eval/pass@1": 0.25})
    bar.update(1, {"reward/mean": jnp.float32(0.75), "perf/tokens_per_s": 2000.0})
    assert bar._bar.n == 2
    bar.close()
    err = capsys.readouterr().err
    assert "reward=0.75" in err and "pass@1=0.250" in err and "tok/s=2e+03" in err
