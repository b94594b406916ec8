"""The shared worker pool: a call over its timeout is cut and its worker replaced, a call
that raises gives its error, a task workers cannot load raises LoadError."""

import math
import time

import pytest

from ebpo_jax.runtime.workers import LoadError, Outcome, WorkerPool


class _Unloadable:
    """Pickles fine, fails to unpickle in the worker (int("x"))."""

    def __reduce__(self):
        return int, ("x",)


def test_hung_call_is_cut_raising_call_gives_its_error_and_the_pool_keeps_working():
    with WorkerPool(2) as pool:
        pool.wait_ready()
        pids = pool.pids
        t0 = time.monotonic()
        out = pool.map(time.sleep, [0, 600, 0], timeout_s=0.5)
        assert time.monotonic() - t0 < 30
        assert out[0] == out[2] == Outcome(None) and out[1].cut and "timed out" in out[1].error
        assert len(set(pool.pids) - set(pids)) == 1  # the hung worker was replaced
        out = pool.map(math.sqrt, [4.0, "x", 9.0], timeout_s=5.0)
        assert [o.value for o in out] == [2.0, None, 3.0]
        assert out[1].error.startswith("TypeError") and not out[1].cut
        with pytest.raises(LoadError, match="ValueError"):
            pool.map(_Unloadable(), [1], timeout_s=5.0)
        assert pool.map(abs, [-1, -2], timeout_s=5.0) == [Outcome(1), Outcome(2)]
