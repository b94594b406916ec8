"""Verifiable math rewards: math-verify plus the DAPO/Minerva "Answer:" extractor, run in a process pool.

math-verify bounds its own work with `signal.alarm`, which only works in a process's main
thread and cannot interrupt C code (e.g. sympy on a huge power). So every verification runs
in a worker process of a `RewardPool`; a worker that overruns its per-item timeout is killed
and replaced, and the item scores 0. Workers start from a `forkserver` (or `spawn`), never
`fork`: the parent has JAX threads. Both would re-import the caller's main script in each
worker, so workers are started with `sys.modules["__main__"]` hidden: a plain script
without an `if __name__ == "__main__":` guard can score rewards. Workers die with the
parent (Linux `PR_SET_PDEATHSIG`, plus a thread that watches the parent's pid).

The answer is what follows the last "Answer:" (to the end of that line) or the last
`\\boxed{}`, and it is compared whole: math-verify parses that answer alone, and a parse that
drops part of it (`1+__import__('os')` read as `1`) scores 0. Responses with neither marker
score 0. Normalisation is linear-time (hand-written loops, no backtracking regexes over
unbounded repeats), and answers over MAX_ANSWER_CHARS score 0.

Two rules decide before any string or math-verify comparison (`percent_match`,
`equation_value`):
- Percent: `p\\%` is the number p/100 and is compared by value. Against gold `1`, `100\\%`
  scores 1 and `1\\%` scores 0. A gold written as a percent also accepts its bare number
  (gold `25\\%`: `25\\%`, `0.25` and `25` score 1).
- Equations: when the gold has no `=`, an answer with one scores 0 unless it is a variable
  set to a value (`x = 5` is read as `5`); `2+2 = 1` is not the answer `1`. A gold that is
  an equation is compared as one.

Rewards are `fn(response: str, answer: str) -> float`, picked by name (`REWARDS`) or by
import path `"my_pkg.module:fn"` with `get_reward`.
"""

import atexit
import contextlib
import ctypes
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import signal
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

RewardFn = Callable[[str, str], float]

# The answer sits at the end; verifying only the tail bounds the work on very long responses.
MAX_RESPONSE_CHARS = 8192
# math-verify's own alarms (seconds), below the pool's default per-item timeout.
PARSE_TIMEOUT_S = 3
VERIFY_TIMEOUT_S = 3

# A final answer longer than this is not a math answer (and would only feed the parsers).
MAX_ANSWER_CHARS = 1000

_ANSWER_MARK = re.compile(r"answer\s*:", re.IGNORECASE)
_TEXT_MACRO_OR_BRACE = re.compile(
    r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{|[{}]"
)
_UNITS = (
    "degrees|degree|cm|mm|km|m|meters|meter|inches|inch|feet|foot|ft|units|unit|dollars|dollar"
    "|cents|cent|hours|hour|minutes|minute|seconds|second|sq|square|cubic|mph|pounds|pound|kg|g"
)
# Trailing units are matched on the reversed string from its start: one anchored, greedy
# pass with no backtracking across tokens, so stripping n units is O(n). (The obvious
# `(?:\s*unit)+$` retries from every start position: 4,000 units took 13.7 s.)
_UNITS_REVERSED = "|".join(sorted((u[::-1] for u in _UNITS.split("|")), key=len, reverse=True))
_TRAILING_UNITS_REVERSED = re.compile(
    rf"(?:\s*(?:\}}?\d\{{?\^|\d\^)?\.?(?:{_UNITS_REVERSED})(?=[\s\d}})]|\Z))*", re.IGNORECASE
)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(response: str) -> str | None:
    """The DAPO/Minerva answer: the rest of the line after the last "Answer:", else the last
    \\boxed{}; None if neither is there or the answer is empty."""
    last = None
    for last in _ANSWER_MARK.finditer(response):  # the last match is wanted
        pass
    if last is not None:
        end = response.find("\n", last.end())
        answer = response[last.end() : None if end < 0 else end].strip()
        return answer or None
    return last_boxed(response)


def strip_text_macros(s: str) -> str:
    """`\\text{5 cm}` -> `5 cm` at any nesting depth, in one left-to-right pass."""
    out, keep, last = [], [], 0  # keep: per open brace, whether its "}" stays
    for m in _TEXT_MACRO_OR_BRACE.finditer(s):
        token = m.group()
        if token == "}":
            if keep and not keep.pop():  # closes a \\text{: drop it
                out.append(s[last : m.start()])
                last = m.end()
            continue
        if token != "{":  # a \\text{ opener: drop it
            out.append(s[last : m.start()])
            last = m.end()
        keep.append(token == "{")
    out.append(s[last:])
    return "".join(out)


def strip_trailing_units(s: str) -> str:
    """Drop unit words ("cm", "degrees", "m^2", ...) at the end, however many, in O(len)."""
    s = s.rstrip()
    n = _TRAILING_UNITS_REVERSED.match(s[::-1]).end()
    if n == 0 or n == len(s):  # nothing to strip, or a bare unit word (it is the answer)
        return s
    return s[: len(s) - n].rstrip()


def _canonical_number(s: str) -> str | None:
    """Numbers as a canonical fraction string ("0.50", "1/2", "\\frac{1}{2}" -> "1/2"), else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        s = f"{m[1]}{m[2]}/{m[3]}"
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+)?", s) or len(s) > 100:
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return str(value)


def normalize_answer(answer: str) -> str:
    """Minerva-style normalisation for exact match (boxes, $, \\text, units, spacing, commas)."""
    s = str(answer).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\\$", "").replace("$", "")  # currency "\$12" and math delimiters
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", "")):
        s = s.replace(old, new)
    for junk in (
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\ ",
        "^\\circ",
        "^{\\circ}",
        "\\%",
        "%",
        "\\displaystyle",
    ):
        s = s.replace(junk, "")
    s = strip_trailing_units(strip_text_macros(s).strip())
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    while re.search(r"(\d),(\d{3})(?!\d)", s):  # 1,000,000 -> 1000000
        s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    return _canonical_number(s) or s


_PERCENT = re.compile(r"(.*?)\\?%")
# A variable set to a value: "x = ", "a_1 = ", "y_{n} = " (not "==", "x =< ...").
_ASSIGNED = re.compile(r"\s*[a-zA-Z](?:_\{?\w+\}?)?\s*=(?![=<>])")


def _number(s: str) -> Fraction | None:
    """The value of a numeric answer after normalisation ("1,000", "\\frac12"), else None."""
    try:
        return Fraction(normalize_answer(s))
    except (ValueError, ZeroDivisionError):
        return None


def _percent(answer: str) -> Fraction | None:
    """p of an answer written "p\\%" or "p%" (boxes, $ and text macros aside), else None."""
    s = str(answer).strip()
    boxed = last_boxed(s)
    s = boxed if boxed is not None else s
    s = re.sub(r"\s+", "", strip_text_macros(s.replace("\\$", "").replace("$", "")))
    m = _PERCENT.fullmatch(s)
    return None if m is None or not m.group(1) else _number(m.group(1))


def percent_match(predicted: str, answer: str) -> float | None:
    """The score when either side is a percent (see the module doc), else None."""
    p_pct, g_pct = _percent(predicted), _percent(answer)
    if p_pct is None and g_pct is None:
        return None
    p_val = p_pct / 100 if p_pct is not None else _number(predicted)
    g_val = g_pct / 100 if g_pct is not None else _number(answer)
    if p_val is None or g_val is None:
        return 0.0
    unit_dropped = g_pct is not None and p_pct is None and p_val == g_pct
    return float(p_val == g_val or unit_dropped)


def equation_value(predicted: str, answer: str) -> str | None:
    """The answer to compare: `predicted` itself, or `5` of `x = 5`; None (scores 0) for any
    other equation when the gold `answer` is not one (see the module doc)."""
    if "=" in str(answer) or "=" not in predicted:
        return predicted
    m = _ASSIGNED.match(predicted)
    rest = predicted[m.end() :] if m else ""
    return rest if rest.strip() and "=" not in rest else None


def final_answer(response: str) -> str | None:
    """The response's final answer (extract_answer over its tail), None if absent or too long."""
    predicted = extract_answer(str(response)[-MAX_RESPONSE_CHARS:])
    if predicted is None or len(predicted) > MAX_ANSWER_CHARS:
        return None
    return predicted


def answer_match_reward(response: str, answer: str) -> float:
    """1.0 iff the extracted "Answer:" (or last boxed) equals `answer` after normalisation."""
    predicted = final_answer(response)
    if predicted is None:
        return 0.0
    percent = percent_match(predicted, str(answer))
    if percent is not None:
        return percent
    return float(normalize_answer(predicted) == normalize_answer(str(answer)))


# Words an answer may contain that are not symbols of the parsed expression.
_MATH_WORDS = frozenset(
    ("sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh")
    + ("tanh", "log", "ln", "lg", "exp", "sqrt", "pi", "e", "i", "inf", "infty", "oo")
    + ("min", "max", "gcd", "lcm", "mod", "pmod", "deg")
)
_LATEX_COMMAND = re.compile(r"\\[a-zA-Z]+")
_WORD = re.compile(r"[a-zA-Z]+")


def _math_text(answer: str) -> str:
    """The answer as math-verify should see it: one `$...$`, text macros and units gone."""
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = strip_trailing_units(strip_text_macros(s.replace("\\$", "").replace("$", "")).strip())
    return f"${s}$"


def _parse_is_whole(text: str, parsed) -> bool:
    """Whether every word of `text` survived into the parsed expression.

    math-verify's LaTeX reader skips what it cannot read, so `1+__import__('os')` parses to
    `1`; such a lossy parse must not be compared with the gold answer.
    """
    symbols = set()
    for item in parsed:
        for sym in getattr(item, "free_symbols", ()):
            symbols.add(str(sym))
    for word in _WORD.findall(_LATEX_COMMAND.sub(" ", text)):
        if word in symbols or word.lower() in _MATH_WORDS or all(ch in symbols for ch in word):
            continue
        return False
    return True


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 iff math-verify finds the response's whole final answer equivalent to `answer`."""
    from math_verify import parse, verify  # heavy import, only in reward workers

    predicted = final_answer(response)
    if predicted is None:
        return 0.0
    percent = percent_match(predicted, str(answer))
    if percent is not None:
        return percent
    gold_text = str(answer)
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    value = equation_value(_math_text(predicted)[1:-1], gold_text)
    if value is None:
        return 0.0
    pred_text = f"${value}$"
    try:
        gold = parse(gold_text, parsing_timeout=PARSE_TIMEOUT_S)
        pred = parse(pred_text, parsing_timeout=PARSE_TIMEOUT_S)
        if not gold or not pred or not _parse_is_whole(pred_text[1:-1], pred):
            return 0.0
        return float(verify(gold, pred, timeout_seconds=VERIFY_TIMEOUT_S))
    except Exception:  # noqa: BLE001  math-verify raises on malformed LaTeX: such an answer scores 0
        return 0.0


def math_reward(response: str, answer: str) -> float:
    """1.0 if normalised exact match or math-verify accepts the response's answer, else 0.0.

    Runs in the default process pool (math-verify is not thread-safe and may hang).
    """
    return float(math_rewards([response], [answer])[0])


def _math_reward_local(response: str, answer: str) -> float:
    """`math_reward` in the calling process (what pool workers run)."""
    return answer_match_reward(response, answer) or math_verify_reward(response, answer)


def format_reward(response: str, answer: str = "") -> float:
    """1.0 iff the response ends with an "Answer: ..." line or contains a \\boxed{} answer."""
    lines = [ln.strip() for ln in str(response).strip().splitlines() if ln.strip()]
    ends_with_answer = bool(lines) and bool(re.match(r"answer\s*:\s*\S", lines[-1], re.IGNORECASE))
    return float(ends_with_answer or last_boxed(str(response)) is not None)


REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "answer_match": answer_match_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
}
# What a pool worker runs for each named reward (the pooled names would recurse).
_LOCAL = {"math": _math_reward_local}


def get_reward(spec: str | RewardFn) -> RewardFn:
    """A reward function from a name in REWARDS, an import path "pkg.module:fn", or a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"reward spec must be a name, 'module:fn' or a callable, got {spec!r}")
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; known: {sorted(REWARDS)} or 'pkg.module:fn'")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward {spec!r}: {e}") from e
    if not callable(fn):
        raise TypeError(f"reward {spec!r} is not callable")
    return fn


def _local_fn(spec):
    return _LOCAL.get(spec) if isinstance(spec, str) else None


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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

    threading.Thread(target=watch, daemon=True, name="reward-parent-watch").start()


def _worker_loop(conn, parent_pid: int | None = None) -> None:
    """Worker: answer (index, spec, response, answer) messages with (index, reward or error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import math_verify  # noqa: F401  (warm import before announcing readiness)

    conn.send("ready")
    fns = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        index, spec, response, answer = msg
        try:
            key = spec if isinstance(spec, str) else id(spec)
            if key not in fns:
                fns[key] = _local_fn(spec) or get_reward(spec)
            conn.send((index, float(fns[key](response, answer)), None))
        except Exception as e:  # noqa: BLE001  reported to the parent, which raises with context
            conn.send((index, 0.0, f"{type(e).__name__}: {e}"))


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
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_loop, args=(child, os.getpid()), daemon=True)
        with _main_hidden():
            self.process.start()
        child.close()
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class RewardPool:
    """Worker processes scoring (response, answer) pairs, each item cut at a timeout (score 0)."""

    def __init__(self, workers: int = 2, *, start_method: str = "forkserver"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (never fork), got {start_method!r}"
            )
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # One clean server process imports math-verify once; workers (and replacements
            # for killed ones) fork from it in milliseconds.
            self._ctx.set_forkserver_preload(["ebpo_jax.rewards", "math_verify"])
        self._workers = [_Worker(self._ctx) for _ in range(workers)]
        self.num_timeouts = 0  # items cut by the timeout, over the pool's life

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has imported math-verify (keeps start-up out of timeouts)."""
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            if not w.ready:
                if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"reward worker did not start within {timeout_s}s")
                try:
                    w.ready = w.conn.recv() == "ready"
                except EOFError:
                    w.process.join(5)
                    raise RuntimeError(
                        f"reward worker exited during start-up (exit code {w.process.exitcode})"
                    ) from None

    def map(
        self,
        fn: str | RewardFn,
        responses: Sequence[str],
        answers: Sequence[str],
        *,
        timeout_s: float = 10.0,
    ) -> np.ndarray:
        """Rewards [N] float32 of fn(responses[i], answers[i]); an item over `timeout_s` scores 0."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if fn is math_reward:  # the pooled wrapper would start a pool inside each worker
            fn = "math"
        if isinstance(fn, str):
            get_reward(fn)  # a bad name fails here, not in every worker
        elif getattr(fn, "__module__", None) == "__main__":
            raise ValueError(
                f"reward {fn!r} is defined in __main__, which worker processes never import; "
                "define it in a module and pass it (or its import path 'pkg.module:fn')"
            )
        else:
            try:
                pickle.dumps(fn)
            except Exception as e:  # noqa: BLE001  lambdas, closures: any pickling failure
                raise ValueError(
                    f"reward {fn!r} cannot be sent to worker processes ({e}); pass a "
                    "module-level function or its import path 'pkg.module:fn'"
                ) from None
        if not any(w.ready for w in self._workers):
            self.wait_ready()  # replacements for killed workers join while the batch runs
        out = np.zeros(len(responses), np.float32)
        errors: list[str] = []
        todo = deque(range(len(responses)))
        while todo or any(w.item is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.item is None and todo:
                    w.item = todo.popleft()
                    w.deadline = time.monotonic() + timeout_s
                    w.conn.send((w.item, fn, str(responses[w.item]), str(answers[w.item])))
            busy = [w for w in self._workers if w.item is not None or not w.ready]
            deadline = min((w.deadline for w in busy if w.item is not None), default=None)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 1e-3
            ready = mp.connection.wait([w.conn for w in busy], timeout=timeout)
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    self._receive(i, w, out, errors)
                elif w.item is not None and time.monotonic() > w.deadline:
                    out[w.item] = 0.0  # pathological item: kill its worker, start a fresh one
                    self.num_timeouts += 1
                    self._replace(i)
        if errors:  # raised only once every worker is idle again, so the pool stays usable
            raise RuntimeError(f"reward {fn!r} failed on {len(errors)} items, first: {errors[0]}")
        return out

    def _receive(self, i: int, w: _Worker, out: np.ndarray, errors: list[str]) -> None:
        try:
            msg = w.conn.recv()
        except EOFError:  # the worker died (e.g. out of memory): score 0, replace it
            if w.item is not None:
                out[w.item] = 0.0
                self.num_timeouts += 1
            self._replace(i)
            return
        if msg == "ready":
            w.ready = True
            return
        index, reward, error = msg
        w.item = None
        if error is not None:
            errors.append(f"item {index}: {error}")
        out[index] = reward

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx)

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
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


_POOLS: dict[int, RewardPool] = {}


def default_pool(workers: int | None = None) -> RewardPool:
    """The shared pool with `workers` processes, started on first use.

    `workers=None` takes any shared pool already started, else starts min(4, cpu count).
    """
    if workers is None and _POOLS:
        return next(iter(_POOLS.values()))
    n = workers or min(4, mp.cpu_count())
    if n not in _POOLS:
        _POOLS[n] = RewardPool(n)
    return _POOLS[n]


@atexit.register
def close_pools() -> None:
    """Stop every reward worker pool (they restart on the next call)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def math_rewards(
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    timeout_s: float = 10.0,
    workers: int | None = None,
    reward: str | RewardFn = "math",
) -> np.ndarray:
    """Rewards [N] float32 of `reward` (default: math_reward) over pairs, in the shared pool."""
    return default_pool(workers).map(reward, responses, answers, timeout_s=timeout_s)
