"""Live-trace helpers of fastdecode/trace.py (what python_backend/metrics.py is fed from)."""
from __future__ import annotations

import pytest

from fastdecode.trace import PARTS, TraceCursor, step_totals


def rec(step, step_time=0.01, **kw):
    return {"step": step, "batch_size": 1, "context_tokens": 4, "step_time": step_time, **kw}


def test_cursor_hands_out_each_step_once_over_a_sliding_window():
    c = TraceCursor()
    assert c.take([]) == []
    window = [rec(i) for i in range(3)]
    assert [r["step"] for r in c.take(window)] == [0, 1, 2]
    assert c.take(window) == []
    window = [rec(i) for i in range(2, 6)]            # the window moved on; step 2 was handed out already
    assert [r["step"] for r in c.take(window)] == [3, 4, 5]
    window = [rec(i) for i in range(100, 104)]       # steps 6..99 left the window unseen: the rest still count
    assert [r["step"] for r in c.take(window)] == [100, 101, 102, 103]


def test_cursor_starts_over_on_a_new_trace():
    c = TraceCursor()
    c.take([rec(i) for i in range(10)])
    assert [r["step"] for r in c.take([rec(0), rec(1)])] == [0, 1]     # a new engine counts from 0 again


def test_step_totals():
    assert step_totals([]) == {}
    records = [rec(0, 0.01, s_time=0.004, r_time=0.003, s_wait=0.002, r_wait=0.007),
               rec(1, 0.03, s_time=0.02, r_time=None, s_wait=0.01, r_wait=None, batch_size=3, context_tokens=40),
               rec(2, 0.02, s_time=0.01, r_time=0.01, s_wait=0.0, r_wait=0.01, batch_size=2, context_tokens=30)]
    t = step_totals(records)
    assert t["steps"] == 3 and t["step_time"] == pytest.approx(0.06)
    assert {k: t[k] for k in PARTS} == pytest.approx({"s_time": 0.034, "r_time": 0.013, "s_wait": 0.012,
                                                      "r_wait": 0.017})
    assert (t["step_time_mean"], t["step_time_p50"], t["step_time_p99"], t["step_time_max"]) == \
        pytest.approx((0.02, 0.02, 0.03, 0.03))
    assert (t["batch_size"], t["context_tokens"]) == (2, 30)                   # the newest step's
    assert step_totals([rec(0)])["s_time"] == 0.0                              # a record without parts
