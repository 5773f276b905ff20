"""bench/bench_peers.py's bookkeeping, on made-up timelines (the runs themselves are `make bench-peers`)."""
from __future__ import annotations

import sys

import pytest

from fastdecode.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import bench_peers  # noqa: E402


def test_summary_counts_tokens_and_splits_gaps_over_the_tokens_of_an_output():
    line = bench_peers.Timeline()
    line.events = {"a": [(0.5, 1), (1.0, 1), (2.0, 2)],       # the last output carries 2 tokens
                   "b": [(0.2, 0), (1.0, 3), (4.0, 0)]}       # an empty first and final output
    s = line.summary(batch=2, seq_len=16)
    assert s["tokens"] == 7 and s["wall_s"] == 4.0 and s["tokens_per_s"] == pytest.approx(7 / 4)
    assert s["ttft_p50_s"] == pytest.approx(0.75)              # first token: 0.5 and 1.0
    assert s["itl_p50_s"] == pytest.approx(0.5)                # gaps: 0.5, then 0.5 twice
    assert s["itl_p99_s"] == pytest.approx(0.5)


def test_ratios_compare_the_same_batch_and_the_best_batches():
    def rows(*pairs):
        return {"rows": [{"seq_len": 128, "batch": b, "tokens_per_s": t} for b, t in pairs]}
    peers = {"triton": rows((1, 20), (32, 300), (128, 600)), "hf": rows((1, 10), (32, 200), (128, 400)),
             "engine": rows((128, 500)), "vllm": {"rows": rows((32, 250), (128, 450))["rows"] +
                                                  [{"seq_len": 128, "batch": 512, "error": "timeout"}]}}
    r = bench_peers.ratios(peers, 128)
    assert r["triton_over_hf_b1"] == 2.0 and r["triton_over_hf_b32"] == 1.5 and r["triton_over_hf_b128"] == 1.5
    assert r["triton_over_vllm_best"] == pytest.approx(600 / 450, abs=1e-3)
    assert r["triton_over_engine_b128"] == 1.2
    assert "triton_over_hf_b512" not in r                     # no run of both at that batch


def test_workload_leaves_each_request_its_own_new_tokens():
    class Tok:
        def __call__(self, text):
            return {"input_ids": text.split()}
    work = bench_peers.workload(Tok(), 3, 20)
    assert [t for t, _ in work] == [bench_peers.prompt_text(i) for i in range(3)]
    assert all(n == 20 - len(t.split()) for t, n in work)


def test_growth_stops_on_failure_timeout_no_gain_or_the_cap():
    row = {"batch": 1024, "seq_len": 128, "tokens_per_s": 800.0}
    prev = {"batch": 512, "seq_len": 128, "tokens_per_s": 780.0}
    assert "failed: OOM" in bench_peers.growth_stop(prev, {"batch": 1024, "error": "OOM"}, 4096)
    assert bench_peers.growth_stop(prev, {**row, "stopped": "took 999 s"}, 4096) == "took 999 s"
    assert "adds nothing" in bench_peers.growth_stop(prev, row, 4096)           # 800 < 1.05 x 780
    assert bench_peers.growth_stop({**prev, "tokens_per_s": 700.0}, row, 4096) is None
    assert "--grow-to 1024" in bench_peers.growth_stop({**prev, "tokens_per_s": 700.0}, row, 1024)


class FakePeer:
    def __init__(self, name, tps, fail_at=None, only=None):
        self.name, self.tps, self.fail_at = name, tps, fail_at
        if only is not None:
            self.runs = lambda seq_len, batch, shortest: seq_len == shortest and batch in only

    def run(self, work, seq_len):
        if len(work) == self.fail_at:
            raise MemoryError("out of memory")
        return {"batch": len(work), "seq_len": seq_len, "tokens_per_s": self.tps(len(work)), "ttft_p50_s": 0.1,
                "itl_p50_s": 0.01, "itl_p99_s": 0.02}


def test_run_plan_doubles_each_peer_past_the_plan_until_it_stops_and_says_why():
    peers = [FakePeer("flat", lambda b: min(b, 512) * 1.0),            # no gain past 512
             FakePeer("grows", lambda b: float(b)),                      # gains until the cap
             FakePeer("fails", lambda b: float(b), fail_at=1024),
             FakePeer("gated", lambda b: float(b), only={32})]           # as the openai peer
    report = {"peers": {p.name: {"rows": []} for p in peers}}
    saves = []
    plan = [(128, 32), (128, 512), (1024, 8)]
    bench_peers.run_plan(peers, report, plan, grow_to=2048, timeout_s=60, work=lambda L, b: [("x", 1)] * b,
                         save=lambda: saves.append(1))
    batches = {name: [(r["seq_len"], r["batch"]) for r in p["rows"]] for name, p in report["peers"].items()}
    assert batches["flat"] == [(128, 32), (128, 512), (128, 1024), (1024, 8)]
    assert batches["grows"] == [(128, 32), (128, 512), (128, 1024), (128, 2048), (1024, 8)]
    assert batches["fails"] == [(128, 32), (128, 512), (128, 1024), (1024, 8)]
    assert batches["gated"] == [(128, 32)]
    largest = {name: p["largest"] for name, p in report["peers"].items()}
    assert largest["flat"]["128"]["batch"] == 1024 and "adds nothing" in largest["flat"]["128"]["why"]
    assert largest["grows"]["128"]["batch"] == 2048 and "--grow-to 2048" in largest["grows"]["128"]["why"]
    assert largest["fails"]["128"]["batch"] == 512 and "MemoryError: out of memory" in largest["fails"]["128"]["why"]
    assert largest["gated"]["128"] == {"batch": 32, "why": "the last batch this peer is given (--openai-batches)"}
    assert largest["flat"]["1024"] == {"batch": 8, "why": "the last of --long-batches"}
    assert largest["gated"]["1024"]["batch"] is None
    assert len(saves) == 6                                       # after each (length, batch) and at the end


def test_run_plan_without_growth_runs_the_plan_alone():
    peer = FakePeer("grows", lambda b: float(b))
    report = {"peers": {"grows": {"rows": []}}}
    bench_peers.run_plan([peer], report, [(128, 1), (128, 8)], grow_to=0, timeout_s=60,
                         work=lambda L, b: [("x", 1)] * b, save=lambda: None)
    assert [r["batch"] for r in report["peers"]["grows"]["rows"]] == [1, 8]
    assert report["peers"]["grows"]["largest"]["128"] == {
        "batch": 8, "why": "the last of --batches; --grow-to 0 allows no doubling"}


def test_repeated_batches_keep_each_peers_median_run_and_every_runs_figure():
    calls = []

    class Drifting(FakePeer):
        def run(self, work, seq_len):
            calls.append((self.name, len(work)))
            row = super().run(work, seq_len)
            return {**row, "tokens_per_s": row["tokens_per_s"] * (1.0, 1.3, 0.8)[
                sum(1 for n, b in calls if n == self.name and b == len(work)) - 1], "ttft_p50_s": len(calls)}

    peers = [Drifting("a", lambda b: float(b)), Drifting("b", lambda b: 2.0 * b, fail_at=128)]
    report = {"peers": {p.name: {"rows": []} for p in peers}}
    bench_peers.run_plan(peers, report, [(128, 32), (128, 128), (128, 512), (1024, 8)], grow_to=0, timeout_s=60,
                         work=lambda L, b: [("x", 1)] * b, save=lambda: None, repeats=3, repeat_up_to=128)
    assert calls[:6] == [("a", 32), ("b", 32)] * 3                       # rounds of every peer in turn
    assert calls[6:] == [("a", 128), ("b", 128), ("a", 128), ("a", 128), ("a", 512), ("a", 8), ("b", 8)]
    a = {r["batch"]: r for r in report["peers"]["a"]["rows"]}
    assert a[32]["tokens_per_s"] == 32.0 and a[32]["repeats_tokens_per_s"] == [32.0, 41.6, 25.6]
    assert a[32]["ttft_p50_s"] == 1                                      # the median run's own row
    assert "repeats_tokens_per_s" not in a[512] and "repeats_tokens_per_s" not in a[8]
    b = report["peers"]["b"]["rows"]
    assert [r["batch"] for r in b] == [32, 128, 8] and "MemoryError" in b[1]["error"]  # no repeat after a failure
    assert bench_peers.ratios(report["peers"], 128) == {}                 # no triton/hf in this report


def test_median_run_of_an_even_count_is_the_lower_middle():
    runs = [{"tokens_per_s": t} for t in (4.0, 1.0, 3.0, 2.0)]
    assert bench_peers.median_run(runs) == {"tokens_per_s": 2.0, "repeats_tokens_per_s": [4.0, 1.0, 3.0, 2.0]}
    assert bench_peers.median_run(runs[:1]) == {"tokens_per_s": 4.0}


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--repeats", "x"], ["--repeat-up-to", "-1"],
                                  ["--grow-to", "-1"], ["--grow-to", "many"], ["--batches", "1,x"],
                                  ["--batches", "0,8"], ["--seq-lens", ""], ["--long-batches", "-8"],
                                  ["--openai-batches", "32,big"], ["--openai-batches", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(args, capsys):
    with pytest.raises(SystemExit) as e:
        bench_peers.main(args + ["--out", "/nonexistent/never-written.json"])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
