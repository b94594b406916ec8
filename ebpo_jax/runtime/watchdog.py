"""No silent hangs: a deadline on each phase of a step, and the wall time of each phase.

`PhaseTimer` times the phases of a step (rollout, reward, update, ...) and tells a listener
which one runs. `Watchdog` is that listener: a daemon thread that, once a phase has run past
its deadline, writes every thread's Python stack (faulthandler) to `<workdir>/hang-p<i>.txt`
and stderr, prints one `error:` line naming the phase and the step, and ends the process
with status 1 through `os._exit`: a thread blocked in C (a collective whose peer is stopped
or dead, a wait on a save that never commits) cannot be interrupted any other way, and a
normal exit would block again in jax.distributed's shutdown barrier.

The deadline: `FIRST_DEADLINE_S` (1 h) while the first `WARMUP_STEPS` (3) calls of the
runner run (they compile), then `run.step_timeout_s` seconds per phase, or with 0 (auto)
max(`MIN_DEADLINE_S` (600 s), 2 x the first call's wall time, 10 x the slowest of the
other warm-up calls, 10 x the slowest earlier run of the same phase); a phase's first run
after the warm-up (the first evaluation, which compiles its sampler and may score far more
answers than a step) has `FIRST_DEADLINE_S` too. On a multi-host run every process runs its own watchdog, so a
stopped or dead peer ends every surviving process within one deadline of the last progress.
"""

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

FIRST_DEADLINE_S = 3600.0  # the warm-up steps compile the rollout and the update
MIN_DEADLINE_S = 600.0  # a checkpoint or an evaluation may be much slower than a step
WARMUP_STEPS = 3
EXIT_STATUS = 1


class PhaseTimer:
    """Wall seconds per phase since the last `take()`; `on_enter(phase)` hears each phase."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.on_enter: Callable[[str], None] | None = None

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.on_enter is not None:
            self.on_enter(phase)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """The phase times as metrics (`phase/<name>_s`), and a fresh start."""
        out = {f"phase/{name.replace(' ', '_')}_s": t for name, t in self.times.items()}
        self.times = {}
        return out


def auto_deadline(step_times: list[float]) -> float:
    """The automatic per-phase deadline after the wall times of the steps run so far."""
    if len(step_times) < WARMUP_STEPS:
        return FIRST_DEADLINE_S
    first, rest = step_times[0], step_times[1:WARMUP_STEPS]
    return max(MIN_DEADLINE_S, 2.0 * first, 10.0 * max(rest))


class Watchdog:
    """Ends the process with one `error:` line when a phase outlives its deadline."""

    def __init__(
        self,
        timeout_s: float,
        workdir: str,
        process: int = 0,
        *,
        exit_fn: Callable[[int], None] = os._exit,
        poll_s: float = 1.0,
    ):
        self.fixed = float(timeout_s) if timeout_s else None
        self.dump_path = os.path.join(workdir, f"hang-p{process}.txt")
        self.step_times: list[float] = []
        self.phase_times: dict[str, list[float]] = {}  # each phase's finished runs (auto)
        self.step: int | None = None
        self._exit, self._poll = exit_fn, poll_s
        self._phase: str | None = None
        self._started = 0.0
        self._deadline = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def deadline_s(self, phase: str | None = None) -> float:
        """`phase`'s deadline in seconds: FIRST_DEADLINE_S while the warm-up steps compile,
        then the fixed one, or auto (FIRST_DEADLINE_S for a phase's first run)."""
        if len(self.step_times) < WARMUP_STEPS:
            return FIRST_DEADLINE_S
        if self.fixed is not None:
            return self.fixed
        earlier = self.phase_times.get(phase) if phase is not None else [0.0]
        if not earlier:
            return FIRST_DEADLINE_S
        return max(auto_deadline(self.step_times), 10.0 * max(earlier))

    def enter(self, phase: str) -> None:
        """`phase` starts now; its deadline runs from here."""
        self._finish()
        self._phase, self._started = phase, time.monotonic()
        self._deadline = self._started + self.deadline_s(phase)

    def idle(self) -> None:
        """No phase runs (nothing to watch) until the next `enter`."""
        self._finish()
        self._phase, self._deadline = None, float("inf")

    def _finish(self) -> None:
        """Record the running phase's wall time (the next auto deadline of that phase)."""
        if self._phase is not None:
            took = time.monotonic() - self._started
            self.phase_times.setdefault(self._phase, []).append(took)

    def step_done(self, done: int, seconds: float) -> None:
        """`done` steps are complete; the runner's call that ended them took `seconds`."""
        self.step = done
        self.step_times.append(seconds)

    def attach(self, timer: PhaseTimer) -> None:
        """Watch `timer`'s phases (the runner's rollout, reward, update, ...)."""
        timer.on_enter = self.enter

    def start(self) -> None:
        """Start watching (a daemon thread)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, for good."""
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(self._poll, max(self.deadline_s(self._phase) / 10, 0.05))):
            phase = self._phase
            if phase is not None and time.monotonic() > self._deadline:
                self.fire(phase)
                return

    def fire(self, phase: str) -> None:
        """Dump every thread's stack to the workdir and stderr, print the error line, exit."""
        where = f"after step {self.step}" if self.step is not None else "in the first step"
        dumped = self._dump()
        line = (
            f"error: no progress for {self.deadline_s(phase):.0f} s in phase {phase} {where} "
            f"(run.step_timeout_s={self.fixed or 0:g}"
            f"{'' if self.fixed else ', auto'}): a hung collective, a stopped or dead peer "
            f"process, or a stuck save; every thread's stack: {dumped}"
        )
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._exit(EXIT_STATUS)

    def _dump(self) -> str:
        """Write all threads' stacks to the dump file and stderr; returns where they went."""
        try:
            with open(self.dump_path, "w+") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.seek(0)
                sys.stderr.write(f.read())
            return f"{self.dump_path} (and above)"
        except OSError as e:  # the workdir itself may be what hangs or fails
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
            return f"above ({self.dump_path}: {e.strerror})"
