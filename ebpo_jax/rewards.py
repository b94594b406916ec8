"""Verifiable math rewards: math-verify plus the DAPO/Minerva "Answer:" extractor, run in a process pool.

math-verify bounds its own work with `signal.alarm`, which only works in a process's main
thread and cannot interrupt C code (e.g. sympy on a huge power). So every verification runs
in a worker process of a `RewardPool` (an `ebpo_jax.runtime.workers.WorkerPool`); a worker that
overruns its per-item timeout is killed and replaced, and the item scores 0. Workers start
from a `forkserver` (or `spawn`), never `fork`, with the caller's `__main__` hidden (a plain
script without an `if __name__ == "__main__":` guard can score rewards), and die with the
parent.

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
import importlib
import multiprocessing as mp
import pickle
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from functools import partial

import numpy as np

from ebpo_jax.runtime.workers import LoadError, PoolOwner, WorkerError, WorkerPool

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


def _scored(response: str, answer: str, compare: Callable[[str, str], bool]) -> float:
    """The rewards' shared steps: the final answer (0 without one), the percent rule, then
    `compare(predicted, answer)`."""
    predicted = final_answer(response)
    if predicted is None:
        return 0.0
    percent = percent_match(predicted, answer)
    if percent is not None:
        return percent
    return float(compare(predicted, answer))


def _normalized_equal(predicted: str, answer: str) -> bool:
    """Whether both sides are equal after `normalize_answer`."""
    return normalize_answer(predicted) == normalize_answer(answer)


def answer_match_reward(response: str, answer: str) -> float:
    """1.0 iff the extracted "Answer:" (or last boxed) equals `answer` after normalisation."""
    return _scored(response, str(answer), _normalized_equal)


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


def _verified(predicted: str, answer: str) -> bool:
    """Whether math-verify finds the whole of `predicted` equivalent to `answer`."""
    from math_verify import parse, verify  # heavy import, only in reward workers

    gold_text = answer
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    value = equation_value(_math_text(predicted)[1:-1], gold_text)
    if value is None:
        return False
    pred_text = f"${value}$"
    try:
        gold = parse(gold_text, parsing_timeout=PARSE_TIMEOUT_S)
        pred = parse(pred_text, parsing_timeout=PARSE_TIMEOUT_S)
        if not gold or not pred or not _parse_is_whole(pred_text[1:-1], pred):
            return False
        return bool(verify(gold, pred, timeout_seconds=VERIFY_TIMEOUT_S))
    except Exception:  # noqa: BLE001  math-verify raises on malformed LaTeX: such an answer scores 0
        return False


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 iff math-verify finds the response's whole final answer equivalent to `answer`."""
    return _scored(response, str(answer), _verified)


def math_reward(response: str, answer: str) -> float:
    """1.0 if normalised exact match or math-verify accepts the response's answer, else 0.0.

    Runs in the default process pool (math-verify is not thread-safe and may hang).
    """
    return float(math_rewards([response], [answer])[0])


def _matched_or_verified(predicted: str, answer: str) -> bool:
    """Exact match after normalisation, else math-verify (the cheap test first)."""
    return _normalized_equal(predicted, answer) or _verified(predicted, answer)


def _math_reward_local(response: str, answer: str) -> float:
    """`math_reward` in the calling process (what pool workers run)."""
    return _scored(response, str(answer), _matched_or_verified)


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


def _score(spec: str | RewardFn, item: tuple[str, str]) -> float:
    """What a pool worker runs: the reward `spec` of one (response, answer)."""
    return float((_local_fn(spec) or get_reward(spec))(*item))


def _check_sendable(fn: str | RewardFn) -> None:
    """Fail here, not in every worker, on a bad name or a function workers cannot get."""
    if isinstance(fn, str):
        get_reward(fn)
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


class RewardPool(PoolOwner):
    """Worker processes scoring (response, answer) pairs, each item cut at a timeout (score 0)."""

    def __init__(self, workers: int = 2, *, start_method: str = "forkserver"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        # Under forkserver one clean server process imports math-verify once; workers (and
        # replacements for killed ones) fork from it in milliseconds.
        super().__init__(
            WorkerPool(
                workers,
                start_method=start_method,
                preload=("ebpo_jax.rewards", "math_verify"),
                name="reward worker",
            )
        )
        self.num_timeouts = 0  # items cut by the timeout, over the pool's life

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has imported math-verify (keeps start-up out of timeouts)."""
        self._workers.wait_ready(timeout_s)

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
        _check_sendable(fn)
        items = [(str(r), str(a)) for r, a in zip(responses, answers)]
        try:
            outcomes = self._workers.map(partial(_score, fn), items, timeout_s=timeout_s)
        except LoadError as e:
            raise WorkerError(f"reward workers cannot load {fn!r} ({e})") from None
        self.num_timeouts += sum(o.cut for o in outcomes)
        errors = [f"item {i}: {o.error}" for i, o in enumerate(outcomes) if o.error and not o.cut]
        if errors:  # raised only once every worker is idle again, so the pool stays usable
            raise WorkerError(f"reward {fn!r} failed on {len(errors)} items, first: {errors[0]}")
        return np.array([0.0 if o.error else o.value for o in outcomes], np.float32)


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
