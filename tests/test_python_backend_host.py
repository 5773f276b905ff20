"""python_backend's EngineHost with a fake engine and a fake transport (test_python_backend.py's):
one final response per request, errors, overload, cancellation, failed sends, engine crashes, shutdown."""
from __future__ import annotations

import threading
import time

import pytest

from python_backend.errors import CANCELLED, INVALID_ARG, UNAVAILABLE
from python_backend.host import EngineHost, install_step_fault

from test_python_backend import FakeEngine, FakeTransport, InvalidRequestError, inputs, make_params, text_of


@pytest.fixture
def host():
    engine, transport = FakeEngine(), FakeTransport()
    h = EngineHost(engine, transport, make_params=make_params, cancel_poll_s=0.01, metrics_interval_s=0.01,
                   crash_grace_s=0.05)
    engine.start()
    yield h, engine, transport
    h.shutdown()


# ---- the host

def test_streaming_request_ends_with_one_final(host):
    h, engine, t = host
    rid = h.submit("s1", inputs(text_input="hi", stream=True, return_num_output_tokens=True),
                   '{"max_tokens": 100}')
    assert rid is not None
    responses = t.wait_final("s1")
    assert [f for _, _, f in responses] == [False] * (len(responses) - 1) + [True]
    assert text_of(responses) == "héllo"
    assert sum(int(o["num_output_tokens"][0]) for o, _, _ in responses) == 6   # é took two tokens
    assert all(o["text_output"][0] for o, _, _ in responses[:-1])             # no empty deltas mid-stream
    assert h.live_count() == 0


def test_non_streaming_request_gets_exactly_one_response(host):
    h, _, t = host
    h.submit("s1", inputs(text_input="say: "), None)
    responses = t.wait_final("s1")
    assert len(responses) == 1 and text_of(responses) == "say: héllo"
    h.submit("s2", inputs(text_input="x", sampling_parameters='{"max_tokens": 2}', return_finish_reason=True))
    (outputs, error, final), = t.wait_final("s2")
    assert outputs["text_output"][0].decode() == "xhé" and outputs["finish_reason"][0] == b"length"


@pytest.mark.parametrize("tensors, params, code, message", [
    (dict(), None, INVALID_ARG, "text_input"),
    (dict(text_input=b"\xff"), None, INVALID_ARG, "UTF-8"),
    (dict(text_input="x", sampling_parameters="{"), None, INVALID_ARG, "JSON"),
    (dict(text_input="x", sampling_parameters='{"max_tokens": 0}'), None, INVALID_ARG, "max_tokens"),
    (dict(text_input="x", sampling_parameters='{"max_tokens": 10000000000}'), None, INVALID_ARG, "max_tokens"),
    (dict(text_input="x", sampling_parameters='{"max_tokens": "7"}'), None, INVALID_ARG, "max_tokens"),
    (dict(text_input="x", sampling_parameters='{"beams": 2}'), None, INVALID_ARG, "beams"),
    (dict(text_input="too long"), None, INVALID_ARG, "max_model_len"),
])
def test_bad_requests_get_one_final_error_and_host_keeps_serving(host, tensors, params, code, message):
    h, engine, t = host
    assert h.submit("bad", inputs(**tensors), params) is None
    (outputs, error, final), = t.sent["bad"]
    assert final and outputs is None and error.code == code and message in error.message
    h.submit("good", inputs(text_input="x"))
    assert text_of(t.wait_final("good")) == "xhéllo"


def test_overloaded_engine_is_unavailable(host):
    h, engine, t = host
    engine.max_waiting = 0
    h.submit("s", inputs(text_input="x"))
    (_, error, final), = t.sent["s"]
    assert final and error.code == UNAVAILABLE and h.live_count() == 0


def test_cancelled_stream_is_aborted_in_the_engine(host):
    h, engine, t = host
    engine.reply = "x" * 100000
    rid = h.submit("s", inputs(text_input="x", stream=True), '{"max_tokens": 1000}')
    deadline = time.monotonic() + 5
    while len(t.sent.get("s", [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    t.cancelled.add("s")
    responses = t.wait_final("s")
    assert rid in engine.aborted and rid not in engine.requests
    assert responses[-1][1].code == CANCELLED and h.live_count() == 0
    assert len(responses) < 1000


def test_failed_send_aborts_the_request(host):
    h, engine, t = host
    engine.reply = "y" * 100000
    t.broken.add("s")
    rid = h.submit("s", inputs(text_input="x", stream=True), '{"max_tokens": 1000}')
    deadline = time.monotonic() + 5
    while rid not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rid in engine.aborted and rid not in engine.requests


def test_engine_crash_fails_requests_refuses_new_ones_and_unloads(host, tmp_path):
    h, engine, t = host
    flag = tmp_path / "crash"
    install_step_fault(engine, str(flag))
    engine.reply = "z" * 100000
    h.submit("s", inputs(text_input="x", stream=True), '{"max_tokens": 1000}')
    flag.write_text("")
    (_, error, final) = t.wait_final("s")[-1]
    assert final and error.code == UNAVAILABLE and "injected engine fault" in error.message
    deadline = time.monotonic() + 5
    while not t.unloaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.unloaded == 1 and not h.healthy
    h.submit("after", inputs(text_input="x"))
    (_, error, final), = t.sent["after"]
    assert final and error.code == UNAVAILABLE and "crashed" in error.message


def test_shutdown_ends_live_requests(host):
    h, engine, t = host
    engine.reply = "w" * 100000
    h.submit("s", inputs(text_input="x", stream=True), '{"max_tokens": 1000}')
    h.shutdown()
    assert t.sent["s"][-1][2] and t.sent["s"][-1][1].code == UNAVAILABLE


def test_cancellation_polling_is_bounded_and_round_robin():
    engine, t = FakeEngine(reply="q" * 100000, step_s=0.01), FakeTransport()
    asked = []
    real = t.is_cancelled
    t.is_cancelled = lambda sender: asked.append(sender) or real(sender)
    t0 = time.monotonic()
    h = EngineHost(engine, t, make_params=make_params, cancel_poll_s=0.01, cancel_poll_batch=3)
    engine.start()
    try:
        for i in range(7):
            h.submit(i, inputs(text_input="x", stream=True), '{"max_tokens": 1000}')
        deadline = time.monotonic() + 30
        while min(asked.count(i) for i in range(7)) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen, elapsed = list(asked), time.monotonic() - t0
        counts = [seen.count(i) for i in range(7)]
        assert set(seen) == set(range(7)) and min(counts) >= 5   # everyone gets asked ...
        assert max(counts) - min(counts) <= 2                      # ... about equally often
        assert len(seen) <= 3 * (elapsed / 0.01 + 5)               # ... and at most 3 per tick
        t.cancelled.add(5)
        t.wait_final(5)
        assert t.sent[5][-1][1].code == CANCELLED
    finally:
        h.shutdown()


def test_a_request_refused_by_the_engine_is_never_asked_about_after_its_final():
    """Triton frees a request's response factory with its final response: asking whether it was
    cancelled after that reads freed memory (tritonserver segfaulted so in a soak). The poller
    asks while the engine refuses the request on execute()'s thread, the refusal's final goes
    out, then the poller's question reaches 'Triton'."""
    asked, finalized, after_final = threading.Event(), threading.Event(), []

    class SlowRefusal(FakeEngine):
        def add_request(self, prompt, params, request_id=None, on_output=None):
            if prompt == "refuse me":
                asked.wait(0.3)           # the poller's turn, when it would ask about this request
                raise InvalidRequestError("refused")
            return super().add_request(prompt, params, request_id, on_output)

    class Transport(FakeTransport):
        def send(self, sender, outputs, error, final):
            super().send(sender, outputs, error, final)
            if final and sender == "r":
                finalized.set()

        def is_cancelled(self, sender):
            if sender == "r":
                asked.set()
                finalized.wait(0.3)       # the IPC round trip, while execute() answers the refusal
                if "r" in self.sent:
                    after_final.append(sender)
            return super().is_cancelled(sender)

    engine, t = SlowRefusal(), Transport()
    h = EngineHost(engine, t, make_params=make_params, cancel_poll_s=0.001)
    engine.start()
    try:
        assert h.submit("r", inputs(text_input="refuse me"), None) is None
        (_, error, final), = t.wait_final("r")
        assert final and error.code == INVALID_ARG and "refused" in error.message
        h.submit("ok", inputs(text_input="x"), None)
        t.wait_final("ok")                # the poller has run many ticks since
        assert after_final == []
    finally:
        h.shutdown()
