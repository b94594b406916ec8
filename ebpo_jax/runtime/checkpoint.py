"""Checkpointing of any pytree plus a small JSON dict with orbax, and a clean-exit signal guard.

Knows nothing of the model or the trainer. Saves are atomic: orbax writes each step into a
`<step>.orbax-checkpoint-tmp-*` directory and renames it only once complete, so a crash
mid-save leaves the previous checkpoint as the latest.

Orbax does not verify what it reads back (one flipped byte in a parameter file restores
silently), so each file of a step gets a SHA-256 in `<step>/ebpo_manifest.json` (on `gs://` the
CRC32C the store computed as each object was written, from one listing), written into
the temporary folder just before orbax's commit renames it (`_ManifestedRename`): every
committed step carries its manifest, also the newest one after a kill -9. It is checked
before restoring. `restore_intact` walks back from the newest step past unreadable or corrupt
ones (naming each), moving them to `<directory>.corrupt/` so a later save of the same step
can happen.

On `gs://` (no rename) orbax writes in place and commits a step by writing
`commit_success.txt` last; `_ManifestedCommitFile` writes the manifest just before it, and
`list_steps` counts only steps with that file.
"""

import asyncio
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Self

import orbax.checkpoint as ocp

from ebpo_jax.runtime import storage

MANIFEST = "ebpo_manifest.json"
# Rewritten by orbax's commit itself (commit time, commit marker): not hashed.
COMMIT_FILE = "commit_success.txt"  # orbax's commit marker on object storage
_UNHASHED = (MANIFEST, "_CHECKPOINT_METADATA", COMMIT_FILE)
_DIGEST_NAMES = {"sha256": "SHA-256", "crc32c": "CRC32C"}


class _NoItemMetadataWarning(logging.Filter):
    """Drops orbax's "Metadata file does not exist: <step>/state/_CHECKPOINT_METADATA".

    A Composite checkpoint (state + extra) writes that file once per step, not per item; on
    every restore orbax still looks for it inside the item and warns, which reads like a
    corrupt checkpoint. Integrity is checked by the manifest instead.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (
            msg.startswith("Metadata file does not exist") and "_CHECKPOINT_METADATA" in msg
        )


def _hide_item_metadata_warning() -> None:
    logger = logging.getLogger("absl")  # orbax logs through absl.logging
    if not any(isinstance(f, _NoItemMetadataWarning) for f in logger.filters):
        logger.addFilter(_NoItemMetadataWarning())


class CheckpointError(RuntimeError):
    """No intact checkpoint could be restored; the message names each step and its fault."""


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:500]


def list_steps(directory: str) -> list[int]:
    """Steps with a committed folder in `directory` (no orbax manager; [] if none), ascending.

    On `gs://` a step is committed once its `commit_success.txt` exists.
    """
    steps = [int(n) for n in storage.listdir(directory) if n.isdigit()]
    if storage.is_remote(directory):
        committed = lambda s: storage.exists(storage.join(directory, str(s), COMMIT_FILE))
        return sorted(s for s in steps if committed(s))
    return sorted(s for s in steps if os.path.isdir(os.path.join(directory, str(s))))


def _digests(step_dir: str, kind: str) -> dict[str, Callable[[], str]]:
    """{file: its `kind` digest, computed when called} for every file under a step folder.

    "sha256" reads the bytes; "crc32c" (gs://) takes the store's own checksums from one
    listing: reading a pod's checkpoint back at every save would download all of it.
    """
    if kind == "crc32c":
        return {rel: (lambda c=c: c) for rel, c in storage.stored_crc32c(step_dir).items()}
    files = storage.walk_files(step_dir)
    return {rel: functools.partial(storage.sha256, storage.join(step_dir, rel)) for rel in files}


def write_manifest(step_dir: str) -> None:
    """Record the digest of every file of a committed step (atomically: tmp + rename, or one
    object PUT): SHA-256 on disk, the store's CRC32C on gs://."""
    kind = "crc32c" if storage.is_remote(step_dir) else "sha256"
    digests = {
        rel: f() for rel, f in sorted(_digests(step_dir, kind).items()) if rel not in _UNHASHED
    }
    storage.write_text(storage.join(step_dir, MANIFEST), json.dumps({kind: digests}))


class _ManifestedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic rename, with the step's manifest written just before the rename.

    Orbax calls `finalize` on the primary process once every process's writes are done, so
    the manifest is part of the same atomic commit as the arrays it hashes.
    """

    async def finalize(self):
        final = self.get_final()
        if final.name.isdigit():  # a step folder, not one of its items
            await asyncio.to_thread(write_manifest, os.fspath(self.get()))
        await super().finalize()


class _ManifestedCommitFile(ocp.path.atomicity.CommitFileTemporaryPath):
    """Orbax's commit-file commit (object storage), with the manifest written just before
    the commit marker: a step without the marker is not committed, manifest or not."""

    async def finalize(self):
        final = self.get_final()
        if final.name.isdigit():
            await asyncio.to_thread(write_manifest, os.fspath(final))
        await super().finalize()


def _temporary_path_class(directory: str):
    """How a step is committed: a rename of a temporary folder, or a commit file on gs://."""
    return _ManifestedCommitFile if storage.is_remote(directory) else _ManifestedRename


def verify_manifest(step_dir: str) -> str | None:
    """None if every file matches the manifest, else what is wrong (a missing one too)."""
    path = storage.join(step_dir, MANIFEST)
    if not storage.exists(path):
        return f"no {MANIFEST} (every committed step has one)"
    try:
        # Whichever kind it holds: gs:// steps of earlier versions carry SHA-256s.
        ((kind, digests),) = json.loads(storage.read_text(path)).items()
        digests = dict(digests)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    if kind not in _DIGEST_NAMES:
        return f"unreadable {MANIFEST} (unknown digest {kind!r})"
    current = _digests(step_dir, kind)
    for rel, digest in digests.items():
        if rel not in current:
            return f"file {rel} is missing"
        if current[rel]() != digest:
            return f"file {rel} fails its {_DIGEST_NAMES[kind]} check"
    return None


def _host_target(tree: Any) -> Any:
    """A restore target of host numpy leaves for a saved tree's metadata.

    Orbax restores a numpy leaf as numpy but a ShapeDtypeStruct without sharding with the
    saved one; zero-stride broadcasts make the target cost no memory. A Python number
    comes back as one.
    """
    import jax  # late: this module knows nothing of jax otherwise
    import numpy as np

    def host(m):
        if isinstance(m, ocp.metadata.value.ScalarMetadata):  # a Python number, saved as one
            return np.zeros((), m.dtype).item()
        return np.broadcast_to(np.zeros((), m.dtype), m.shape)

    return jax.tree.map(host, tree)


class Checkpointer:
    """Saves `(pytree, extra)` every `save_every` steps into `directory`, keeping the last `max_to_keep`.

    Every committed step carries its manifest (SHA-256s; on gs:// CRC32Cs); `checksums=True`
    checks it before a restore (multi-host runs on a storage that one process cannot list
    whole should pass it only on process 0).
    """

    def __init__(
        self,
        directory: str,
        *,
        max_to_keep: int | None = 3,
        save_every: int = 1,
        async_save: bool = True,
        checksums: bool = True,
    ):
        if save_every < 1:
            raise ValueError(f"checkpoint save_every must be >= 1, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"checkpoint max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = str(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_every,
            create=True,
            enable_async_checkpointing=async_save,
            temporary_path_class=_temporary_path_class(self.directory),
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        _hide_item_metadata_warning()
        self.checksums = checksums

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write (the interval is met and the step is new)."""
        return step % self.save_every == 0 and step not in self.all_steps()

    def save(
        self, step: int, pytree: Any, extra: Mapping[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Save at `step` if due (or `force`, e.g. on preemption); returns whether it saved.

        `extra` must be JSON-able (data position, numpy rng state, config); arrays in `pytree`
        are copied to host before this returns, so the caller may donate them afterwards.
        """
        if step in self.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(pytree), extra=ocp.args.JsonSave(dict(extra or {}))
        )
        try:
            return self._manager.save(step, args=args, force=force)
        except Exception as e:  # disk full, a file where a folder should be, ...
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {_one_line(e)}"
            ) from e

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """(pytree, extra) of `step` (default: the latest), placed like `target`.

        `target` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or of arrays with the
        structure that was saved; leaves are restored with its dtypes and shardings. Without
        it every leaf comes back as a host numpy array, whatever topology saved it (a pod's
        checkpoint read on one machine: orbax would refuse the saved devices).
        """
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}: {steps}")
        if self.checksums:
            fault = verify_manifest(storage.join(self.directory, str(step)))
            if fault is not None:
                raise CheckpointError(f"checkpoint step {step} in {self.directory}: {fault}")
        if target is None:
            target = _host_target(self._saved_metadata(step))
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored.state, dict(restored.extra or {})

    def restore_intact(
        self, target: Any = None, *, log: Callable[[str], None] = print
    ) -> tuple[int, Any, dict] | None:
        """(step, pytree, extra) of the newest step that restores and verifies; None if none.

        Each newer step that fails (bad JSON, missing or garbled arrays, a stray empty
        folder, a checksum mismatch) is named in one `log` line together with the step
        tried next, and moved to `<directory>.corrupt/<step>-<time>` so that the run can
        save that step again. CheckpointError if steps exist but none is intact.
        """
        self.wait()
        faults = []
        steps = self.all_steps()
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            try:
                pytree, extra = self.restore(step, target)
                return step, pytree, extra
            except Exception as e:  # noqa: BLE001  any fault of this step: fall back to the previous
                fault = _one_line(e)[:300]
                faults.append(f"step {step}: {fault}")
                moved = self._quarantine(step)
                nxt = f"falling back to step {steps[i - 1]}" if i else "no earlier step"
                log(
                    f"checkpoint step {step} in {self.directory} is corrupt ({fault}); "
                    f"moved to {moved}; {nxt}"
                )
        if faults:
            raise CheckpointError(f"no intact checkpoint in {self.directory}: " + "; ".join(faults))
        return None

    def _quarantine(self, step: int) -> str:
        """Move a corrupt step out of the managed folder; returns where it went."""
        dest_dir = self.directory.rstrip("/") + ".corrupt"
        dest = storage.join(dest_dir, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        storage.move(storage.join(self.directory, str(step)), dest)
        self._manager.reload()
        return dest

    def saved_tree(self, step: int | None = None) -> Any:
        """The pytree saved at `step` (default: the latest) as ShapeDtypeStructs; reads no data."""
        import jax  # late: this module knows nothing of jax otherwise

        step = self.latest_step() if step is None else step
        tree = self._saved_metadata(step)
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)

    def _saved_metadata(self, step: int) -> Any:
        """The orbax metadata tree of the pytree saved at `step`; reads no data."""
        # The manager only knows an item's handler once it saved or restored it in this process.
        with ocp.StandardCheckpointer() as reader:
            meta = reader.metadata(os.path.join(self.directory, str(step), "state"))
        return getattr(getattr(meta, "item_metadata", meta), "tree", meta)

    def saved_extra(self, step: int | None = None) -> dict:
        """The `extra` JSON saved at `step` (default: the latest); reads no arrays."""
        step = self.latest_step() if step is None else step
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
            return dict(reader.restore(os.path.join(self.directory, str(step), "extra")) or {})

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def check(self) -> None:
        """CheckpointError (one line) if an asynchronous save has failed; never waits for one
        in progress (orbax keeps a failed save's error until someone waits for it)."""
        if not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until any asynchronous save has been committed (with its manifest).

        CheckpointError (one line) if the save failed, e.g. the disk filled up meanwhile.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # raised by orbax's background save thread
            raise CheckpointError(f"saving to {self.directory} failed: {_one_line(e)}") from e

    def close(self) -> None:
        """Finish pending saves and release resources."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PreemptionGuard:
    """Within the `with` block SIGTERM/SIGINT set `requested` instead of killing the process.

    The loop checks `guard.requested` after each step, saves and exits cleanly. A second
    SIGINT raises KeyboardInterrupt, so Ctrl-C twice still stops a stuck run. Handlers can only
    be installed from the main thread; elsewhere the guard is inert. On multi-host runs the
    flag is per host: combine it across hosts before acting on it.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def load_params(workdir: str):
    """The policy params of the latest checkpoint in a trainer `workdir` (host numpy arrays)."""
    with Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
        state, _ = ckpt.restore()
    return state["params"]
