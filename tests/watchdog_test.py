"""No silent hangs (issue 52): the phase watchdog, failed background saves, a stopped peer, a
pod's per-host disks; and the profile window and the phase times of a micro run."""

import io
import json
import os
import shutil
import signal
import threading
import time

import pytest
from helpers import start_trainers

from configs import micro
from ebpo_jax.runtime import checkpoint, tracing
from ebpo_jax.runtime import watchdog as wd
from ebpo_jax.runtime.checkpoint import Checkpointer, CheckpointError
from ebpo_jax.trainer import loop


def test_the_phase_timer_sums_each_phase_and_announces_it():
    timer, heard = wd.PhaseTimer(), []
    timer.on_enter = heard.append
    for name in ("rollout", "update", "rollout"):
        with timer(name):
            time.sleep(0.01)
    times = timer.take()
    assert heard == ["rollout", "update", "rollout"]
    assert set(times) == {"phase/rollout_s", "phase/update_s"}
    assert times["phase/rollout_s"] >= 0.02 and times["phase/update_s"] >= 0.01
    assert timer.take() == {}


def test_the_auto_deadline_waits_out_the_compiling_steps_then_follows_them():
    assert wd.auto_deadline([]) == wd.auto_deadline([900.0, 2.0]) == wd.FIRST_DEADLINE_S
    assert wd.auto_deadline([40.0, 2.0, 3.0]) == wd.MIN_DEADLINE_S  # 2 x 40, 10 x 3 < 600
    assert wd.auto_deadline([500.0, 90.0, 30.0, 999.0]) == 1000.0  # 2 x the compiling step
    assert wd.auto_deadline([100.0, 70.0, 30.0]) == 700.0  # 10 x the slowest later one


def test_a_phase_first_run_after_the_warm_up_gets_the_compile_deadline_then_its_own(
    tmp_path, monkeypatch
):
    """The first evaluation (compiles, scores a whole held-out set) is not held to the steps'
    deadline; later ones get 10 x the slowest earlier evaluation when that is longer."""
    clock = [0.0]
    monkeypatch.setattr(wd.time, "monotonic", lambda: clock[0])
    dog = wd.Watchdog(0, str(tmp_path))
    for step in range(wd.WARMUP_STEPS):
        dog.step_done(step + 1, 1.0)
    dog.enter("log")
    assert dog.deadline_s("log") == wd.FIRST_DEADLINE_S
    clock[0] += 2.0
    dog.enter("evaluate")
    assert dog.deadline_s("log") == wd.MIN_DEADLINE_S  # max(600, 10 x 2 s)
    assert dog.deadline_s("evaluate") == wd.FIRST_DEADLINE_S
    clock[0] += 900.0  # one slow evaluation
    dog.idle()
    assert dog.deadline_s("evaluate") == 9000.0
    dog.fixed = 30.0  # run.step_timeout_s set: the same for every phase
    assert dog.deadline_s("evaluate") == dog.deadline_s("never_run") == 30.0


def _fired(tmp_path, timeout_s, monkeypatch):
    """A watchdog past its warm-up whose phase outlives `timeout_s`: (exit status, stderr)."""
    err, status = io.StringIO(), []
    monkeypatch.setattr("sys.stderr", err)
    dog = wd.Watchdog(timeout_s, str(tmp_path), 1, exit_fn=status.append, poll_s=0.02)
    for step in range(wd.WARMUP_STEPS):
        dog.step_done(step + 1, 0.01)
    dog.start()
    dog.enter("collective")
    deadline = time.monotonic() + 5
    while not status and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    return status, err.getvalue()


def test_a_phase_past_its_deadline_dumps_every_stack_and_exits_1_with_one_line(
    tmp_path, monkeypatch
):
    status, err = _fired(tmp_path, 0.2, monkeypatch)
    assert status == [1]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0])
    assert "phase collective after step 3" in errors[0] and "run.step_timeout_s=0.2" in errors[0]
    dump = (tmp_path / "hang-p1.txt").read_text()
    assert "step-watchdog" in dump or "Thread" in dump  # faulthandler: every thread's stack
    assert "Current thread" in dump and "Thread 0x" in err


def test_a_phase_within_its_deadline_and_an_idle_watchdog_never_fire(tmp_path):
    status = []
    dog = wd.Watchdog(0.3, str(tmp_path), exit_fn=status.append, poll_s=0.02)
    dog.step_times = [0.01] * wd.WARMUP_STEPS
    dog.start()
    for _ in range(5):  # each phase ends before its deadline
        dog.enter("update")
        time.sleep(0.1)
    dog.idle()
    time.sleep(0.5)
    dog.stop()
    assert status == []


class _Profiler:
    def __init__(self):
        self.calls = []

    def start_trace(self, log_dir):
        self.calls.append(("start", log_dir))

    def stop_trace(self):
        self.calls.append(("stop",))


@pytest.mark.parametrize(
    "window,k,expected",
    [("1:3", 1, [1, 3]), ("2:3", 2, [2, 4]), ("0:1", 1, [0, 1]), ("5:9", 1, [5, 8])],
)
def test_the_trace_window_covers_exactly_the_calls_of_steps_a_to_b(window, k, expected):
    prof = _Profiler()
    trace, started, stopped = tracing.StepTrace(window, "/w", profiler=prof), None, None
    with trace:
        for step in range(0, 8, k):
            trace.before(step, k)
            if trace.active and started is None:
                started = step
            trace.after(step + k)
            if not trace.active and started is not None and stopped is None:
                stopped = step + k
    assert [started, stopped or 8] == expected
    assert prof.calls[0] == ("start", "/w") and prof.calls.count(("stop",)) == 1


@pytest.mark.parametrize("text", ["3", "3:3", "a:b", "-1:2", "1:2:3"])
def test_a_bad_profile_window_is_one_line_naming_the_field(text):
    from ebpo_jax.config import ConfigError, default_config
    from ebpo_jax.schema import parse

    c = default_config()
    c.profile_steps = text
    with pytest.raises(ConfigError, match=r"^profile_steps="):
        parse(c)


def test_a_micro_run_traces_its_window_times_its_phases_and_a_failed_async_save_ends_it(
    tmp_path, monkeypatch
):
    """One run: steps 1-2 traced; phase times in every row and the progress line; the save
    of step 2 fails in orbax's background thread, and the run ends at the next step."""
    c = micro.get_config()
    c.unlock()
    c.workdir, c.mesh.devices, c.total_steps = str(tmp_path), 1, 6
    c.checkpoint_every, c.profile_steps, c.log_every, c.eval_every = 2, "1:3", 1, 6
    real, real_check, failed = checkpoint.write_manifest, Checkpointer.check, threading.Event()

    def failing(step_dir):  # the background commit of step 2 hits a full disk
        if os.path.basename(step_dir).startswith("2."):
            failed.set()
            raise OSError(28, "No space left on device", step_dir)
        real(step_dir)

    def check(self, calls=[]):  # noqa: B006  step 3 may be quicker than the failing commit
        calls.append(1)
        if len(calls) == 3:
            failed.wait(60)
            time.sleep(0.5)
        real_check(self)

    monkeypatch.setattr(checkpoint, "write_manifest", failing)
    monkeypatch.setattr(Checkpointer, "check", check)
    lines = []
    with pytest.raises(CheckpointError) as e:
        loop.train(c, log=lines.append)
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Found at the first check after the save (step 3), not at a later save or at close.
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert {"phase/weight_move_s", "phase/rollout_s", "phase/update_s"} <= set(r)
        assert r["phase/rollout_s"] + r["phase/update_s"] <= r["perf/step_time_s"] + 1e-3
    assert "phase/checkpoint_s" in rows[3]  # the save of step 2, in the next row
    traces = list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_a_failed_reward_worker_is_one_error_line_and_exit_1(monkeypatch, capsys):
    import sys

    from ebpo_jax import cli
    from ebpo_jax.runtime.workers import WorkerError

    def main(_):
        raise WorkerError("reward 'math' failed on 3 items, first: item 0: ValueError: boom")

    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        cli.run(main)
    assert e.value.code == 1
    assert capsys.readouterr().err == (
        "error: reward 'math' failed on 3 items, first: item 0: ValueError: boom\n"
    )


# ---------------------------------------------------------------- two processes (slow)

_ONE_LINE_S = 40  # slack over the deadline on a loaded 2-core CPU


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def _wait_for_step(workdir, step, procs, timeout=600):
    """Until process 0's metrics.jsonl has a row of `step` (or a process exited)."""
    path, end = os.path.join(workdir, "metrics.jsonl"), time.monotonic() + timeout
    while time.monotonic() < end and all(p.poll() is None for p in procs):
        if os.path.exists(path):
            with open(path) as f:
                if any(json.loads(x).get("step", -1) >= step for x in f if x.strip()):
                    return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} in {path}: {[p.poll() for p in procs]}")


def _exit_within(proc, seconds) -> tuple[int, str]:
    out = proc.communicate(timeout=seconds)[0]
    return proc.returncode, out


@pytest.mark.slow  # 292 s on a heavily loaded 2-core CPU: two processes compile micro
def test_a_stopped_peer_ends_the_other_process_with_one_line_within_the_deadline(tmp_path):
    timeout = 20
    flags = (f"--config.step_timeout_s={timeout}", "--config.total_steps=400")
    flags += ("--config.checkpoint_every=1000", "--config.eval_every=400")
    procs = start_trainers(tmp_path, *flags)
    try:
        _wait_for_step(tmp_path, wd.WARMUP_STEPS + 1, procs)
        procs[1].send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        rc, out = _exit_within(procs[0], timeout + _ONE_LINE_S)
        waited = time.monotonic() - t_stop
        assert rc == 1, out[-3000:]
        assert len(_errors(out)) == 1 and "phase" in _errors(out)[0], out[-3000:]
        assert waited < timeout + _ONE_LINE_S
        assert (tmp_path / "hang-p0.txt").exists()
        procs[1].send_signal(signal.SIGCONT)  # it finds its own deadline past, or its peer gone
        rc1, out1 = _exit_within(procs[1], timeout + _ONE_LINE_S)
        assert rc1 != 0, out1[-3000:]
        print(f"p0 exit {rc} after {waited:.1f} s: {_errors(out)}; p1 exit {rc1}: {_errors(out1)}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _private_disks(tmp_path):
    """Per-process bind mounts of host<i>/ over one path (a pod's local disks), or skip."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for private mounts")
    shared = tmp_path / "disk"
    shared.mkdir()
    homes = [tmp_path / f"host{i}" for i in range(2)]
    for h in homes:
        h.mkdir()

    def wrap(i, cmd):
        inner = f'mount --bind {homes[i]} {shared} && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "bash", "-c", inner, "bash", *cmd]

    return shared / "run", wrap


@pytest.mark.slow  # 242 s and 563 s on a heavily loaded 2-core CPU
def test_a_pod_without_a_shared_workdir_exits_with_one_line_instead_of_hanging(tmp_path):
    workdir, wrap = _private_disks(tmp_path)
    timeout = 30
    flags = (f"--config.step_timeout_s={timeout}", "--config.total_steps=8")
    flags += ("--config.checkpoint_every=4", "--config.eval_every=8")
    procs, t0 = start_trainers(workdir, *flags, wrap=wrap), time.monotonic()
    try:
        results = [_exit_within(p, 600) for p in procs]  # hung today: killed after 15 min
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rc, out in results:
        assert rc != 0, out[-3000:]
        assert len(_errors(out)) == 1, out[-3000:]
        print(f"exit {rc} after {time.monotonic() - t0:.0f} s: {_errors(out)}")
