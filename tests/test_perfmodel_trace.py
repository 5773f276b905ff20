"""Trace summariser (fastdecode/trace.py) on synthetic traces."""
from __future__ import annotations

import json

import pytest

from fastdecode.trace import load_trace, summarize


def rec(step, batch, ctx, step_time, prefill=0, s=None, r=None, r_wait=0.0):
    s = step_time * 0.6 if s is None else s
    r = step_time * 0.3 if r is None else r
    return {"step": step, "time": 100.0 + step, "batch_size": batch, "num_prefill": prefill,
            "context_tokens": ctx, "s_time": s, "r_time": r, "s_wait": 0.1 * step_time, "r_wait": r_wait,
            "step_time": step_time}


def test_summary_numbers():
    recs = [rec(0, 4, 40, 2.0, prefill=4)] + [rec(i, 8, 100 + i, 0.5) for i in range(1, 9)] + [rec(9, 2, 20, 3.0)]
    s = summarize(recs, warmup=1, cooldown=1)
    assert s["steps"] == 10 and s["tokens"] == 4 + 8 * 8 + 2
    assert s["throughput_tok_s"] == pytest.approx(70 / (2.0 + 8 * 0.5 + 3.0))
    assert s["max_step_time_s"] == 3.0 and s["max_context_tokens"] == 108
    st = s["steady"]
    assert st["steps"] == 8 and st["max_step_time_s"] == 0.5 and st["throughput_tok_s"] == pytest.approx(16.0)
    assert st["max_context_tokens"] == 108 and st["mean_batch_size"] == 8
    assert st["s_util"] == pytest.approx(0.6) and st["r_util"] == pytest.approx(0.3)
    assert st["s_wait_frac"] == pytest.approx(0.1) and st["r_wait_frac"] == 0.0
    assert s["wall_time_s"] == pytest.approx(9 + 3.0)
    decode = summarize(recs, decode_only=True)["steady"]
    assert decode["steps"] == 9 and decode["max_step_time_s"] == 3.0


def test_r_wait_none_is_reported_as_unknown():
    recs = [rec(i, 1, 10, 1.0, r_wait=None) for i in range(3)]
    assert summarize(recs)["steady"]["r_wait_frac"] is None


def test_load_trace_roundtrip_and_garbage(tmp_path):
    p = tmp_path / "t.jsonl"
    recs = [rec(i, 2, 10 * i, 0.1) for i in range(5)]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    assert load_trace(p) == recs
    p.write_text(json.dumps(recs[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=":2: not JSON"):
        load_trace(p)
    p.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="must be an object"):
        load_trace(p)
    p.write_text(json.dumps({"step": 0, "batch_size": 1}) + "\n")
    with pytest.raises(ValueError, match="lacks"):
        load_trace(p)
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(ValueError, match="step_time"):
            summarize([rec(0, 1, 1, 0.1) | {"step_time": bad}])
    with pytest.raises(ValueError, match="empty"):
        summarize([])
    with pytest.raises(ValueError, match="warmup"):
        summarize(recs, warmup=-1)
