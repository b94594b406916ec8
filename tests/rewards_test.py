"""Math rewards: a table of equivalent/wrong/garbage answers, the timeout, the registry."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ebpo_jax import rewards

LONG = "Let me think about this carefully. " * 3000  # ~100k characters of reasoning

# (response, gold answer, expected reward of math_reward)
CASES = [
    # plain and "Answer:" lines (the paper's prompt format)
    ("Answer: 72", "72", 1.0),
    ("We compute 8*9.\nAnswer: 72", "72", 1.0),
    ("answer: 72", "72", 1.0),
    ("Answer: $72$", "72", 1.0),
    ("Answer: 72.", "72", 1.0),
    ("Answer: 1,000,000", "1000000", 1.0),
    ("Answer: 71", "72", 0.0),
    ("Answer: 72\nAnswer: 73", "72", 0.0),  # the last answer line counts
    # equivalent fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    ("Answer: 1/2", r"\frac{1}{2}", 1.0),
    ("Answer: 0.50", "1/2", 1.0),
    ("Answer: 2/4", "0.5", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\frac{2}{3}}", "0.5", 0.0),
    (r"\boxed{-\frac{1}{3}}", r"-\frac{1}{3}", 1.0),
    (r"\boxed{\frac{1}{3}}", r"-\frac{1}{3}", 0.0),
    # boxed, nested braces, nested boxes
    (r"The answer is $\boxed{3}$.", "3", 1.0),
    (r"\boxed{\boxed{3}}", "3", 1.0),
    (r"first \boxed{2}, finally \boxed{5}", "5", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\sqrt{2}}", r"2^{1/2}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    # units and text
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    ("Answer: 5 cm", "5", 1.0),
    (r"\boxed{30^\circ}", "30", 1.0),
    (r"Answer: \$12", "12", 1.0),
    ("Answer: 45 degrees", "45", 1.0),
    # percent answers compare as numbers (p\% = p/100); a percent gold also takes its number
    (r"\boxed{50\%}", "50", 0.0),
    (r"Answer: 1\%", "1", 0.0),
    (r"Answer: 100\%", "1", 1.0),
    (r"\boxed{50\%}", r"50\%", 1.0),
    ("Answer: 0.5", r"50\%", 1.0),
    ("Answer: 50", r"50\%", 1.0),
    ("Answer: 5", r"50\%", 0.0),
    # sets, intervals, tuples
    (r"\boxed{[1, 2)}", "[1,2)", 1.0),
    (r"\boxed{(1, 2]}", "[1,2)", 0.0),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", 1.0),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", 0.0),
    (r"\boxed{(-\infty, 0)}", r"(-\infty,0)", 1.0),
    (r"\boxed{(3, 4)}", "(3,4)", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    # an equation is an answer only in the gold's own form
    ("Answer: 2+2 = 1", "1", 0.0),
    (r"\boxed{1+1=2}", "2", 0.0),
    ("Answer: x = 2 = 3", "3", 0.0),
    ("Answer: y = 2x + 3", "y=2x+3", 1.0),
    # wrong answers and garbage
    ("Answer: 12", "13", 0.0),
    ("I don't know.", "13", 0.0),
    ("", "13", 0.0),
    (r"\boxed{", "13", 0.0),
    (r"\boxed{}}}}{{{", "13", 0.0),
    ("Answer:", "13", 0.0),
    ("\x00\x01\x02 ??? $$ \\frac{", "13", 0.0),
    ("🙂" * 50, "13", 0.0),
    # very long responses: only the tail is read, fast
    (LONG + "\nAnswer: 42", "42", 1.0),
    (LONG + r"\boxed{41}", "42", 0.0),
    ("x" * 200_000, "42", 0.0),
]


@pytest.fixture(scope="module")
def pool():
    # The shared pool, so the fixed-name math_reward below reuses it: one start-up per file.
    p = rewards.default_pool(2)
    p.wait_ready()
    return p


def test_math_reward_table(pool):
    assert len(CASES) >= 40
    responses, answers, _ = zip(*CASES)
    t0 = time.monotonic()
    got = pool.map("math", responses, answers, timeout_s=20.0)
    assert time.monotonic() - t0 < 30
    wrong = [(r[:60], a, e, g) for (r, a, e), g in zip(CASES, got) if g != e]
    assert not wrong, wrong
    assert got.dtype == np.float32 and got.shape == (len(CASES),)


def test_pathological_input_is_cut_by_timeout(pool):
    # math-verify spends its own 3 s alarm on this power tower; the pool cuts it at 0.5 s.
    before = pool.num_timeouts
    t0 = time.monotonic()
    got = pool.map(
        "math_verify", [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{4}"], ["1", "4"], timeout_s=0.5
    )
    elapsed = time.monotonic() - t0
    assert got.tolist() == [0.0, 1.0]
    assert pool.num_timeouts == before + 1
    assert elapsed < 2.5, elapsed
    # The killed worker is replaced: the pool keeps scoring.
    assert pool.map("math", ["Answer: 7"] * 4, ["7"] * 4).tolist() == [1.0] * 4


def test_custom_reward_by_import_path(pool):
    got = pool.map("ebpo_jax.rewards:format_reward", ["x\nAnswer: 3", "no answer"], ["", ""])
    assert got.tolist() == [1.0, 0.0]
    assert pool.map(rewards.format_reward, ["Answer: 1"], [""]).tolist() == [1.0]
    assert pool.map(rewards.math_reward, ["Answer: 0.5"], ["1/2"]).tolist() == [1.0]


def test_failing_custom_reward_raises_with_context(pool):
    with pytest.raises(RuntimeError, match="item 0"):
        pool.map("math:sqrt", ["a"], ["b"])  # a TypeError inside the worker
    assert pool.map("answer_match", ["Answer: 1"], ["1"]).tolist() == [1.0]  # still usable


def test_extract_and_normalize():
    assert rewards.extract_answer("blah\nAnswer: 12 apples") == "12 apples"
    assert rewards.extract_answer(r"so \boxed{\frac{1}{\sqrt{2}}} done") == r"\frac{1}{\sqrt{2}}"
    assert rewards.extract_answer("nothing here") is None
    assert rewards.last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert rewards.normalize_answer(r"$\boxed{\dfrac{1}{2}}$") == "1/2"
    assert rewards.normalize_answer("0.500") == "1/2"
    assert rewards.normalize_answer(r"\text{(A)}") == "(A)"


def test_format_reward():
    assert rewards.format_reward("work\nAnswer: 5") == 1.0
    assert rewards.format_reward(r"so \boxed{5}") == 1.0
    assert rewards.format_reward("Answer: 5\nmore text") == 0.0
    assert rewards.format_reward("") == 0.0


def test_get_reward():
    assert rewards.get_reward("math") is rewards.math_reward
    assert rewards.get_reward("ebpo_jax.rewards:format_reward") is rewards.format_reward
    fn = lambda r, a: 1.0
    assert rewards.get_reward(fn) is fn
    with pytest.raises(ValueError, match="known:.*math"):
        rewards.get_reward("nope")
    with pytest.raises(ValueError, match="cannot load"):
        rewards.get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="cannot load"):
        rewards.get_reward("ebpo_jax.rewards:no_such_fn")


def test_map_validates_lengths(pool):
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        pool.map(lambda r, a: 1.0, ["a"], ["a"])
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        pool.map("math", ["a", "b"], ["a"])
    with pytest.raises(ValueError, match="unknown reward"):
        pool.map("nope", ["a"], ["a"])


def test_math_reward_default_pool(pool):
    # The fixed-name API: single items through the shared pool, which starts lazily.
    assert rewards.math_reward(r"\boxed{0.25}", r"\frac{1}{4}") == 1.0
    assert rewards.math_reward("Answer: 3", "4") == 0.0
    got = rewards.math_rewards(["Answer: 1", "Answer: 2"], ["1", "1"], timeout_s=10.0, workers=2)
    assert got.tolist() == [1.0, 0.0]


# Issue 22: the answer is compared whole; a parse that drops part of it scores 0.
GAMING = [
    ("Answer: 1+x", "1"),
    ("Answer: 1+__import__('os')", "1"),
    (r"\boxed{1+__import__('os')}", "1"),
    ("Answer: 1 or 2 or 3", "1"),
    ("The answer is 1.", "1"),  # no "Answer:" and no \boxed: nothing to compare
    ("Answer: 1\nbut really 2", "2"),  # the answer is the rest of its line, not the tail
]


def test_partial_answers_score_zero(pool):
    responses, answers = zip(*GAMING)
    for name in ("math", "math_verify", "answer_match"):
        got = pool.map(name, responses, answers, timeout_s=20.0)
        assert got.tolist() == [0.0] * len(GAMING), (name, got)
    # The same answers, whole, still score.
    assert pool.map("math", ["Answer: 1", r"\boxed{x+1}"], ["1", "1+x"]).tolist() == [1.0, 1.0]


def test_extract_answer_takes_the_last_marker_whole():
    assert rewards.extract_answer("Answer: 2. Final answer: 3") == "3"
    assert rewards.extract_answer("Answer: 1+x\nthanks") == "1+x"
    assert rewards.extract_answer("Answer:   \n") is None
    assert rewards.final_answer("Answer: " + "1" * (rewards.MAX_ANSWER_CHARS + 1)) is None


def test_normalisation_is_linear_time():
    # The old trailing-units regex took 13.7 s on 4,000 units (quadratic).
    for text in ("5" + " cm" * 50_000, "5" + " cm" * 50_000 + " x", "\\text{" * 50_000 + "5"):
        t0 = time.perf_counter()
        rewards.normalize_answer(text)
        assert time.perf_counter() - t0 < 1.0
    assert rewards.strip_trailing_units("5 m^{2}") == "5"
    assert rewards.strip_trailing_units("x+m") == "x+m"  # "m" after an operator is a variable
    assert rewards.strip_text_macros(r"\text{\textbf{(A)}} {b}") == "(A) {b}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_workers_die_with_the_parent(tmp_path):
    # The workers are busy on a reward that never returns when the owner is SIGKILLed.
    (tmp_path / "spin.py").write_text("def spin(r, a):\n    while True:\n        pass\n")
    script = tmp_path / "owner.py"
    script.write_text(
        "from ebpo_jax import rewards\n"
        "if __name__ == '__main__':\n"
        "    pool = rewards.RewardPool(2)\n"
        "    pool.wait_ready()\n"
        "    print(' '.join(str(pid) for pid in pool.pids), flush=True)\n"
        "    pool.map('spin:spin', ['a', 'b'], ['a', 'b'], timeout_s=600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(1.0)  # both items sent: the workers spin
    finally:
        proc.kill()  # SIGKILL: no atexit, no close()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_math_reward_from_a_script_without_main_guard(tmp_path):
    # forkserver/spawn re-import the caller's __main__ unless it is hidden from them.
    script = tmp_path / "plain.py"
    script.write_text(
        "from ebpo_jax import rewards\n"
        "print('TOP LEVEL RAN', flush=True)\n"
        "print(rewards.math_reward('Answer: 0.5', '1/2'), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["TOP", "LEVEL", "RAN", "1.0"], out.stdout


def test_reward_defined_in_main_is_refused(pool):
    def fn(r, a):
        return 1.0

    fn.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in __main__"):
        pool.map(fn, ["a"], ["a"])


def test_the_pooled_math_reward_is_answer_match_or_math_verify():
    """The shared steps run once in `math_reward`'s worker form; its scores are unchanged."""
    pairs = [(r, a) for r, a, _ in CASES[:12]] + [("Answer: 1\\%", "1"), ("Answer: x = 5", "5")]
    for response, answer in pairs:
        either = rewards.answer_match_reward(response, answer) or rewards.math_verify_reward(
            response, answer
        )
        assert rewards._math_reward_local(response, answer) == either, (response, answer)
