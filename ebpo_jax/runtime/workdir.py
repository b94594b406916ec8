"""The run's folder: writable with room to spare, one trainer at a time, and a resume that
continues the same run (not a silent restart, not a different config).

`prepare_workdir(spec)` runs every check before anything compiles and returns the held
lock; the lower-level pieces are `check_writable`, `WorkdirLock`, `check_workdir` and
`reconcile_config`. Errors are `WorkdirError`, one line naming the folder.
"""

import errno
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from typing import Any, Self

from ebpo_jax.runtime import storage
from ebpo_jax.runtime.checkpoint import list_steps

LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"  # ebpo_jax.runtime.metrics.METRICS_FILE
CHECKPOINTS = "checkpoints"
DEFAULT_MIN_FREE_BYTES = 1 << 30

# Fields that may change between a run and its resume without changing what it computes.
HARMLESS_FIELDS = (
    "workdir",
    "restart",
    "total_steps",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_every",
    "eval_batch_size",
    "log_every",
    "log_every_s",
    "log_samples_every",
    "max_nonfinite_steps",
    "step_timeout_s",
    "profile_steps",
    "sft.cache_dir",
    "data.reward_workers",
    "wandb.",  # every wandb.* field
    "sampler.mesh",  # layout only: the sampler's weights are resharded from the trainer's
)


class WorkdirError(RuntimeError):
    """The workdir cannot be used as asked; the message is one line naming it."""


def _oserror(what: str, e: OSError) -> WorkdirError:
    return WorkdirError(f"{what}: {e.strerror or e}")


def check_writable(workdir: str, *, min_free_bytes: int = DEFAULT_MIN_FREE_BYTES) -> None:
    """The workdir and its checkpoints folder can be created and written, with free space.

    A probe file is written and removed in each. `min_free_bytes` should cover a
    checkpoint or two (see `checkpoint_bytes`). On `gs://` a probe object is written and
    removed (a bucket has no free-space figure).
    """
    if storage.is_remote(workdir):
        _check_writable_remote(workdir)
        return
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise _oserror(f"cannot create workdir {workdir}", e) from None
    ckpt = os.path.join(workdir, CHECKPOINTS)
    if os.path.exists(ckpt) and not os.path.isdir(ckpt):
        raise WorkdirError(f"{ckpt} is a file, not a folder: move it away or use another workdir")
    for folder in (workdir, ckpt):
        probe = os.path.join(folder, f".write-probe-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as e:
            raise _oserror(f"workdir {folder} is not writable", e) from None
    free = shutil.disk_usage(workdir).free
    if free < min_free_bytes:
        raise WorkdirError(
            f"workdir {workdir} has {free / 2**20:.0f} MiB free, the run needs at least "
            f"{min_free_bytes / 2**20:.0f} MiB (checkpoints)"
        )


def _check_writable_remote(workdir: str) -> None:
    """A probe object can be written to and removed from the `gs://` workdir."""
    probe = storage.join(workdir, f".write-probe-{os.getpid()}")
    try:
        storage.require(workdir)
    except ImportError as e:
        raise WorkdirError(str(e)) from None
    try:
        storage.write_text(probe, "ok")
        storage.remove(probe)
    except Exception as e:  # noqa: BLE001  any client error: no bucket, no permission, ...
        raise WorkdirError(f"workdir {workdir} is not writable: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def check_shared(workdir: str, *, remote: bool) -> None:
    """Every process of a multi-process run sees the same workdir; WorkdirError otherwise.

    Orbax has each host write its shards into the one checkpoint folder, so a local workdir
    that hosts do not share (a pod's boot disks) gives checkpoints nobody can restore.
    Process 0 writes a marker, every process looks for it. A `remote` (gs://) workdir is
    shared by construction. A collective: call it on every process, before anything else
    is written.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1 or remote:
        return
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31))))
    marker = os.path.join(workdir, f".shared-probe-{nonce}")
    failed = None
    if jax.process_index() == 0:
        try:  # a failure still meets the others at the barriers below, then is raised
            os.makedirs(workdir, exist_ok=True)
            storage.write_text(marker, "written by process 0\n")
        except OSError as e:
            failed = _oserror(f"workdir {workdir} is not writable", e)
    multihost_utils.sync_global_devices("ebpo_jax:shared_probe_written")
    seen = multihost_utils.process_allgather(np.int32(os.path.exists(marker)))
    multihost_utils.sync_global_devices("ebpo_jax:shared_probe_read")
    blind = [i for i, s in enumerate(np.asarray(seen).reshape(-1)) if not s]
    if failed is not None or 0 in blind:
        raise failed or WorkdirError(f"workdir {workdir}: process 0 could not write to it")
    if jax.process_index() == 0:
        storage.remove(marker)
    if blind:
        raise WorkdirError(
            f"workdir {workdir} is not shared by the {jax.process_count()} processes (process "
            f"{', '.join(map(str, blind))} cannot see what process 0 writes there): use a "
            "gs:// workdir (--config.workdir=gs://bucket/run) or a filesystem every host mounts"
        )


def checkpoint_bytes(tree: Any) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs (what one checkpoint of it holds)."""
    import jax
    import numpy as np

    leaves = jax.tree.leaves(tree)
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in leaves))


class WorkdirLock:
    """An exclusive `fcntl.flock` on `<workdir>/.lock`, holding the owner's pid.

    The kernel drops the lock when the process dies (kill -9 included), so a stale lock
    file never blocks a later run. `release` removes the file; a process that opened it just
    before then holds a lock on a removed file, so `acquire` checks that the file it locked
    is still the one at the path, and retries otherwise.
    """

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> Self:
        for _ in range(100):
            fd = self._lock_once()
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file that release() removed meanwhile: try the new one
        else:
            raise WorkdirError(f"cannot lock {self.path}: it keeps being replaced")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _lock_once(self) -> int:
        """An fd of the lock file, flock'ed; WorkdirError if another process holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _oserror(f"cannot create the lock file {self.path}", e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise WorkdirError(f"workdir {self.workdir} is in use by pid {owner}") from None
            raise _oserror(f"cannot lock {self.path}", e) from None
        return fd

    def release(self) -> None:
        """Unlock and remove the lock file (removed first, while still held)."""
        if self._fd is not None:
            try:
                if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                    os.unlink(self.path)
            except OSError:
                pass  # already gone, or the folder is read-only now: the unlock still counts
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


class _RemoteLock:
    """`ObjectLock` (gs://) with WorkdirLock's interface and errors."""

    def __init__(self, workdir: str):
        from ebpo_jax.runtime.object_lock import ObjectLock

        self.workdir = workdir
        self.path = storage.join(workdir, LOCK_FILE)
        self._lock = ObjectLock(self.path)

    def acquire(self) -> Self:
        from ebpo_jax.runtime.object_lock import LockHeld

        try:
            self._lock.acquire()
        except LockHeld as e:
            raise WorkdirError(str(e)) from None
        except Exception as e:  # noqa: BLE001  a storage fault: one line naming the lock
            raise WorkdirError(f"cannot take the lock {self.path}: {_one_line(e)}") from None
        return self

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_for(workdir: str):
    """The workdir's lock: `flock` on a local folder, a leased lock object on `gs://`."""
    return _RemoteLock(workdir) if storage.is_remote(workdir) else WorkdirLock(workdir)


def check_workdir(workdir: str, *, restart: bool) -> str:
    """ "fresh", "resume" or "restart"; WorkdirError for metrics without any checkpoint.

    A workdir whose metrics.jsonl has rows but whose checkpoints folder has no step (deleted,
    or never written) would silently start over and rewrite those metrics: refused unless
    `restart` (config field `restart=True`).
    """
    from ebpo_jax.runtime.metrics import has_metrics  # late: metrics imports nothing of ours

    steps = list_steps(storage.join(workdir, CHECKPOINTS))
    if steps:
        return "resume"
    if not has_metrics(workdir):
        return "fresh"
    if not restart:
        raise WorkdirError(
            f"workdir {workdir} has {METRICS_FILE} but no checkpoint in {CHECKPOINTS}/: set "
            "--config.restart=True to start over (its metrics are rewritten), or use a new workdir"
        )
    return "restart"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _harmless(name: str) -> bool:
    return any(name == h or (h.endswith(".") and name.startswith(h)) for h in HARMLESS_FIELDS)


def config_diff(
    old: Mapping[str, Any], new: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[str]:
    """Dotted names whose values differ between two config dicts.

    A field absent on one side counts as None, or as its value in `defaults` when given: a
    field added to the schema after `old` was saved, still at its default, is no change (so
    upgrading the code does not refuse to resume every earlier run).
    """
    # JSON turns tuples into lists: compare what a JSON round trip keeps.
    a, b, d = (json.loads(json.dumps(_flatten(x))) for x in (old, new, defaults or {}))
    return sorted(k for k in set(a) | set(b) if a.get(k, d.get(k)) != b.get(k, d.get(k)))


def _next_history_path(workdir: str) -> str:
    n = 1
    while storage.exists(storage.join(workdir, f"config.{n}.json")):
        n += 1
    return storage.join(workdir, f"config.{n}.json")


def reconcile_config(
    workdir: str,
    config: Mapping[str, Any],
    *,
    resuming: bool,
    log: Callable[[str], None] = print,
    write: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """Compare `config` with the workdir's saved config.json, then save `config` there.

    On a resume, a change of any field outside HARMLESS_FIELDS is refused (WorkdirError
    naming the fields and both values); harmless changes are logged. Whenever the saved
    config differs, it is kept as `config.<n>.json` first. Returns the changed fields.
    `write=False` only checks (nothing is written until every resume check has passed).
    `defaults` (the schema's, as a dict) stand in for fields the saved config predates.
    """
    path = storage.join(workdir, CONFIG_FILE)
    new = json.loads(json.dumps(dict(config)))
    changed: list[str] = []
    existed = storage.exists(path)
    if existed:
        try:
            old = json.loads(storage.read_text(path))
        except (OSError, ValueError) as e:
            raise WorkdirError(f"{path} is unreadable ({e}): fix or remove it") from None
        changed = config_diff(old, new, defaults)
        if resuming:
            flat_old, flat_new = _flatten(old), _flatten(new)
            bad = [k for k in changed if not _harmless(k)]
            if bad:
                shown = ", ".join(
                    f"{k}: {flat_old.get(k, '<absent>')!r} -> {flat_new.get(k, '<absent>')!r}"
                    for k in bad[:5]
                )
                raise WorkdirError(
                    f"workdir {workdir} holds a run with another config ({shown}"
                    f"{', ...' if len(bad) > 5 else ''}): use a new workdir, or "
                    "--config.restart=True after removing its checkpoints"
                )
            if changed:
                log(f"resuming {workdir} with changed fields: {', '.join(changed)}")
        if not write:
            return changed
        if changed:
            storage.move(path, _next_history_path(workdir))
    if write and (changed or not existed):
        storage.write_text(path, json.dumps(new, indent=2))
    return changed


def _saved_config(spec) -> tuple[str, str, dict]:
    """(workdir as configured, restart, config dict) of a RunSpec."""
    return spec.run.workdir, spec.run.restart, json.loads(spec.config_json)


def prepare_workdir(
    spec,
    *,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    log: Callable[[str], None] = print,
    write_config: bool = True,
    defaults: Mapping[str, Any] | None = None,
) -> WorkdirLock:
    """Every check of the run's folder (a RunSpec's), before compiling; returns the held lock.

    Writable with `min_free_bytes` free, locked, not metrics-without-checkpoints (unless
    `restart`), and the saved config compatible on a resume (history kept).
    `write_config=False` leaves config.json to `save_config`, once the caller's own resume
    checks (the checkpoint's) have passed. Release the lock (`lock.release()` or `with`)
    when the run ends.
    """
    workdir, restart, cfg = _saved_config(spec)
    check_writable(workdir, min_free_bytes=min_free_bytes)
    lock = lock_for(workdir).acquire()
    try:
        state = check_workdir(workdir, restart=restart)
        resuming = state == "resume"
        reconcile_config(
            workdir, cfg, resuming=resuming, log=log, write=write_config, defaults=defaults
        )
    except BaseException:
        lock.release()
        raise
    return lock


def save_config(spec, defaults: Mapping[str, Any] | None = None) -> None:
    """Write the run's config.json (old one kept as history) after `prepare_workdir(...,
    write_config=False)` and the caller's resume checks passed."""
    workdir, restart, cfg = _saved_config(spec)
    state = check_workdir(workdir, restart=restart)
    resuming = state == "resume"
    reconcile_config(workdir, cfg, resuming=resuming, log=lambda _: None, defaults=defaults)
