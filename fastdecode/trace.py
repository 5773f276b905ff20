"""Per-step engine traces (engine.trace, JSON lines at config.trace_path) -> numbers.

A record: step, time, batch_size, num_prefill, context_tokens, s_time, r_time,
s_wait, r_wait (None when not measurable), step_time; times in seconds.

    records = load_trace("run/trace.jsonl")
    summary = summarize(records, warmup=200)     # steady state: after the first 200 steps

A live engine's trace (engine.trace, its newest records) feeds metrics through TraceCursor
(each record once) and step_totals (sums and step-time statistics of those records).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Iterable, Sequence

FIELDS = ("step", "time", "batch_size", "num_prefill", "context_tokens", "s_time", "r_time", "s_wait",
          "r_wait", "step_time")


def load_trace(path: str | Path) -> list[dict]:
    """Read a JSON-lines trace; a malformed line is a ValueError naming it."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            records.append(_check(rec, f"{path}:{n}"))
    return records


def _check(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a trace record must be an object, got {type(rec).__name__}")
    missing = [k for k in ("step", "batch_size", "context_tokens", "step_time") if k not in rec]
    if missing:
        raise ValueError(f"{where}: trace record lacks {missing}")
    for k in ("batch_size", "context_tokens", "step_time"):
        v = rec[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: {k} must be a finite number >= 0, got {v!r}")
    return rec


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: Iterable[dict], warmup: int = 0, cooldown: int = 0, decode_only: bool = False) -> dict:
    """Whole-run and steady-state numbers of a trace.

    warmup / cooldown: steps left out of the steady state at the start (ramp-up)
    and the end (drain). decode_only: leave steps with prefill out of the steady
    state too. Throughput counts one token per sequence in a step's batch."""
    recs = [_check(r, f"record {i}") for i, r in enumerate(records)]
    if not recs:
        raise ValueError("empty trace")
    if warmup < 0 or cooldown < 0:
        raise ValueError("warmup and cooldown must be >= 0")
    busy = [r for r in recs if r["batch_size"] > 0]
    total_time = sum(r["step_time"] for r in recs)
    tokens = sum(r["batch_size"] for r in recs)
    steady = recs[warmup: len(recs) - cooldown]
    if decode_only:
        steady = [r for r in steady if not r.get("num_prefill")]
    out = {
        "steps": len(recs), "tokens": tokens, "busy_time_s": total_time,
        "throughput_tok_s": tokens / total_time if total_time else 0.0,
        "wall_time_s": (recs[-1]["time"] + recs[-1]["step_time"] - recs[0]["time"])
        if all("time" in r for r in (recs[0], recs[-1])) else None,
        "max_step_time_s": max(r["step_time"] for r in recs),
        "max_context_tokens": max(r["context_tokens"] for r in recs),
        "max_batch_size": max(r["batch_size"] for r in recs),
        "mean_batch_size": statistics.fmean(r["batch_size"] for r in busy) if busy else 0.0,
    }
    if out["wall_time_s"]:
        out["wall_throughput_tok_s"] = tokens / out["wall_time_s"]
    if steady:
        st = [r["step_time"] for r in steady]
        t = sum(st)
        out["steady"] = {
            "steps": len(steady), "warmup": warmup, "cooldown": cooldown,
            "max_step_time_s": max(st), "p99_step_time_s": _quantile(st, 0.99),
            "p50_step_time_s": statistics.median(st), "mean_step_time_s": statistics.fmean(st),
            "throughput_tok_s": sum(r["batch_size"] for r in steady) / t if t else 0.0,
            "mean_batch_size": statistics.fmean(r["batch_size"] for r in steady),
            "max_context_tokens": max(r["context_tokens"] for r in steady),
            "mean_context_tokens": statistics.fmean(r["context_tokens"] for r in steady),
            **utilisation(steady),
        }
    return out


def utilisation(records: Sequence[dict]) -> dict:
    """Fractions of step time: S-Part busy, R-Part busy, S waiting on R, R idle waiting on S."""
    total = sum(r["step_time"] for r in records)
    if not total:
        return {}
    def frac(key: str) -> float | None:
        vals = [r.get(key) for r in records]
        if any(v is None for v in vals):
            return None
        return sum(vals) / total
    return {"s_util": frac("s_time"), "r_util": frac("r_time"), "s_wait_frac": frac("s_wait"),
            "r_wait_frac": frac("r_wait")}


# ---- live traces (python_backend/metrics.py)

PARTS = ("s_time", "r_time", "s_wait", "r_wait")


class TraceCursor:
    """Hands out each record of a live trace once. `records` is what engine.trace returns: its
    newest records, oldest first, numbered by "step". A trace whose newest step is older than
    the last one handed out is a new trace (a new engine) and is read from its start."""

    def __init__(self) -> None:
        self.last_step = -1

    def take(self, records: Sequence[dict]) -> list[dict]:
        if records and records[-1]["step"] < self.last_step:
            self.last_step = -1
        new = []
        for rec in reversed(records):
            if rec["step"] <= self.last_step:
                break
            new.append(rec)
        new.reverse()
        if new:
            self.last_step = new[-1]["step"]
        return new


def step_totals(records: Sequence[dict]) -> dict:
    """For metrics: "steps"; "step_time" and each of PARTS summed (a part that is None in a
    record, not measurable in that step, adds nothing); "step_time_mean", "_p50", "_p99",
    "_max"; and the newest record's "batch_size" and "context_tokens". Empty records: {}."""
    if not records:
        return {}
    times = [r["step_time"] for r in records]
    out = {"steps": len(records), "step_time": sum(times),
           **{k: sum(r.get(k) or 0.0 for r in records) for k in PARTS},
           "step_time_mean": statistics.fmean(times), "step_time_p50": _quantile(times, 0.5),
           "step_time_p99": _quantile(times, 0.99), "step_time_max": max(times),
           "batch_size": records[-1]["batch_size"], "context_tokens": records[-1]["context_tokens"]}
    return out
