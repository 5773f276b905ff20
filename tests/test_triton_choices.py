"""`n` in sampling_parameters: n choices of one prompt through the Triton host, every output
tensor one element per choice, one final response, seeds seed, seed+1, ..."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine
from python_backend.errors import CANCELLED
from python_backend.host import EngineHost
from python_backend.request import MAX_CHOICES, BadRequest, parse_request
from tests.test_python_backend import FakeTransport, inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def served(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch"))
    transport = FakeTransport()
    host = EngineHost(engine, transport, cancel_poll_s=0.01, metrics_interval_s=0.05)
    engine.start()
    yield host, engine, transport
    host.shutdown()


def ask(host, transport, sender, sampling: dict, stream: bool) -> list:
    host.submit(sender, inputs(text_input="Once upon a time", stream=stream, return_finish_reason=True,
                               exclude_input_in_output=True, sampling_parameters=json.dumps(sampling)))
    return transport.wait_final(sender, timeout=120)


def texts(responses, n: int) -> list[str]:
    out = [""] * n
    for outputs, error, _ in responses:
        assert error is None, error
        if outputs is not None:
            assert len(outputs["text_output"]) == n and len(outputs["finish_reason"]) == n
            for i, t in enumerate(outputs["text_output"]):
                out[i] += t.decode()
    return out


def test_n_choices_non_streamed_in_one_response(served):
    host, _, t = served
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    one = texts(ask(host, t, "one", greedy, stream=False), 1)
    responses = ask(host, t, "three", {**greedy, "n": 3}, stream=False)
    assert len(responses) == 1 and responses[0][2]
    assert texts(responses, 3) == one * 3
    assert [r.decode() for r in responses[0][0]["finish_reason"]] == ["length"] * 3


def test_n_choices_streamed_are_seeded_seed_plus_i(served):
    host, _, t = served
    sampling = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 7}
    responses = ask(host, t, "n", {**sampling, "n": 3}, stream=True)
    assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
    choices = texts(responses, 3)
    for i in range(3):
        alone = texts(ask(host, t, f"alone{i}", {**sampling, "seed": 7 + i}, stream=True), 1)
        assert choices[i] == alone[0]
    assert len(set(choices)) > 1


def test_cancelling_a_request_ends_all_its_choices(served):
    host, engine, t = served
    t.cancelled.add("c")
    responses = ask(host, t, "c", {"max_tokens": 100, "ignore_eos": True, "n": 4}, stream=True)
    finals = [(e, f) for _, e, f in responses if f]
    assert len(finals) == 1 and finals[0][0].code == CANCELLED
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished() and host.live_count() == 0


@pytest.mark.parametrize("n", [0, -1, MAX_CHOICES + 1, 1.5, "2", True, None, [2]])
def test_garbage_n_is_refused(n):
    with pytest.raises(BadRequest, match="'n' must be an integer"):
        parse_request(inputs(text_input="hi", sampling_parameters=json.dumps({"n": n})))


def test_garbage_n_gets_a_final_error_and_the_host_keeps_serving(served):
    host, _, t = served
    responses = ask(host, t, "bad", {"n": 0}, stream=True)
    assert len(responses) == 1 and responses[0][1] is not None and "'n'" in responses[0][1].message
    assert texts(ask(host, t, "good", {"max_tokens": 3, "n": 2}, stream=False), 2)
    assert np.all([len(x) > 0 for x in texts(t.sent["good"], 2)])
