"""bench/soak.py (`make soak`) for about 40 s on a tiny model, and its verdict on made-up figures.

The short run is the same deployment (`fastdecode.ops.serve start --rworkers 2`), the same mix of
traffic and the same measurements as the 10-minute soak; RSS growth over 40 s is noise and is not
asserted here.
"""
from __future__ import annotations

import sys

import pytest

from fastdecode.config import REPO_ROOT
from fastdecode.ops.triton import tritonserver_binary

sys.path.insert(0, str(REPO_ROOT / "bench"))
import soak  # noqa: E402

FD_MARGIN, THREAD_MARGIN = 8, 4


@pytest.mark.triton
@pytest.mark.skipif(not tritonserver_binary().exists(), reason=f"tritonserver binary missing ({tritonserver_binary()})")
def test_short_soak_loses_no_request_and_frees_all_kv(tiny_model_dir, tmp_path):
    cfg = soak.SoakConfig(model=tiny_model_dir, seconds=40, warmup=10, concurrency=12, kv_capacity="64M",
                          deadline_s=120, sample_interval_s=5, max_tokens=32)
    r = soak.run_soak(cfg, tmp_path / "run", log=print)

    assert r["lost_requests"] == 0, r["errors_by_kind"]
    assert r["kv_bytes_idle"] == 0, r["rworker_kv_idle"]
    assert all(s["sequences"] == 0 for s in r["rworker_kv_idle"].values())
    assert r["unexpected_by_kind"] == {}, r["unexpected_by_kind"]
    assert r["final_check"]["status"] == "ok"
    # every kind of traffic ran; the bad requests all got their error, the cancelled ones were cancelled
    counts = r["requests_by_kind"]
    assert set(counts) == set(soak.KINDS), counts
    assert counts["bad"]["error"] == counts["bad"]["sent"] > 0
    assert counts["cancel"].get("cancelled", 0) > 0
    assert counts["stream"]["ok"] == counts["stream"]["sent"] > 0
    # four processes measured, alive from start to end, no fd or thread creeping past a margin
    assert set(r["processes"]) == {"tritonserver", "python_backend_stub", "rworker-0", "rworker-1"}
    assert all(p["alive"] and len(p["samples_t_rss_fds_threads_anon_shmem"]) >= 2 for p in r["processes"].values())
    assert r["fd_growth"] <= FD_MARGIN, {n: p["fd_growth"] for n, p in r["processes"].items()}
    assert r["thread_growth"] <= THREAD_MARGIN, {n: p["thread_growth"] for n, p in r["processes"].items()}
    assert r["failures"] == [] or r["failures"] == [f for f in r["failures"] if f.startswith("RSS growth")]


class FakeDeployment:
    pids = {"tritonserver": 1, "rworker-0": 2}
    grpc_url = http_url = "127.0.0.1:1"
    rworker_addresses = ["127.0.0.1:2"]

    def __init__(self, run_dir):
        self.run_dir = run_dir


def proc(rss, fds=10, threads=5):
    return {"alive": True, "rss": rss, "fds": fds, "threads": threads}


def verdict(tmp_path, results, end_rss=100, kv_bytes=0, check="ok", end_alive=True):
    baseline = {"tritonserver": proc(100), "rworker-0": proc(100)}
    end = {"tritonserver": proc(end_rss, fds=13) if end_alive else {"alive": False}, "rworker-0": proc(100)}
    kv = {"127.0.0.1:2": {"bytes_used": kv_bytes, "sequences": 1 if kv_bytes else 0}}
    return soak.summarize(soak.SoakConfig(), FakeDeployment(tmp_path), results, baseline, end, [(1.0, baseline)],
                          kv, kv, soak.Outcome(check, "length"), 0, 10.0)


def ok(kind="stream"):
    return soak.Result(kind, "c", soak.Outcome("ok", "length", 4), True, 1.0)


def test_verdict_passes_a_clean_run(tmp_path):
    r = verdict(tmp_path, [ok(), ok("bad")], end_rss=109)
    assert r["passed"] and r["failures"] == []
    assert (r["lost_requests"], r["kv_bytes_idle"], r["rss_growth_fraction"], r["fd_growth"]) == (0, 0, 0.09, 3)
    assert r["requests_by_kind"]["stream"] == {"sent": 1, "ok": 1}


@pytest.mark.parametrize("case, kwargs, results, says", [
    ("lost", {}, [soak.Result("stream", "c", soak.Outcome("lost", "no final"), False, 300.0)], "lost"),
    ("KV held", {"kv_bytes": 4096}, [ok()], "hold KV"),
    ("RSS +11 %", {"end_rss": 111}, [ok()], "RSS growth"),
    ("bad request accepted", {}, [soak.Result("bad", "empty prompt", soak.Outcome("ok", "length"), False, 1.0)],
     "does not allow"),
    ("server gone at the end", {"check": "unreachable"}, [ok()], "after the load failed"),
    ("process died", {"end_alive": False}, [ok()], "died"),
    ("no traffic", {}, [], "no request"),
])
def test_verdict_fails_the_run(tmp_path, case, kwargs, results, says):
    r = verdict(tmp_path, results, **kwargs)
    assert not r["passed"]
    assert any(says in f for f in r["failures"]), (case, r["failures"])
