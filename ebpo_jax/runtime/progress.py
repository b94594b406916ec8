"""Training progress for a person: a tqdm bar on a terminal, one text line per interval in a log.

Under `make train > log`, nohup or a batch job there is no terminal, tqdm hides its bar, and
nothing would be printed between the start and the summary; `TextProgress` prints a line
every `every` steps and at least every `every_s` seconds instead (step, reward, the latest
held-out pass@1, tokens/s, ETA). `progress()` picks one of the two; `summary()` is the
closing lines of experiments/train.py.
"""

import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from ebpo_jax.runtime.metrics import format_value
from ebpo_jax.runtime.shell import Shell


def format_duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def phase_summary(metrics: Mapping[str, Any]) -> str:
    """The step's `phase/<name>_s` times as "rollout 1.20s reward 0.10s" ("" if none)."""
    return " ".join(
        f"{k[len('phase/') : -len('_s')]} {format_value(v, '.2f')}s"
        for k, v in metrics.items()
        if k.startswith("phase/") and k.endswith("_s")
    )


class ProgressBar:
    """A tqdm bar over steps showing reward, pass rate (last eval pass@1) and tokens/s."""

    def __init__(self, total: int, *, initial: int = 0, disable: bool | None = None):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, unit="step", disable=disable)
        self._pass_rate = None

    def compiling(self) -> None:
        """Say so while the first step compiles (the bar would sit at ?step/s)."""
        self._bar.set_description("compiling", refresh=True)

    def write(self, message: str) -> None:
        """Print a line above the bar, never into its line."""
        self._bar.write(message)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Move the bar to `step` + 1 and show the latest metrics."""
        if "eval/pass@1" in metrics:
            self._pass_rate = metrics["eval/pass@1"]
        postfix = {}
        for label, key in (("reward", "reward/mean"), ("tok/s", "perf/tokens_per_s")):
            if key in metrics:  # None / NaN (a skipped step) shows as "nan"
                postfix[label] = format_value(metrics[key])
        if self._pass_rate is not None:
            postfix["pass@1"] = format_value(self._pass_rate, ".3f")
        self._bar.set_postfix(postfix, refresh=False)
        if self._bar.desc:
            self._bar.set_description("", refresh=False)
        self._bar.update(step + 1 - self._bar.n)

    def close(self) -> None:
        self._bar.close()


class TextProgress:
    """One line per `every` steps or `every_s` seconds, whichever comes first."""

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        every: int = 10,
        every_s: float = 30.0,
        print_fn: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.every, self.every_s = total, every, every_s
        self._print, self._clock = print_fn, clock
        self._pass = None  # (pass@1, step) of the latest evaluation
        self._first = initial  # the first step of this call: it compiles, ETA skips it
        self._t_first = None  # when the first step of this call ended
        self._t_last = clock()

    def compiling(self) -> None:
        self._print(f"step {self._first + 1}/{self.total}: compiling the train step ...")

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """After step index `step` (0-based) ran: print a line when one is due."""
        done = step + 1
        now = self._clock()
        if metrics.get("eval/pass@1") is not None:
            self._pass = (metrics["eval/pass@1"], done)
        if self._t_first is None:
            self._t_first = now
        due = done % self.every == 0 or now - self._t_last >= self.every_s or done == self.total
        if due:
            self._t_last = now
            self._print(self.line(done, metrics, now))

    def line(self, done: int, metrics: Mapping[str, Any], now: float) -> str:
        parts = [f"step {done}/{self.total}"]
        parts.append(f"reward {format_value(metrics.get('reward/mean'), '.3f')}")
        if self._pass is not None:
            parts.append(f"pass@1 {100 * self._pass[0]:.1f}% (step {self._pass[1]})")
        parts.append(f"{format_value(metrics.get('perf/tokens_per_s'), '.0f')} tok/s")
        if phases := phase_summary(metrics):
            parts.append(phases)
        timed = done - self._first - 1  # steps since the compiled one
        if timed > 0 and done < self.total:
            eta = (now - self._t_first) / timed * (self.total - done)
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def write(self, message: str) -> None:
        self._print(message)

    def close(self) -> None:
        pass


def progress(
    total: int, *, initial: int, every: int, every_s: float, enabled: bool = True, tty=None
):
    """A ProgressBar on a terminal, else a TextProgress; a silent bar when not `enabled`."""
    if not enabled or initial >= total:  # nothing left to train: no bar, no blank line
        return ProgressBar(total, initial=initial, disable=True)
    tty = sys.stdout.isatty() if tty is None else tty
    if tty:
        return ProgressBar(total, initial=initial, disable=False)
    return TextProgress(
        total, initial=initial, every=every, every_s=every_s, print_fn=_print_flushed
    )


def _print_flushed(line: str) -> None:
    print(line, flush=True)


def summary(s: dict, config, sh: Shell | None = None) -> str:
    """train()'s summary `s` as the closing lines: the warm start's and the latest evaluated
    pass@1 (with its step), where the outputs are, and commands that `sh` (this shell) runs."""
    sh = sh or Shell.here()
    if math.isnan(s["pass@1_start"]) and s["pass@1_end_step"] is None:
        score = "no held-out evaluation (the task has no held-out set)"
    else:
        start = "warm start"
        if config.sft.steps == 0 and not config.model.hf_path:
            start = "untrained start: this config has no warm start, sft.steps=0"
        end = "not evaluated"
        if s["pass@1_end_step"] is not None:
            end = f"{100 * s['pass@1_end']:.1f}% (step {s['pass@1_end_step']})"
        score = f"held-out pass@1: {100 * s['pass@1_start']:.1f}% ({start}) -> {end}"
    run = f"trained to step {s['step']}" + (" (stopped early)" if s["stopped_early"] else "")
    run += f", {s['wall_time_s']:.0f} s"
    if s.get("resumed_from") == s["step"]:  # a resume of a finished run trains nothing
        run = f"nothing to train: the run is at step {s['step']} (raise --config.total_steps)"
    return (
        f"{score}\n{run}\n"
        f"workdir: {s['workdir']}\nmetrics: {s['metrics']}\ncheckpoints: {s['checkpoints']}\n"
        f"plot: {sh.script('experiments/plot_run.py', s['workdir'])}\n"
        f"tensorboard: {shlex.join([sh.tool('tensorboard'), '--logdir', s['workdir']])}"
    )
