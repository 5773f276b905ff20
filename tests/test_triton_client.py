"""fastdecode.ops.client.generate cancels a stream only while its request still runs (no server needed).

Cancelling the gRPC stream of a request that has already ended races Triton 2.51's gRPC
frontend: the request is then never freed and its model never unloads (see client.generate).
"""
from __future__ import annotations

import numpy as np
import pytest

from fastdecode.ops import client

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")


class FakeResult:
    def __init__(self, text: str | None, final: bool):
        self.text, self.final = text, final

    def as_numpy(self, name):
        if name == "text_output" and self.text is not None:
            return np.array([self.text.encode()], dtype=np.object_)
        return None

    def get_response(self):
        final = self.final

        class Param:
            bool_param = final

        class Response:
            parameters = {"triton_final_response": Param()}
        return Response()


class FakeClient:
    """Stands in for tritonclient.grpc.InferenceServerClient: replays `script` as stream callbacks."""
    script: list = []
    made: list = []

    def __init__(self, url):
        self.stop_calls = []
        self.closed = False
        FakeClient.made.append(self)

    def start_stream(self, callback):
        self.callback = callback

    def async_stream_infer(self, model, inputs, enable_empty_final_response=False):
        for result, error in self.script:
            self.callback(result=result, error=error)

    def stop_stream(self, cancel_requests=False):
        self.stop_calls.append(cancel_requests)

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(tritonclient_grpc, "InferenceServerClient", FakeClient)
    FakeClient.made = []
    return FakeClient


def run(fake, script, take=None, timeout=5.0):
    fake.script = script
    gen = client.generate("hi", url="fake:1", timeout=timeout)
    out = []
    try:
        for r in gen:
            out.append(r)
            if take is not None and len(out) == take:
                break
    finally:
        gen.close()
    (made,) = fake.made
    assert made.closed
    return out, made.stop_calls


def test_finished_stream_is_closed_without_cancelling(fake):
    out, stops = run(fake, [(FakeResult("a", False), None), (FakeResult("b", False), None),
                            (FakeResult(None, True), None)])
    assert [r["text_output"] for r in out] == ["a", "b"]
    assert stops == [False]


def test_final_response_with_output_is_not_cancelled_even_if_caller_stops_there(fake):
    out, stops = run(fake, [(FakeResult("a", False), None), (FakeResult("b", True), None)], take=2)
    assert len(out) == 2 and stops == [False]


def test_error_ends_the_request_so_no_cancel(fake):
    with pytest.raises(client.GenerationError, match="bad max_tokens"):
        run(fake, [(None, RuntimeError("bad max_tokens"))])
    assert fake.made[0].stop_calls == [False]


def test_caller_stopping_early_cancels_the_running_request(fake):
    out, stops = run(fake, [(FakeResult("a", False), None), (FakeResult("b", False), None)], take=1)
    assert len(out) == 1 and stops == [True]


def test_timeout_cancels_the_running_request(fake):
    with pytest.raises(client.GenerationError, match="no response"):
        run(fake, [(FakeResult("a", False), None)], timeout=0.05)
    assert fake.made[0].stop_calls == [True]
