"""R-worker faults mid-generation, with real processes: kill -9, SIGSTOP (stall), all workers gone.

Lost sequences are rebuilt on the survivors (the engine re-prefills their tokens) and
greedy outputs stay identical to a fault-free run; with no worker left requests end
with a clear error, and nothing hangs.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, SamplingParams
from fastdecode.ops.testing import local_fleet

PROMPTS = ["The quick brown fox", "Hello", "FastDecode splits the model", "def f(x):", "numbers 0123",
           "¿Qué tal?"]
MAX_TOKENS = 14


class Run:
    """Drives an engine step by step; `on_step(n)` may inject a fault after step n."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[str, str | None]] = {}

    def add(self, prompts, tag: str = "") -> list[str]:
        params = SamplingParams.from_dict({"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True})
        ids = [self.engine.add_request(p, params, request_id=f"{tag}{i}") for i, p in enumerate(prompts)]
        self.tokens.update({i: [] for i in ids})
        return ids

    def run(self, on_step=lambda n: None, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        n = 0
        while self.engine.has_unfinished():
            assert time.monotonic() < deadline, "generation did not finish in time"
            for out in self.engine.step():
                self.tokens[out.request_id] += out.token_ids
                if out.finished:
                    self.finished[out.request_id] = (out.finish_reason, out.error)
            n += 1
            on_step(n)

    def close(self) -> None:
        self.engine.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    run = Run(EngineConfig(model=tiny_model_dir, attention="local", kernel_threads=1))
    try:
        run.add(PROMPTS)
        run.run()
        return run.tokens
    finally:
        run.close()


def remote_config(tiny_model_dir, fleet, **kw) -> EngineConfig:
    return EngineConfig(model=tiny_model_dir, attention="remote", rworkers=fleet.addresses, **kw)


def worker_kv(address: str) -> tuple[int, int]:
    """(sequences, kv_tokens) that one R-worker holds, from its Stats."""
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        st = pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)
    return st.sequences, st.kv_tokens


def settles(address: str, want: tuple[int, int], timeout: float = 5.0) -> bool:
    """Closes travel on the stream without a reply: poll until the worker's Stats show `want`."""
    deadline = time.monotonic() + timeout
    while worker_kv(address) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return worker_kv(address) == want


def test_kill_one_of_two_mid_generation(tiny_model_dir, expected, tmp_path):
    with local_fleet(2, tmp_path) as fleet:
        run = Run(remote_config(tiny_model_dir, fleet))
        try:
            run.add(PROMPTS)

            survivor = fleet.addresses[1]
            checked = []

            def fault(n):
                if n == 4:
                    workers = run.engine.backend.stats()["workers"]
                    assert all(w["sequences"] > 0 for w in workers)   # both held some sequences
                    fleet.kill(0)
                elif n > 4 and run.engine.has_unfinished():
                    # Rebuilt: the survivor holds every running sequence, with each one's KV (its
                    # tokens but the last sampled one, which the next step feeds) and no more.
                    running = list(run.engine.requests.running)
                    want = (len(running), sum(s.num_tokens - 1 for s in running))
                    assert settles(survivor, want), (worker_kv(survivor), want)
                    assert run.engine.backend.stats()["kv_tokens"] == want[1]
                    checked.append(n)
            run.run(fault)
            assert run.finished == {str(i): ("length", None) for i in range(len(PROMPTS))}
            assert run.tokens == expected
            st = run.engine.backend.stats()
            assert st["lost_sequences"] > 0 and not st["workers"][0]["up"]
            assert checked and settles(survivor, (0, 0))                # nothing leaked on the survivor

            # The worker returns on its address: it is reconnected and takes new sequences.
            fleet.restart(0)
            deadline = time.monotonic() + 15
            while not run.engine.backend.stats()["workers"][0]["up"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert run.engine.backend.stats()["workers"][0]["up"]
            seen = []
            run.add(PROMPTS, tag="again-")
            run.run(lambda n: seen.append(run.engine.backend.stats()["workers"][0]["sequences"]))
            assert max(seen) > 0
            assert {k[len("again-"):]: v for k, v in run.tokens.items() if k.startswith("again-")} == expected
        finally:
            run.close()


def test_kill_both_ends_requests_with_clear_error(tiny_model_dir, tmp_path):
    with local_fleet(2, tmp_path) as fleet:
        run = Run(remote_config(tiny_model_dir, fleet, rworker_timeout_s=2.0))
        try:
            ids = run.add(PROMPTS)

            def fault(n):
                if n == 3:
                    fleet.kill(0)
                    fleet.kill(1)
            t0 = time.monotonic()
            done = threading.Event()
            errors = []

            def target():
                try:
                    run.run(fault, timeout=60)
                except Exception as e:          # noqa: BLE001 -- reported below
                    errors.append(e)
                done.set()
            threading.Thread(target=target, daemon=True).start()
            assert done.wait(90), "the engine hung with every R-worker gone"
            assert not errors, errors
            assert set(run.finished) == set(ids)
            for reason, error in run.finished.values():
                assert reason == "error"
                assert "R-worker" in error, error
            assert time.monotonic() - t0 < 60
        finally:
            run.close()


def test_new_requests_with_no_worker_left_fail_clearly(tiny_model_dir, tmp_path):
    with local_fleet(1, tmp_path) as fleet:
        run = Run(remote_config(tiny_model_dir, fleet, rworker_timeout_s=2.0))
        try:
            fleet.kill(0)
            ids = run.add(PROMPTS[:2])
            run.run(timeout=30)
            assert run.engine.healthy
            for i in ids:
                reason, error = run.finished[i]
                assert reason == "error" and "no R-worker available" in error, (reason, error)
        finally:
            run.close()


def test_stalled_worker_is_detected_by_deadline(tiny_model_dir, expected, tmp_path):
    with local_fleet(2, tmp_path) as fleet:
        run = Run(remote_config(tiny_model_dir, fleet, rworker_timeout_s=1.0))
        try:
            run.add(PROMPTS)
            stopped_at = []

            def fault(n):
                if n == 4:
                    fleet.kill(1, signal.SIGSTOP)
                    stopped_at.append(time.monotonic())
            run.run(fault, timeout=60)
            assert time.monotonic() - stopped_at[0] < 30
            assert run.finished == {str(i): ("length", None) for i in range(len(PROMPTS))}
            assert run.tokens == expected
            st = run.engine.backend.stats()["workers"][1]
            assert not st["up"] and "rworker_timeout_s" in st["reason"]
            # SIGCONT: it answers health checks again and is used for new sequences.
            fleet.kill(1, signal.SIGCONT)
            deadline = time.monotonic() + 15
            while not run.engine.backend.stats()["workers"][1]["up"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert run.engine.backend.stats()["workers"][1]["up"]
        finally:
            run.close()
