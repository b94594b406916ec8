"""EBPO-diff on the generated tasks: a problem's difficulty is 1 - the warm start's own pass
rate over n samples at temperature 1 (the paper's: 16), kept in a difficulty file that orders
training (`task.order` difficulty / reverse_difficulty) and splits the held-out evaluation
into quartiles (eval/heldout/q1..q4/pass@1, q1 the easiest).

The file is JSON lines, one problem a line: set ("train" | "heldout"), id, prompt, samples,
correct, pass_rate, difficulty and warm_start (the params' SHA-256, tasks.sft.params_digest).
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ebpo_jax.runtime import storage
from ebpo_jax.schema import ConfigError

AUTO = "auto"  # task.difficulty_file: estimate from the warm start (cached by its hash)
TRAIN, HELDOUT = "train", "heldout"
QUARTILES = ("q1", "q2", "q3", "q4")


def records(
    problems: Mapping[str, Sequence],
    correct: Mapping[str, np.ndarray],
    samples: int,
    warm_start: str,
) -> list[dict]:
    """The file's rows: per set, each problem's correct-sample count out of `samples`."""
    out = []
    for name, probs in problems.items():
        for p, c in zip(probs, np.asarray(correct[name]), strict=True):
            rate = float(c) / samples
            out.append(
                {
                    "set": name,
                    "id": p.id,
                    "prompt": p.prompt,
                    "samples": samples,
                    "correct": int(round(float(c))),
                    "pass_rate": rate,
                    "difficulty": 1.0 - rate,
                    "warm_start": warm_start,
                }
            )
    return out


def write(path: str, rows: Sequence[dict]) -> str:
    """Write `rows` as JSON lines (atomically); the path."""
    storage.write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def ensure(path: str, estimate: Callable[[], list[dict]], log=print) -> None:
    """Write `estimate()`'s rows to `path` unless it exists; one process at a time, so the
    runs of one warm start that a grid starts together estimate it once (the others wait,
    then read it)."""
    if storage.exists(path):
        return
    with _one_writer(path, log):
        if not storage.exists(path):  # written while this process waited
            rows = estimate()
            log(
                f"difficulty: the warm start's pass rate over {rows[0]['samples']} samples -> {path}"
            )
            write(path, rows)


@contextlib.contextmanager
def _one_writer(path: str, log):
    """An exclusive flock on a lock file in the temp folder named by `path` (local paths:
    a crashed holder's lock goes with its process); nothing for object storage or a
    multi-process run, whose processes estimate together (the sampler's collectives)."""
    import jax

    if storage.is_remote(path) or jax.process_count() > 1:
        yield
        return
    name = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    lock = os.path.join(tempfile.gettempdir(), f"ebpo-difficulty-{name}.lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"difficulty: another run is estimating {path}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
        if storage.exists(path):  # done: a later lock file can only find the file written
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)


def read(path: str) -> list[dict]:
    """The rows of a difficulty file; ConfigError naming it when missing or unreadable."""
    if not storage.exists(path):
        raise ConfigError(f"task.difficulty_file={path!r}: no such file")
    try:
        return [json.loads(line) for line in storage.read_bytes(path).decode().splitlines() if line]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"task.difficulty_file={path!r}: not JSON lines ({e})") from None


def lookup(rows: Sequence[dict], problems: Sequence, name: str, path: str, warm_start: str):
    """[n] float64 difficulty of `problems` (set `name`) from the file's rows; ConfigError
    naming the file when a problem is missing, its prompt differs or another warm start made it."""
    by_id = {r["id"]: r for r in rows if r.get("set") == name}
    others = {r.get("warm_start") for r in by_id.values()} - {warm_start}
    if others:
        raise ConfigError(
            f"task.difficulty_file={path!r}: estimated from warm start {others.pop()}, this "
            f"run starts from {warm_start} (estimate it again for this warm start)"
        )
    out = np.empty(len(problems), np.float64)
    for i, p in enumerate(problems):
        row = by_id.get(p.id)
        if row is None or row["prompt"] != p.prompt:
            why = "has no row" if row is None else f"has prompt {row['prompt']!r} there"
            raise ConfigError(
                f"task.difficulty_file={path!r}: {name} problem {p.id} ({p.prompt!r}) {why}"
            )
        out[i] = row["difficulty"]
    return out


def quartiles(difficulty: Sequence[float], levels: Sequence[int]) -> tuple[str, ...]:
    """Each problem's quartile q1 (easiest) .. q4 by rank of (difficulty, generator level,
    position): many problems tie at pass rate 0, and the level is the next-best guess."""
    n = len(difficulty)
    rank = np.empty(n, np.int64)
    rank[np.lexsort((np.arange(n), np.asarray(levels), np.asarray(difficulty)))] = np.arange(n)
    return tuple(QUARTILES[int(r * len(QUARTILES) // n)] for r in rank)


def auto_path(spec, warm_start: str) -> str:
    """Where `difficulty_file="auto"` keeps its estimate: beside the warm start (the exported
    ones a grid commits, or the committed `sft.params_file` a rerun starts from), else in the
    SFT cache; named by the warm start and everything else the estimate depends on."""
    key = {
        "task": {k: v for k, v in dataclasses.asdict(spec.task).items() if k != "order"},
        "max_new_tokens": spec.max_new_tokens,
        "eval_batch_size": spec.eval.run.eval_batch_size,  # the chunks fix the draws
    }
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    beside = os.path.dirname(spec.sft.params_file) if spec.sft.params_file else ""
    root = spec.sft.export_dir or beside or spec.sft.cache_dir
    root = root or os.path.join(spec.run.workdir, "sft_cache")
    return os.path.join(root, f"{warm_start}.difficulty-{tag}.jsonl")


def estimate_spec(eval_spec, samples: int, seed: int = 0):
    """The evaluation spec of the estimate: `samples` samples per problem at temperature 1,
    at a fixed seed (every RL seed of a warm start reads the same file)."""
    run = dataclasses.replace(eval_spec.run, eval_samples=samples, eval_temperature=1.0, seed=seed)
    return dataclasses.replace(eval_spec, run=run)
