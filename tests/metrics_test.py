"""Tests for the metrics writer (JSON lines + TensorBoard) and the progress bar."""

import glob
import json
import os
import pathlib
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax.runtime import metrics as M
from ebpo_jax.runtime import progress


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
    with M.MetricsWriter(str(tmp_path), remote=False) as w:
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
    with M.MetricsWriter(str(tmp_path), remote=False, tensorboard=False) as w:
        rec = w.write(0, {"actor/pg_loss": jnp.float32(jnp.nan), "perf/step_time_s": np.inf})
        assert rec == {"step": 0, "actor/pg_loss": None, "perf/step_time_s": None}
        with pytest.raises(ValueError, match="reward/mean"):
            w.write(1, {"reward/mean": jnp.zeros(3)})
    # Strict JSON: no NaN/Infinity tokens in the file.
    json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=pytest.fail)


def test_resume_drops_steps_from_the_resumed_step_on(tmp_path):
    uninterrupted, interrupted = tmp_path / "a", tmp_path / "b"
    with M.MetricsWriter(str(uninterrupted), remote=False) as w:
        for s in range(6):
            w.write(s, _step_metrics(s))
    # The interrupted run got to step 4 but its last checkpoint was at step 3.
    with M.MetricsWriter(str(interrupted), remote=False) as w:
        for s in range(5):
            w.write(s, _step_metrics(s))
    with M.MetricsWriter(str(interrupted), remote=False, start_step=3) as w:
        assert [r["step"] for r in M.read_metrics(str(interrupted))] == [0, 1, 2]
        assert w.kept == M.read_metrics(str(interrupted))  # what a resume reads its pass@1 from
        for s in range(3, 6):
            w.write(s, _step_metrics(s))
    assert (interrupted / "metrics.jsonl").read_text() == (
        uninterrupted / "metrics.jsonl"
    ).read_text()
    # A fresh run (start_step=0) in a used workdir starts the file over.
    with M.MetricsWriter(str(interrupted), remote=False) as w:
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
    with M.MetricsWriter(str(tmp_path), remote=False) as w:
        for s in range(3):
            w.write(s, _step_metrics(s))
    scalars = _read_scalars(tmp_path / "tb")
    assert scalars["reward/mean"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    # The tags are metrics.jsonl's names, as the README gives them (not "eval/pass_1").
    assert [s for s, _ in scalars["eval/pass@1"]] == [0, 2] and "eval/pass_1" not in scalars
    assert "step" not in scalars


def test_progress_bar_shows_reward_pass_rate_and_speed(capsys):
    bar = progress.ProgressBar(total=4, disable=False)
    bar.update(0, {"reward/mean": 0.5, "perf/tokens_per_s": 1234.0, "eval/pass@1": 0.25})
    bar.update(1, {"reward/mean": jnp.float32(0.75), "perf/tokens_per_s": 2000.0})
    assert bar._bar.n == 2
    bar.close()
    err = capsys.readouterr().err
    assert "reward=0.75" in err and "pass@1=0.250" in err and "tok/s=2e+03" in err


# Issue 22: torn files, failing sinks, missing values, samples, W&B.
def test_torn_last_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / M.METRICS_FILE
    path.write_bytes(b'{"step": 0, "r": 1.0}\n{"step": 1, "r": 2.0}\n{"step": 2, "r\xff')
    warnings = []
    assert M.read_metrics(str(tmp_path), log=warnings.append) == [
        {"step": 0, "r": 1.0},
        {"step": 1, "r": 2.0},
    ]
    assert len(warnings) == 1 and str(path) in warnings[0] and "line 3" in warnings[0]
    # A resumed writer keeps the intact lines and appends after them.
    with M.MetricsWriter(
        str(tmp_path), remote=False, start_step=2, tensorboard=False, log=warnings.append
    ) as w:
        w.write(2, {"r": 3.0})
    assert [r["step"] for r in M.read_metrics(str(tmp_path))] == [0, 1, 2]


def test_bad_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / M.METRICS_FILE
    path.write_text('{"step": 0}\n{"step": 1,\n{"step": 2}\n')
    with pytest.raises(M.MetricsError, match=rf"{path}: line 2"):
        M.read_metrics(str(path))


def test_progress_bar_and_writer_tolerate_missing_values(tmp_path, capsys):
    bar = progress.ProgressBar(total=3, disable=False)
    bar.update(0, {"reward/mean": None, "perf/tokens_per_s": float("nan"), "eval/pass@1": None})
    bar.update(1, {"reward/mean": jnp.float32(jnp.nan), "eval/pass@1": float("inf")})
    bar.close()
    assert "reward=nan" in capsys.readouterr().err
    with M.MetricsWriter(str(tmp_path), remote=False) as w:
        assert w.write(0, {"reward/mean": None, "actor/kl": float("nan")})["actor/kl"] is None
    assert M.format_value(None) == "nan" and M.format_value(0.25, ".2f") == "0.25"


def test_failing_tensorboard_degrades_to_jsonl_with_one_warning(tmp_path):
    warnings = []
    with M.MetricsWriter(str(tmp_path), remote=False, log=warnings.append) as w:

        def full(*_):
            raise OSError(28, "No space left on device")

        w._tb._writer.write_event = full  # what a full disk does to the event file
        for s in range(3):
            w.write(s, {"reward/mean": 0.5})
    assert len(warnings) == 1 and "TensorBoard" in warnings[0] and "No space" in warnings[0]
    assert [r["step"] for r in M.read_metrics(str(tmp_path))] == [0, 1, 2]


def test_failing_metrics_write_is_one_line_naming_the_file(tmp_path):
    w = M.MetricsWriter(str(tmp_path), remote=False, tensorboard=False)
    w._file.close()
    w._file = open("/dev/full", "a")  # noqa: SIM115  every flush fails with ENOSPC
    with pytest.raises(M.MetricsError, match=rf"cannot write {tmp_path}/metrics.jsonl: No space"):
        w.write(0, {"reward/mean": 1.0})
    w.close()


def test_unwritable_workdir_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(M.MetricsError, match="cannot write"):
        M.MetricsWriter(str(tmp_path / "file" / "run"), remote=False)


def test_samples_written_and_trimmed_on_resume(tmp_path):
    with M.MetricsWriter(str(tmp_path), remote=False) as w:
        for s in range(3):
            w.write_samples(s, ["1+1="] * 2, ["2", "3"], [1.0, 0.0], [0.5, float("nan")])
    rows = M.read_jsonl(str(tmp_path / M.SAMPLES_FILE))
    assert len(rows) == 6 and rows[1] == {
        "step": 0,
        "prompt": "1+1=",
        "completion": "3",
        "reward": 0.0,
        "advantage": None,
    }
    with M.MetricsWriter(str(tmp_path), remote=False, start_step=1) as w:
        pass
    assert [r["step"] for r in M.read_jsonl(str(tmp_path / M.SAMPLES_FILE))] == [0, 0]
    with pytest.raises(ValueError, match="differ in length"):
        M.NullWriter().write_samples(0, [], [], [])  # no-op on other processes
        w.write_samples(0, ["a"], ["b", "c"], [1.0, 0.0])


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    opts = {"project": "ebpo-test", "mode": "offline", "entity": "", "name": ""}
    with M.MetricsWriter(str(tmp_path), remote=False, wandb=opts, run_config={"lr": 1e-3}) as w:
        w.write(0, {"reward/mean": 0.5})
        w.write_samples(0, ["p"], ["c"], [1.0], [0.0])
    run_id = (tmp_path / M.WANDB_ID_FILE).read_text().strip()
    runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb"))


def test_latest_is_the_last_value_at_or_before_a_step():
    rows = [
        {"step": 0, "eval/pass@1": 0.25},
        {"step": 2, "eval/pass@1": None},  # a skipped evaluation
        {"step": 3, "reward/mean": 1.0},
        {"step": 4, "eval/pass@1": 0.5},
        {"step": 6, "eval/pass@1": 0.75},
    ]
    assert M.latest(rows, "eval/pass@1", 5) == (0.5, 4)
    assert M.latest(rows, "eval/pass@1", 3) == (0.25, 0)
    assert M.latest(rows, "eval/pass@1", 6) == (0.75, 6)
    assert M.latest(rows, "reward/mean", 2) is None
