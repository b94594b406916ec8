"""Per-step metrics: JSON lines in `<workdir>/metrics.jsonl`, TensorBoard events, optional
Weights & Biases and sample completions in `<workdir>/samples.jsonl`.

TensorBoard events are written with tensorboardX's synchronous `EventsWriter` in the
caller's thread, not its `SummaryWriter`: that one hands events to a writer thread through a
bounded queue, and when the thread dies (disk full) the next `put` blocks the training loop
forever. Here a failed TensorBoard or W&B write prints one warning and turns that sink off;
a failed metrics.jsonl write raises MetricsError, one line naming the file.

On object storage (a `gs://` workdir) nothing can be appended to: rows go to one object per
checkpoint interval, `metrics/<first step>.jsonl` (and `samples/...`), written whole at each
checkpoint (before it is saved) and refreshed every `LIVE_EVERY_S` seconds while it is open;
`read_metrics` merges them in step order. A kill -9 loses only rows after the last
checkpoint, which the resume recomputes. The cost: one object per checkpoint interval, the
open one rewritten every 30 s, and a read that lists and fetches every object.
"""

import json
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
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
PER_PROBLEM_FILE = "eval_problems.csv.gz"  # the final evaluation per problem (evaluator)
SAMPLES_FILE = "samples.jsonl"
LIVE_EVERY_S = 30.0  # object storage: how often the open segment is rewritten for readers
WANDB_ID_FILE = "wandb_run_id"


class MetricsError(RuntimeError):
    """A metrics file cannot be read or written; the message names the file (and line)."""


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def format_value(x: Any, spec: str = ".3g") -> str:
    """`x` formatted with `spec`; None and non-finite values as "nan" (a skipped step's metric)."""
    x = to_python("value", x) if x is not None else None
    if x is None:
        return "nan"
    return format(x, spec)


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


def _segments_dir(path: str) -> str:
    """Where the segments of a .jsonl file live on object storage: metrics.jsonl -> metrics/."""
    return path.removesuffix(".jsonl")


def _segment_names(path: str) -> list[str]:
    from ebpo_jax.runtime import storage

    return [n for n in storage.listdir(_segments_dir(path)) if n.endswith(".jsonl")]


def read_jsonl(path: str, *, log: Callable[[str], None] = _warn) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; [] if it does not exist.

    A torn last line (a crash mid-write) is dropped with one warning; any other bad line is
    a MetricsError naming the file and line. On `gs://` the file is its segments, merged.
    """
    from ebpo_jax.runtime import storage

    if storage.is_remote(path):
        folder = _segments_dir(path)
        records = []
        for name in _segment_names(path):
            seg = storage.join(folder, name)
            records += _parse_jsonl(seg, storage.read_bytes(seg), log)
        return records
    return _read_local_jsonl(path, log)


def _read_local_jsonl(path: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """read_jsonl of a local file."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return _parse_jsonl(path, f.read(), log)


def _parse_jsonl(path: str, data: bytes, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The records of a .jsonl file's bytes (see read_jsonl)."""
    lines = data.split(b"\n")
    records = []
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")  # noqa: TRY004  (caught just below)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if i == last:
                step = re.match(rb'\s*\{"step": (\d+)', raw)  # the writer puts "step" first
                whose = f", the row of step {int(step.group(1))}" if step else ""
                log(f"{path}: dropped a torn last line {i + 1}{whose} ({type(e).__name__}: {e})")
                continue
            raise MetricsError(f"{path}: line {i + 1} is not a JSON object ({e})") from None
        records.append(record)
    return records


def read_metrics(path: str, *, log: Callable[[str], None] = _warn) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a workdir or the file itself); see read_jsonl."""
    from ebpo_jax.runtime import storage

    if (not path.endswith(".jsonl")) if storage.is_remote(path) else os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    return read_jsonl(path, log=log)


def has_metrics(workdir: str) -> bool:
    """Whether the workdir holds metrics rows (a file with bytes, or segments on gs://)."""
    from ebpo_jax.runtime import storage

    path = os.path.join(workdir, METRICS_FILE)
    if storage.is_remote(path):
        return bool(_segment_names(path))
    return os.path.exists(path) and os.path.getsize(path) > 0


def latest(rows: Sequence[Mapping[str, Any]], key: str, up_to: int) -> tuple[Any, int] | None:
    """(value, step) of `key` in the last of `rows` at or before step `up_to` where it is
    not None (a skipped step's value); None when no row has it."""
    had = [r for r in rows if r.get("step", up_to + 1) <= up_to and r.get(key) is not None]
    return (had[-1][key], had[-1]["step"]) if had else None


GAP_KEY = "metrics_gap"  # a row {"step": s, "metrics_gap": [[a, b], ...]}: rows a..b were lost


def _ranges(steps: Sequence[int]) -> list[list[int]]:
    """Sorted ints as [first, last] runs: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    out: list[list[int]] = []
    for s in sorted(steps):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def missing_steps(records: Sequence[Mapping[str, Any]], upto: int) -> list[int]:
    """Steps 1..upto with neither a row nor a recorded gap among `records`."""
    seen = {r.get("step") for r in records}
    for r in records:
        for a, b in r.get(GAP_KEY) or ():
            seen.update(range(a, b + 1))
    return [s for s in range(1, upto + 1) if s not in seen]


def _rewrite_jsonl(path: str, records: list[dict]) -> None:
    """Replace a .jsonl file by `records` via a temp file and rename (a crash keeps the old)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


class _Segments:
    """A .jsonl "file" on object storage: one object per flush interval (see the module doc).

    Opening keeps the rows of steps < `start_step`: segments of later steps are deleted and
    one that straddles it is rewritten (each a whole-object write, so a kill -9 in between
    leaves rows a later open drops again).
    """

    def __init__(self, path: str, start_step: int, log: Callable[[str], None]):
        from ebpo_jax.runtime import storage

        self.name, self._folder, self._storage = path, _segments_dir(path), storage
        self.kept: list[dict] = []
        for seg in _segment_names(path):
            seg_path = storage.join(self._folder, seg)
            rows = _parse_jsonl(seg_path, storage.read_bytes(seg_path), log)
            keep = [r for r in rows if r.get("step", -1) < start_step]
            if not keep:
                storage.remove(seg_path)
            elif len(keep) < len(rows):
                storage.write_text(seg_path, "".join(json.dumps(r) + "\n" for r in keep))
            self.kept += keep
        self._rows: list[dict] = []
        self._seg = ""
        self._written_at = time.monotonic()

    def append(self, record: Mapping[str, Any]) -> None:
        if not self._rows:  # named once, by its first step then its start time: never reused
            first, now_ms = record.get("step", 0), time.time_ns() // 1_000_000
            self._seg = self._storage.join(self._folder, f"{first:012d}-{now_ms:013d}.jsonl")
        self._rows.append(dict(record))
        if time.monotonic() - self._written_at > LIVE_EVERY_S:
            self._put()

    def _put(self) -> None:
        if self._rows:
            self._storage.write_text(self._seg, "".join(json.dumps(r) + "\n" for r in self._rows))
        self._written_at = time.monotonic()

    def flush(self) -> None:
        """Write the open segment and start the next one."""
        self._put()
        self._rows = []

    def close(self) -> None:
        self.flush()


class _TensorBoard:
    """Scalars and text as TensorBoard events, written synchronously (see the module doc).

    On `gs://` tensorboardX uploads the whole events file at each flush, so flushes happen
    every LIVE_EVERY_S and at `roll()` (each checkpoint), which starts a new file: an upload
    never exceeds one checkpoint interval of events.
    """

    def __init__(self, logdir: str, purge_step: int | None, remote: bool):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._remote, self._logdir, self._files = remote, logdir, 0
        if not self._remote:
            os.makedirs(logdir, exist_ok=True)
        self._Event, self._EventsWriter = Event, EventsWriter
        self._writer = self._new_writer()
        self._flushed_at = time.monotonic()
        if purge_step:  # TensorBoard hides events of steps >= purge_step from a prior run
            self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._writer.write_event(
                Event(step=purge_step, session_log=SessionLog(status=SessionLog.START))
            )
        self._writer.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        # The Summary proto directly: tensorboardX's summary.scalar() would rename
        # "eval/pass@1" to "eval/pass_1", and TensorBoard shows the names metrics.jsonl has.
        for tag, value in values.items():
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
            self._writer.write_event(self._Event(wall_time=time.time(), step=step, summary=summary))
        self._flush()

    def text(self, step: int, tag: str, text: str) -> None:
        from tensorboardX import summary

        self._writer.write_event(
            self._Event(wall_time=time.time(), step=step, summary=summary.text(tag, text))
        )
        self._flush()

    def _new_writer(self):
        self._files += 1  # two files opened within one second must not share a name
        return self._EventsWriter(
            os.path.join(self._logdir, "events"), filename_suffix=f".{os.getpid()}.{self._files}"
        )

    def _flush(self) -> None:
        if not self._remote or time.monotonic() - self._flushed_at > LIVE_EVERY_S:
            self._writer.flush()
            self._flushed_at = time.monotonic()

    def roll(self) -> None:
        """Make the events durable; on gs://, continue in a new file."""
        if self._remote:
            self._writer.close()
            self._writer = self._new_writer()

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """A Weights & Biases run (imported only when asked for); resumes the workdir's run id."""

    def __init__(
        self, workdir: str, options: Mapping[str, Any], run_config: Mapping | None, remote: bool
    ):
        import wandb  # optional dependency: pip install 'ebpo-jax[wandb]'

        from ebpo_jax.runtime import storage

        id_path = os.path.join(workdir, WANDB_ID_FILE)
        if storage.exists(id_path):
            run_id = storage.read_text(id_path).strip()
        else:
            run_id = secrets.token_hex(4)  # wandb run ids: [a-z0-9]
            storage.write_text(id_path, run_id + "\n")
        # WANDB_MODE in the environment wins, as wandb's own tools expect.
        mode = os.environ.get("WANDB_MODE") or options.get("mode") or "online"
        self._wandb = wandb
        self._run = wandb.init(
            project=options["project"],
            entity=options.get("entity") or None,
            name=options.get("name") or os.path.basename(os.path.abspath(workdir)),
            mode=mode,
            dir=None if remote else workdir,  # wandb's files are local
            id=run_id,
            resume="allow",
            config=dict(run_config or {}),
        )

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        self._run.log(dict(values), step=step)

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns = ["prompt", "completion", "reward", "advantage"]
        table = self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """Appends one JSON object per step to `<workdir>/metrics.jsonl` and scalars to `<workdir>/tb`.

    Opening with `start_step=s` (the step a resumed run continues from; 0 for a fresh run)
    keeps only the lines of steps < s (of metrics.jsonl and samples.jsonl), so a resumed
    run's files equal an uninterrupted one's. Non-finite values are written as null.
    TensorBoard tags are the metric names as they are ("eval/pass@1").
    `wandb={"project": ..., "mode": ..., "entity": ..., "name": ...}` (project "" = off) also
    logs to Weights & Biases, with `run_config` as the run's config. `remote`: the workdir is
    on object storage (`storage.is_remote`; the run asks once): rows go to segments.
    """

    def __init__(
        self,
        workdir: str,
        *,
        remote: bool,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb: Mapping[str, Any] | None = None,
        run_config: Mapping[str, Any] | None = None,
        log: Callable[[str], None] = _warn,
    ):
        self._log = log
        self.path = os.path.join(workdir, METRICS_FILE)
        self.samples_path = os.path.join(workdir, SAMPLES_FILE)
        self._samples = None
        if remote:  # every sink below writes where this says
            self._open_segments(start_step, log)
        else:
            self._open_local(workdir, start_step, log)
        self._tb = self._wandb = None
        if tensorboard:
            self._tb = self._guard(
                "TensorBoard",
                _TensorBoard,
                os.path.join(workdir, "tb"),
                start_step if start_step > 0 else None,
                remote,
            )
        if wandb and wandb.get("project") and wandb.get("mode") != "disabled":
            self._wandb = _WandB(workdir, wandb, run_config, remote)

    def _open_segments(self, start_step: int, log: Callable[[str], None]) -> None:
        """Object storage: the kept rows, and segment writers (see `_Segments`)."""
        try:
            self._file = _Segments(self.path, start_step, log)
            self._samples = _Segments(self.samples_path, start_step, log)
        except Exception as e:  # noqa: BLE001  any storage client error, named once
            raise MetricsError(f"cannot write {self.path}: {_one_line(e)}") from None
        self._kept = self._file.kept

    def _open_local(self, workdir: str, start_step: int, log: Callable[[str], None]) -> None:
        """A local folder: keep the rows of steps < start_step, then append."""
        try:
            os.makedirs(workdir, exist_ok=True)
            for path in (self.path, self.samples_path):
                kept = [r for r in _read_local_jsonl(path, log) if r.get("step", -1) < start_step]
                if kept or os.path.exists(path):
                    _rewrite_jsonl(path, kept)
                if path == self.path:
                    self._kept = kept
            self._file = open(self.path, "a")  # noqa: SIM115  (closed in close())
        except OSError as e:
            raise MetricsError(f"cannot write {self.path}: {e.strerror or e}") from None

    def _guard(self, sink: str, fn, *args):
        """fn(*args); on failure one warning and None (the caller turns that sink off)."""
        try:
            out = fn(*args)
            return True if out is None else out
        except Exception as e:  # noqa: BLE001  a side sink must never stop training
            self._log(f"{sink} logging failed ({type(e).__name__}: {e}); continuing without it")
            return None

    def _append(self, file, path: str, record: Mapping[str, Any]) -> None:
        try:
            if isinstance(file, _Segments):
                file.append(record)
                return
            file.write(json.dumps(record) + "\n")
            file.flush()
        except OSError as e:
            raise MetricsError(f"cannot write {path}: {e.strerror or e}") from None
        except Exception as e:  # noqa: BLE001  a storage client error (gs://)
            raise MetricsError(f"cannot write {path}: {_one_line(e)}") from None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record the metrics of `step`; returns the JSON object written."""
        record = {"step": int(step)}
        record.update({k: to_python(k, v) for k, v in metrics.items() if k != "step"})
        self._append(self._file, self.path, record)
        scalars = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if (
            self._tb is not None
            and self._guard("TensorBoard", self._tb.scalars, step, scalars) is None
        ):
            self._tb = None
        if self._wandb is not None and self._guard("W&B", self._wandb.log, step, scalars) is None:
            self._wandb = None
        return record

    def write_samples(
        self,
        step: int,
        prompts: Sequence[str],
        completions: Sequence[str],
        rewards: Sequence[float],
        advantages: Sequence[float] | None = None,
    ) -> list[dict[str, Any]]:
        """Append one `samples.jsonl` row per completion (also TensorBoard text, W&B table)."""
        n = len(completions)
        if not (len(prompts) == len(rewards) == n) or (
            advantages is not None and len(advantages) != n
        ):
            raise ValueError(
                "write_samples: prompts, completions, rewards, advantages differ in length"
            )
        rows = [
            {
                "step": int(step),
                "prompt": str(prompts[i]),
                "completion": str(completions[i]),
                "reward": to_python("reward", rewards[i]),
                "advantage": None if advantages is None else to_python("advantage", advantages[i]),
            }
            for i in range(n)
        ]
        if self._samples is None:
            try:
                self._samples = open(self.samples_path, "a")  # noqa: SIM115  (closed in close())
            except OSError as e:
                raise MetricsError(f"cannot write {self.samples_path}: {e.strerror or e}") from None
        for row in rows:
            self._append(self._samples, self.samples_path, row)
        text = "\n\n".join(
            f"**reward {format_value(r['reward'])}, advantage {format_value(r['advantage'])}**"
            f"\n\n    {r['prompt']}\n    -> {r['completion']}"
            for r in rows
        )
        if (
            self._tb is not None
            and self._guard("TensorBoard", self._tb.text, step, "samples", text) is None
        ):
            self._tb = None
        if self._wandb is not None and self._guard("W&B", self._wandb.samples, step, rows) is None:
            self._wandb = None
        return rows

    @property
    def kept(self) -> list[dict[str, Any]]:
        """The rows of steps before `start_step` that the file held when opened (and gaps)."""
        return self._kept

    def record_gap(self, upto: int) -> list[list[int]]:
        """Steps 1..upto (covered by the restored checkpoint) that have no row: one warning
        and a gap row in the file, so the loss is said once and stays on record."""
        gaps = _ranges(missing_steps(self._kept, upto))
        if gaps:
            shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps)
            self._log(
                f"{self.path} has no rows for steps {shown}, which the checkpoint covers "
                f"(steps 1-{upto}): lost before this resume; recorded as a {GAP_KEY} row"
            )
            self._append(self._file, self.path, {"step": upto, GAP_KEY: gaps})
            self._kept.append({"step": upto, GAP_KEY: gaps})
        return gaps

    def flush(self) -> None:
        """Make every row written so far durable (fsync); the loop calls it at each checkpoint."""
        for f in (self._file, self._samples):
            if f is not None:
                try:
                    f.flush()
                    if not isinstance(f, _Segments):
                        os.fsync(f.fileno())
                except OSError as e:
                    raise MetricsError(f"cannot write {f.name}: {e.strerror or e}") from None
                except Exception as e:  # noqa: BLE001  a storage client error (gs://)
                    raise MetricsError(f"cannot write {f.name}: {_one_line(e)}") from None
        if self._tb not in (None, True) and self._guard("TensorBoard", self._tb.roll) is None:
            self._tb = None

    def close(self) -> None:
        for f in (self._file, self._samples):
            if f is not None:
                try:
                    f.close()
                except OSError as e:
                    self._log(f"closing {f.name} failed: {e.strerror or e}")
                except Exception as e:  # noqa: BLE001  a storage client error (gs://)
                    self._log(f"closing {f.name} failed: {_one_line(e)}")
        for sink, obj in (("TensorBoard", self._tb), ("W&B", self._wandb)):
            if obj is not None and obj is not True:
                self._guard(sink, obj.close)
        self._tb = self._wandb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullWriter:
    """MetricsWriter's interface, writing nothing: what processes other than 0 get."""

    kept = ()  # no rows: only process 0 reads the file

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"step": int(step), **metrics}

    def write_samples(self, step: int, prompts, completions, rewards, advantages=None) -> list:
        return []

    def record_gap(self, upto: int) -> list:
        return []

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_writer(
    workdir: str,
    *,
    remote: bool,
    start_step: int = 0,
    enabled: bool = True,
    wandb: Mapping[str, Any] | None = None,
    run_config: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = _warn,
):
    """A MetricsWriter, or a NullWriter when `enabled` is False (multi-host: not process 0)."""
    if not enabled:
        return NullWriter()
    return MetricsWriter(
        workdir, remote=remote, start_step=start_step, wandb=wandb, run_config=run_config, log=log
    )
