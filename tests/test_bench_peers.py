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
