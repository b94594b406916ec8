"""The workdir lock on object storage (`gs://`), where `flock` means nothing across hosts.

The lock is one object, `<workdir>/.lock`, created only if absent (`if_generation_match=0`:
the store refuses a second create with 412) and holding its owner (host, pid, boot id). A
thread rewrites it every `heartbeat_s` under the generation it last wrote, so a lost race
is seen at once. Another trainer is refused while the object's last write (the store's own
clock) is younger than `lease_s`; an older one is a crashed owner's and is taken over by a
generation-matched rewrite. So is one whose owner is a dead process on this very machine
(same boot id): a kill -9 then a restart on the same host need not wait for the lease.

The lease, 120 s, is six heartbeats: a host stalled by a long checkpoint write or a few
failed heartbeats (storage 503s, each retried by the client) keeps its lock, and a
preempted pod, which takes minutes to come back, never waits on it.
google-cloud-storage is used here (not epath) because preconditions are its API.
"""

import datetime
import json
import os
import socket
import threading
import time
from typing import Self

LEASE_S = 120.0
HEARTBEAT_S = 20.0


class LockHeld(RuntimeError):
    """Another live trainer holds the lock; the message is one line naming it."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _split(gs_path: str) -> tuple[str, str]:
    bucket, _, name = gs_path.removeprefix("gs://").partition("/")
    return bucket, name


class ObjectLock:
    """An exclusive lease on `gs_path` (an object), renewed by a heartbeat thread."""

    def __init__(self, gs_path: str, *, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S):
        from google.cloud import storage  # late: only gs:// runs need the client

        self.path = gs_path
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        bucket, name = _split(gs_path)
        self._blob = storage.Client().bucket(bucket).blob(name)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": _boot_id()}
        self._generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False  # set when a heartbeat found the lock taken by another

    def _write(self, if_generation_match: int) -> int:
        """Write the owner record under a precondition; the new generation."""
        body = json.dumps({**self.owner, "heartbeat": time.time()})
        self._blob.upload_from_string(
            body, content_type="application/json", if_generation_match=if_generation_match
        )
        return int(self._blob.generation)

    def _stale(self, record: dict, updated: datetime.datetime) -> bool:
        """A crashed owner's: no heartbeat within the lease, or a dead pid on this machine."""
        age = datetime.datetime.now(datetime.UTC) - updated
        if age.total_seconds() > self.lease_s:
            return True
        same_machine = record.get("boot_id") == self.owner["boot_id"] != ""
        return same_machine and not _pid_alive(int(record.get("pid", 0)))

    def acquire(self) -> Self:
        """Take the lock (or a stale one over); LockHeld naming the owner otherwise."""
        from google.api_core.exceptions import NotFound, PreconditionFailed

        for _ in range(5):
            try:
                self._generation = self._write(if_generation_match=0)
                break
            except PreconditionFailed:
                pass
            try:
                self._blob.reload()
                gen = self._blob.generation
                record = json.loads(self._blob.download_as_bytes(if_generation_match=gen))
            except (NotFound, PreconditionFailed, ValueError):
                continue  # released or rewritten meanwhile: try again
            if not self._stale(record, self._blob.updated):
                who = f"pid {record.get('pid')} on {record.get('host')}"
                raise LockHeld(
                    f"workdir lock {self.path} is held by {who} (heartbeat within the last "
                    f"{self.lease_s:.0f} s): another trainer uses this workdir"
                )
            try:
                self._generation = self._write(if_generation_match=self._blob.generation)
                break
            except PreconditionFailed:
                continue  # another trainer took it over first: look again
        else:
            raise LockHeld(f"workdir lock {self.path}: kept changing hands, could not take it")
        self._thread = threading.Thread(target=self._beat, name="ebpo-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        from google.api_core.exceptions import GoogleAPIError, PreconditionFailed

        while not self._stop.wait(self.heartbeat_s):
            try:
                self._generation = self._write(if_generation_match=self._generation)
            except PreconditionFailed:
                self.lost = True  # taken over: this trainer stalled past its lease
                return
            except GoogleAPIError:
                pass  # retried by the client already; the lease allows a few misses

    def release(self) -> None:
        """Stop the heartbeat and delete the lock, if it is still ours."""
        from google.api_core.exceptions import GoogleAPIError

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._generation is not None and not self.lost:
            try:
                self._blob.delete(if_generation_match=self._generation)
            except GoogleAPIError:
                pass  # gone or taken over: nothing of ours left to remove
        self._generation = None

    def __enter__(self) -> Self:
        return self.acquire() if self._generation is None else self

    def __exit__(self, *exc) -> None:
        self.release()
