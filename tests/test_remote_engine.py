"""The engine with the remote backend bit-for-bit equal to the in-process local backend
(same tokens) under continuous batching (fewer slots than requests), with one
mini-batch and with head sharding. The layouts 1/2/3 workers against transformers
are in test_remote_engine_exact.py."""
from __future__ import annotations

import time

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, SamplingParams
from fastdecode.ops.testing import local_fleet

PROMPTS = ["The quick brown fox", "Hello", "FastDecode splits the model into an S-Part",
           "def f(x):\n    return", "numbers 0123", "¿Qué tal?", "a", "jumps over the lazy dog. " * 3]


def generate(config: EngineConfig, prompts=PROMPTS, max_tokens: int = 10) -> dict[str, list[int]]:
    engine = Engine(config)
    try:
        params = SamplingParams.from_dict({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
        ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        assert reasons == {i: "length" for i in ids}, reasons
        return tokens
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with local_fleet(3, tmp_path_factory.mktemp("fleet"), kv_capacity="16M") as f:
        yield f


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    # max_running below the number of prompts: sequences join and leave mid-run.
    return generate(EngineConfig(model=tiny_model_dir, attention="local", max_running=5, kernel_threads=1))


@pytest.mark.parametrize("workers,shards,minibatches", [(3, 1, 1), (2, 2, 2)],
                         ids=["3w-one-minibatch", "2w-head-shards"])
def test_remote_is_token_exact_with_local(fleet, tiny_model_dir, expected, workers, shards, minibatches):
    config = EngineConfig(model=tiny_model_dir, attention="remote", rworkers=fleet.addresses[:workers],
                          head_shards=shards, num_minibatches=minibatches, max_running=5)
    assert generate(config) == expected


def test_admission_waits_for_room_on_the_rworkers(tmp_path, tiny_model_dir, expected):
    """R-workers at their --max-sequences refuse new sequences: the engine admits what fits and
    the rest wait (no error, no dead engine, nothing left open), also while another client
    holds every slot and this engine runs nothing."""
    import grpc

    from fastdecode.attention.remote.backend import RemoteAttention
    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    def on_workers(addresses):
        out = []
        for a in addresses:
            with grpc.insecure_channel(a) as ch:
                out.append(pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5).sequences)
        return out

    def settles_at(addresses, want) -> bool:     # closes travel on the stream, unanswered
        deadline = time.monotonic() + 5
        while on_workers(addresses) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return on_workers(addresses) == want

    with local_fleet(2, tmp_path, kv_capacity="16M", extra_args=("--max-sequences", "2")) as f:
        config = EngineConfig(model=tiny_model_dir, attention="remote", rworkers=f.addresses, max_running=5)
        engine = Engine(config)
        tenant = RemoteAttention(engine.spec, config)      # another S-worker on the same R-workers
        try:
            tenant.open([1, 2, 3, 4])                       # every slot
            params = SamplingParams.from_dict({"max_tokens": 10, "temperature": 0.0, "ignore_eos": True})
            ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(PROMPTS)]
            for _ in range(3):
                assert engine.step() == []                  # refused: they wait
            assert engine.healthy and engine.stats()["waiting"] == len(PROMPTS)
            assert settles_at(f.addresses, [2, 2])          # nothing of the refused opens is left
            tenant.close([1, 2, 3, 4])
            tokens: dict[str, list[int]] = {i: [] for i in ids}
            reasons: dict[str, str] = {}
            most = 0
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id] += out.token_ids
                    if out.finished:
                        reasons[out.request_id] = out.finish_reason
                most = max(most, engine.stats()["running"])
                assert sum(on_workers(f.addresses)) <= 4
            assert reasons == {i: "length" for i in ids}, reasons
            assert tokens == expected
            assert most == 4                                # 2 per worker: all there is
            assert engine.healthy and engine.stats()["kv"]["sequences"] == 0
            assert settles_at(f.addresses, [0, 0])
        finally:
            tenant.shutdown()
            engine.stop()


def test_a_failing_open_ends_those_requests_not_the_engine(fleet, tiny_model_dir, expected, monkeypatch):
    """An unexpected error from the backend's open (a bug, say) ends the requests it was
    opening, with the error; the engine stays healthy and serves the next ones."""
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="remote", rworkers=fleet.addresses[:2],
                                 max_running=5))
    try:
        real_open = engine.backend.open
        calls = []

        def open_once_broken(ids):
            calls.append(list(ids))
            if len(calls) == 1:
                real_open(ids[:1])            # half done, then fails: the engine must close it
                raise ValueError("sequence(s) already open: [1]")
            return real_open(ids)

        monkeypatch.setattr(engine.backend, "open", open_once_broken)
        params = SamplingParams.from_dict({"max_tokens": 10, "temperature": 0.0, "ignore_eos": True})
        engine.add_request(PROMPTS[0], params, request_id="bad")
        outs = engine.step()
        assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]
        assert "ValueError" in outs[0].error and engine.healthy
        assert engine.stats()["kv"]["sequences"] == 0
        rid = engine.add_request(PROMPTS[1], params, request_id="1")
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
        assert engine.healthy and tokens == expected[rid]
    finally:
        engine.stop()
