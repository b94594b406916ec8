"""Worker processes that run a picklable task on items, each call cut at a timeout.

A `WorkerPool` sends a task (any picklable callable) to each worker once, then items one at a
time; `task(item)` runs in the worker. A worker that overruns its call's timeout, or dies, is
killed and replaced, and its item gets a cut `Outcome`; a call that raises gets the exception
text. The reward pool (`rewards.RewardPool`) and the environment pool (`envs.pool.EnvPool`) are
thin `PoolOwner`s of one.

Not `concurrent.futures.ProcessPoolExecutor`: a running task there cannot be cancelled, so a
call stuck in C code (sympy on a huge power, a hung tool) would hold its worker for good; here
the worker is killed. Workers start from a `forkserver` (or `spawn`), never `fork`: the parent
has JAX threads. Both would re-import the caller's main script in each worker, so workers start
with `sys.modules["__main__"]` hidden: a script without an `if __name__ == "__main__":` guard
can use a pool. Workers die with the parent (Linux `PR_SET_PDEATHSIG`, plus a thread that
watches the parent's pid) and ignore Ctrl-C (the parent handles it and kills them).
"""

import contextlib
import ctypes
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Outcome(NamedTuple):
    """One item's result: `task(item)`, or why there is none."""

    value: Any = None
    error: str | None = None  # "Type: message" when the call raised, or why it was cut
    cut: bool = False  # the call timed out or its worker died (and was replaced)


class WorkerError(RuntimeError):
    """Worker processes failed in a way that ends the run (the CLI's one `error:` line)."""


class LoadError(WorkerError):
    """Workers could not unpickle the task (e.g. its class lives in `__main__`)."""


def _die_with_parent(parent_pid: int) -> None:
    """Exit when `parent_pid` (the process that owns the pool) is gone.

    PR_SET_PDEATHSIG kills this process when its parent dies, even inside C code; the parent
    of a forkserver worker is the fork server, which exits when the pool's owner does. The
    watchdog thread covers other platforms and a fork server that outlives its owner.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch():
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass  # alive, owned by someone else (pid reused: rare, harmless)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="worker-parent-watch").start()


def _worker_loop(conn, parent_pid: int, preload: Sequence[str]) -> None:
    """Messages: ("load", pickled task) -> "loaded" | ("unloadable", error);
    ("call", index, item) -> (index, value, error); None -> exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    for name in preload:  # warm imports before announcing readiness (no-ops under forkserver)
        importlib.import_module(name)
    conn.send("ready")
    task: Callable[[Any], Any] | None = None
    while (msg := conn.recv()) is not None:
        if msg[0] == "load":
            try:  # importing the task's module is outside any call's timeout
                task = pickle.loads(msg[1])
                conn.send("loaded")
            except Exception as e:  # noqa: BLE001  e.g. a class workers cannot import
                conn.send(("unloadable", f"{type(e).__name__}: {e}"))
            continue
        _, index, item = msg
        try:
            conn.send((index, task(item), None))
        except Exception as e:  # noqa: BLE001  the caller decides what a failed item means
            conn.send((index, None, f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def _main_hidden():
    """Start processes without the caller's `__main__`: forkserver and spawn would re-import it
    in the child (running a guard-less script's top level again)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class _Worker:
    def __init__(self, ctx, preload: Sequence[str]):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_loop, args=(child, os.getpid(), tuple(preload)), daemon=True
        )
        with _main_hidden():
            self.process.start()
        child.close()
        self.ready, self.loading = False, False
        self.task: bytes | None = None  # the pickled task it holds
        self.item: int | None = None
        self.deadline = 0.0

    @property
    def busy(self) -> bool:
        return self.loading or self.item is not None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class WorkerPool:
    """`workers` processes running `task(item)` calls, each cut at a timeout.

    `preload`: modules each worker imports before it is ready (the fork server imports them
    once, so workers and replacements for killed ones fork in milliseconds). `name` labels
    start-up errors.
    """

    def __init__(
        self,
        workers: int,
        *,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
        name: str = "worker",
    ):
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (never fork), got {start_method!r}"
            )
        self.name, self._preload = name, tuple(preload)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload([__name__, *self._preload])
        self._workers = [_Worker(self._ctx, self._preload) for _ in range(workers)]

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has started (keeps start-up out of the calls' timeouts)."""
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            if not w.ready:
                if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{self.name} did not start within {timeout_s}s")
                try:
                    w.ready = w.conn.recv() == "ready"
                except EOFError:
                    w.process.join(5)
                    raise WorkerError(
                        f"{self.name} exited during start-up (exit code {w.process.exitcode})"
                    ) from None

    def map(
        self,
        task: Callable[[Any], Any],
        items: Sequence[Any],
        *,
        timeout_s: float,
        load_timeout_s: float = 120.0,
    ) -> list[Outcome]:
        """`task(item)` for every item, in order; a call over `timeout_s` is cut.

        Each worker loads the task once (within `load_timeout_s`); LoadError if it cannot.
        """
        for i, w in enumerate(self._workers):
            if w.busy:  # left over from an interrupted map: its reply must not land here
                self._replace(i)
        if not any(w.ready for w in self._workers):
            self.wait_ready()  # replacements for killed workers join while the batch runs
        blob = pickle.dumps(task)
        out: list[Outcome | None] = [None] * len(items)
        todo = deque(range(len(items)))
        while todo or any(w.busy for w in self._workers):
            for w in self._workers:
                self._dispatch(w, blob, items, todo, (timeout_s, load_timeout_s))
            deadlines = [w.deadline for w in self._workers if w.busy]
            wait = max(0.0, min(deadlines) - time.monotonic()) + 1e-3 if deadlines else None
            ready = mp.connection.wait([w.conn for w in self._workers], timeout=wait)
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    self._receive(i, w, blob, out)
                elif w.busy and time.monotonic() > w.deadline:
                    self._cut(i, out, f"timed out after {timeout_s}s")
        return out

    def _dispatch(self, w: _Worker, blob: bytes, items, todo, timeouts) -> None:
        """Give an idle ready worker the task (if it lacks it), else the next item."""
        if not w.ready or w.busy or not todo:
            return
        timeout_s, load_timeout_s = timeouts
        if w.task != blob:
            w.loading, w.deadline = True, time.monotonic() + load_timeout_s
            w.conn.send(("load", blob))
            return
        w.item, w.deadline = todo.popleft(), time.monotonic() + timeout_s
        w.conn.send(("call", w.item, items[w.item]))

    def _receive(self, i: int, w: _Worker, blob: bytes, out: list) -> None:
        try:
            msg = w.conn.recv()
        except EOFError:  # the worker died (a crash, out of memory): replace it
            self._cut(i, out, "worker died")
            return
        if msg == "ready":
            w.ready = True
        elif msg == "loaded":
            w.task, w.loading = blob, False
        elif msg[0] == "unloadable":
            w.loading = False
            raise LoadError(msg[1])
        else:
            index, value, error = msg
            out[index], w.item = Outcome(value, error), None

    def _cut(self, i: int, out: list, reason: str) -> None:
        if self._workers[i].item is not None:
            out[self._workers[i].item] = Outcome(error=reason, cut=True)
        self._replace(i)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self._preload)

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for w in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                w.conn.send(None)
        for w in self._workers:
            w.process.join(2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2)
            w.conn.close()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PoolOwner:
    """Base of a pool that runs its calls in a WorkerPool: `close()` stops the workers, and a
    `with` block closes it."""

    def __init__(self, workers: WorkerPool):
        self._workers = workers

    @property
    def pids(self) -> list[int]:
        return self._workers.pids

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        self._workers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
