"""Worker processes that run environment calls, each cut at a timeout.

A call that raises, crashes its worker or overruns `timeout_s` gives its row the
environment's `error_observation` (Reply.error=True, counted), never an exception in the
trainer: a stuck tool costs at most one timeout per turn boundary. A timed-out or dead worker
is killed and replaced. Workers start from a `forkserver` (the parent has JAX threads, so
never `fork`) and die with the pool's owner (Linux PR_SET_PDEATHSIG).

Not `rewards.RewardPool`: that pool scores (response, answer) -> float with math-verify
preloaded; this one sends any picklable environment and Episode and gets a Reply back.
`concurrent.futures` cannot kill one stuck worker, hence the small hand-written pool.
"""

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection
import pickle
import signal
import sys
import time
import types
from collections import deque
from collections.abc import Sequence

from ebpo_jax.envs import Environment, Episode, Reply


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _safe_step(env: Environment, episode: Episode) -> tuple[Reply, str | None]:
    """env.step(episode), or the error Reply and the exception text."""
    try:
        reply = env.step(episode)
        if not isinstance(reply, Reply):
            raise TypeError(f"{type(env).__name__}.step returned {type(reply).__name__}, not Reply")
        return reply, None
    except Exception as e:  # noqa: BLE001  a tool's failure is the row's, not the run's
        return error_reply(env), f"{type(e).__name__}: {e}"


def error_reply(env: Environment) -> Reply:
    """What a row gets when its environment call failed: the error observation, episode over."""
    return Reply(observation=getattr(env, "error_observation", ""), done=True, error=True)


@contextlib.contextmanager
def _main_hidden():
    """Start workers without the caller's `__main__`, which forkserver would re-import."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _worker_loop(conn) -> None:
    """Messages: ("env", pickled env) -> "loaded"; (index, episode) -> (index, reply)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    conn.send("ready")
    env = None
    while (msg := conn.recv()) is not None:
        if msg[0] == "env":
            try:  # importing the environment's module is outside any call's timeout
                env = pickle.loads(msg[1])
                conn.send("loaded")
            except Exception as e:  # noqa: BLE001  e.g. a class workers cannot import
                conn.send(("unloadable", f"{type(e).__name__}: {e}"))
            continue
        index, episode = msg
        conn.send((index, tuple(_safe_step(env, episode)[0])))


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_loop, args=(child,), daemon=True)
        with _main_hidden():
            self.process.start()
        child.close()
        self.ready, self.env, self.loading = False, None, False
        self.item, self.deadline = None, 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class EnvPool:
    """`workers` processes answering environment calls (0: in this process, no timeout).

    Each worker loads a map's environment once (within `load_timeout_s`, the time to import
    its module) before its calls, each cut at `timeout_s`.
    """

    def __init__(self, workers: int = 2, *, timeout_s: float = 10.0, load_timeout_s=120.0):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(
                f"EnvPool needs workers >= 0 and timeout_s > 0, got {workers}, {timeout_s}"
            )
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["ebpo_jax.envs.pool"])
        self._workers = [_Worker(self._ctx) for _ in range(workers)]
        self.num_errors = 0  # calls that raised, crashed or timed out, over the pool's life

    def map(self, env: Environment, episodes: Sequence[Episode]) -> list[Reply]:
        """env.step of every episode, in order; failed calls give error replies."""
        if not self._workers:
            out = [_safe_step(env, e)[0] for e in episodes]
            self.num_errors += sum(r.error for r in out)
            return out
        blob = pickle.dumps(env)
        out: list[Reply | None] = [None] * len(episodes)
        todo = deque(range(len(episodes)))
        while todo or any(w.item is not None or w.loading for w in self._workers):
            for w in self._workers:
                self._dispatch(w, blob, episodes, todo)
            busy = [w.deadline for w in self._workers if w.item is not None or w.loading]
            wait = max(0.0, min(busy) - time.monotonic()) + 1e-3 if busy else None
            ready = mp.connection.wait([w.conn for w in self._workers], timeout=wait)
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    self._receive(i, w, blob, env, out)
                elif (w.item is not None or w.loading) and time.monotonic() > w.deadline:
                    self._fail(i, env, out)
        self.num_errors += sum(r.error for r in out)
        return out

    def _dispatch(self, w: _Worker, blob: bytes, episodes, todo) -> None:
        """Give an idle ready worker the environment (if it lacks it), else the next call."""
        if not w.ready or w.loading or w.item is not None or not todo:
            return
        if w.env != blob:
            w.loading, w.deadline = True, time.monotonic() + self.load_timeout_s
            w.conn.send(("env", blob))
            return
        w.item, w.deadline = todo.popleft(), time.monotonic() + self.timeout_s
        w.conn.send((w.item, episodes[w.item]))

    def _receive(self, i: int, w: _Worker, blob: bytes, env, out) -> None:
        try:
            msg = w.conn.recv()
        except EOFError:  # the worker died inside the tool (a crash): replace it
            self._fail(i, env, out)
            return
        if msg in ("ready", "loaded"):
            w.ready = True
            if msg == "loaded":
                w.env, w.loading = blob, False
            return
        if msg[0] == "unloadable":
            raise RuntimeError(
                f"environment workers cannot load {type(env).__name__} ({msg[1]}); define "
                "it in an importable module, not in __main__"
            )
        index, reply = msg
        out[index], w.item = Reply(*reply), None

    def _fail(self, i: int, env, out) -> None:
        w = self._workers[i]
        if w.item is not None:
            out[w.item] = error_reply(env)
        w.kill()
        self._workers[i] = _Worker(self._ctx)

    def close(self) -> None:
        """Stop the workers."""
        for w in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                w.conn.send(None)
        for w in self._workers:
            w.process.join(2)
            if w.process.is_alive():
                w.process.kill()
            w.conn.close()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
