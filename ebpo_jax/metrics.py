"""Per-step metrics: JSON lines in `<workdir>/metrics.jsonl`, TensorBoard events, a tqdm bar."""

import json
import math
import os
from collections.abc import Mapping
from typing import Any, Self

import numpy as np

# Fixed names (issue 5, section 7) that downstream tools read; writers may add others.
METRIC_NAMES = (
    "step",
    "reward/mean",
    "reward/std",
    "adv/zero_frac",
    "adv/all_same_group_frac",
    "eb/shrinkage_mean",
    "eb/mu_glob",
    "eb/sigma2",
    "eb/tau2",
    "actor/entropy",
    "actor/kl",
    "actor/grad_norm",
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/pg_loss",
    "response_length/mean",
    "response_length/truncated_frac",
    "perf/step_time_s",
    "perf/sample_time_s",
    "perf/update_time_s",
    "perf/tokens_per_s",
    "perf/generated_tokens_total",
    "eval/pass@1",
)
METRICS_FILE = "metrics.jsonl"


def to_python(name: str, value: Any) -> Any:
    """A JSON-able scalar from a Python/numpy/jax scalar; non-finite floats become None."""
    if isinstance(value, str | bool | None):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric {name!r} must be a scalar, got shape {arr.shape}")
    x = arr.reshape(()).item()
    if isinstance(x, bool | int):
        return x
    x = float(x)
    return x if math.isfinite(x) else None


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a workdir or the file itself)."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends one JSON object per step to `<workdir>/metrics.jsonl` and scalars to `<workdir>/tb`.

    Opening with `start_step=s` (the step a resumed run continues from; 0 for a fresh run)
    keeps only the lines of steps < s, so a resumed run's file equals an uninterrupted one.
    Non-finite values are written as null. TensorBoard tags are tensorboardX-sanitised
    ("eval/pass@1" appears as "eval/pass_1").
    """

    def __init__(self, workdir: str, *, start_step: int = 0, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, METRICS_FILE)
        kept = [r for r in read_metrics(self.path) if r.get("step", -1) < start_step]
        # Rewrite via a temp file and rename so a crash here cannot lose the earlier lines.
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")  # noqa: SIM115  (closed in close())
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step makes TensorBoard drop events of steps >= start_step from a prior run.
            self._tb = SummaryWriter(
                os.path.join(workdir, "tb"), purge_step=start_step if start_step > 0 else None
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record the metrics of `step`; returns the JSON object written."""
        record = {"step": int(step)}
        record.update({k: to_python(k, v) for k, v in metrics.items() if k != "step"})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=record["step"])
        return record

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (the JSON file is flushed every write)."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullWriter:
    """MetricsWriter's interface, writing nothing: what processes other than 0 get."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"step": int(step), **metrics}

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_writer(workdir: str, *, start_step: int = 0, enabled: bool = True):
    """A MetricsWriter, or a NullWriter when `enabled` is False (multi-host: not process 0)."""
    return MetricsWriter(workdir, start_step=start_step) if enabled else NullWriter()


class ProgressBar:
    """A tqdm bar over steps showing reward, pass rate (last eval pass@1) and tokens/s."""

    def __init__(self, total: int, *, initial: int = 0, disable: bool | None = None):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, unit="step", disable=disable)
        self._pass_rate = None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Move the bar to `step` + 1 and show the latest metrics."""
        if metrics.get("eval/pass@1") is not None:
            self._pass_rate = to_python("eval/pass@1", metrics["eval/pass@1"])
        postfix = {}
        for label, key in (("reward", "reward/mean"), ("tok/s", "perf/tokens_per_s")):
            if metrics.get(key) is not None:
                postfix[label] = f"{to_python(key, metrics[key]):.3g}"
        if self._pass_rate is not None:
            postfix["pass@1"] = f"{self._pass_rate:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step + 1 - self._bar.n)

    def close(self) -> None:
        self._bar.close()
