"""python_backend without Triton: a fake engine (the BRIEF's Engine contract) and a fake transport."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from python_backend.errors import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE, BadRequest, map_exception
from python_backend.request import GenerateRequest, parse_request
from python_backend.response import ResponseBuilder


# ---- fakes

class InvalidRequestError(ValueError):
    pass


class EngineOverloadedError(RuntimeError):
    pass


@dataclass
class Out:
    request_id: str
    token_ids: list
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 3
    num_output_tokens: int = 0
    error: str | None = None
    logprobs: list | None = None        # as the engine's RequestOutput: coalesce() merges them
    prompt_logprobs: list | None = None


class FakeEngine:
    """Emits the characters of `reply` one token each (a 2-token step for multi-byte ones, with an
    empty first delta, like an engine holding back half a UTF-8 character); max_tokens caps it."""

    def __init__(self, reply="héllo", step_s=0.002, max_waiting=100):
        self.reply, self.step_s, self.max_waiting = reply, step_s, max_waiting
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.healthy = True
        self.error = ""
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def add_request(self, prompt, params, request_id=None, on_output=None):
        if prompt == "too long":
            raise InvalidRequestError("prompt is longer than max_model_len")
        with self.lock:
            if len(self.requests) >= self.max_waiting:
                raise EngineOverloadedError("queue full")
            self.requests[request_id] = {"params": params, "cb": on_output, "pos": 0, "n": 0, "half": False}
        return request_id

    def abort(self, request_id):
        with self.lock:
            r = self.requests.pop(request_id, None)
            self.aborted.append(request_id)
        if r is not None:
            r["cb"](Out(request_id, [], "", True, "cancelled", num_output_tokens=r["n"]))

    def step(self):
        with self.lock:
            items = list(self.requests.items())
        for rid, r in items:
            ch = self.reply[r["pos"]]
            if len(ch.encode()) > 1 and not r["half"]:
                r["half"] = True
                r["n"] += 1
                r["cb"](Out(rid, [1000], "", num_output_tokens=r["n"]))
                continue
            r["half"] = False
            r["pos"] += 1
            r["n"] += 1
            done = r["pos"] == len(self.reply) or r["n"] >= r["params"]["max_tokens"]
            if done:
                with self.lock:
                    self.requests.pop(rid, None)
            r["cb"](Out(rid, [ord(ch)], ch, done, ("stop" if r["pos"] == len(self.reply) else "length") if done else None,
                        num_output_tokens=r["n"]))

    def start(self):
        def loop():
            try:
                while not self._stop.is_set():
                    self.step()
                    time.sleep(self.step_s)
            except Exception as e:
                self.healthy, self.error = False, str(e)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    def stats(self):
        with self.lock:
            return {"running": len(self.requests), "waiting": 0, "kv": {"kv_tokens": sum(r["n"] for r in self.requests.values())}}


def make_params(d):
    allowed = {"max_tokens", "temperature"}
    if set(d) - allowed:
        raise InvalidRequestError(f"unknown sampling parameter(s) {sorted(set(d) - allowed)}")
    max_tokens = d.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 1000:
        raise InvalidRequestError(f"max_tokens must be an integer in 1..1000, got {max_tokens!r}")
    return {"max_tokens": max_tokens}


class FakeTransport:
    def __init__(self):
        self.sent: dict[object, list] = {}
        self.cancelled: set = set()
        self.broken: set = set()
        self.unloaded = 0
        self.logs = []
        self.done = threading.Condition()

    def send(self, sender, outputs, error, final):
        if sender in self.broken:
            raise RuntimeError("stream closed")
        with self.done:
            self.sent.setdefault(sender, []).append((outputs, error, final))
            self.done.notify_all()

    def is_cancelled(self, sender):
        return sender in self.cancelled

    def unload(self):
        self.unloaded += 1

    def log(self, level, message):
        self.logs.append((level, message))

    def wait_final(self, sender, timeout=60.0):
        with self.done:
            ok = self.done.wait_for(lambda: any(f for _, _, f in self.sent.get(sender, [])), timeout)
        assert ok, f"no final response for {sender}: {self.sent.get(sender)}"
        return self.sent[sender]


def inputs(**tensors):
    arrays = {}
    for k, v in tensors.items():
        if isinstance(v, bool):
            arrays[k] = np.array([v])
        elif isinstance(v, (str, bytes)):
            arrays[k] = np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_)
        else:
            arrays[k] = v
    return arrays.get


def text_of(responses):
    return "".join(o["text_output"][0].decode() for o, _, _ in responses if o)


# ---- request parsing

def test_parse_full_request():
    r = parse_request(inputs(text_input="hi", stream=True, sampling_parameters='{"max_tokens": 4}',
                             exclude_input_in_output=True, return_finish_reason=True,
                             return_num_input_tokens=True, return_num_output_tokens=True))
    assert r == GenerateRequest("hi", True, {"max_tokens": 4}, True, True, True, True)
    assert not r.prepend_prompt
    assert parse_request(inputs(text_input="hi")).prepend_prompt


def test_parse_takes_a_prompt_of_token_ids_and_never_prepends_it():
    for ids in (np.array([5, 6, 7], dtype=np.int64), np.array([[5, 6, 7]], dtype=np.int32)):
        r = parse_request(inputs(input_ids=ids))
        assert r.prompt == [5, 6, 7] and all(type(t) is int for t in r.prompt)
        assert not r.prepend_prompt       # no text of it to prepend, streamed or not


def test_parse_takes_request_parameters_without_sampling_tensor():
    r = parse_request(inputs(text_input="hi"), json.dumps({"max_tokens": 3, "stream": True, "triton_x": 1}))
    assert r.stream and r.sampling == {"max_tokens": 3}
    # the tensor wins over request parameters
    r = parse_request(inputs(text_input="hi", sampling_parameters='{"max_tokens": 5}'), '{"max_tokens": 3}')
    assert r.sampling == {"max_tokens": 5}


@pytest.mark.parametrize("tensors, params, message", [
    (dict(), None, "missing input 'text_input'"),
    (dict(text_input="hi", input_ids=np.array([1, 2])), None, "not both"),
    (dict(input_ids=np.array([], dtype=np.int64)), None, "'input_ids' is empty"),
    (dict(input_ids=np.array([1.0, 2.0])), None, "must be an INT32 or INT64"),
    (dict(input_ids=np.array([True, False])), None, "must be an INT32 or INT64"),
    (dict(input_ids=np.array([b"1"], dtype=np.object_)), None, "must be an INT32 or INT64"),
    (dict(input_ids=np.array([[1, 2], [3, 4]])), None, "one prompt"),
    (dict(input_ids=np.zeros((1, 1, 2), dtype=np.int64)), None, "one prompt"),
    (dict(input_ids=np.zeros((1 << 20) + 1, dtype=np.int32)), None, "more than any context"),
    (dict(text_input=""), None, "'text_input' is empty"),
    (dict(text_input=b"\xff\xfeab"), None, "not valid UTF-8"),
    (dict(text_input=np.array([b"a", b"b"], dtype=np.object_)), None, "exactly one element"),
    (dict(text_input=np.array([1.5])), None, "must be a STRING"),
    (dict(text_input="hi", sampling_parameters="{max_tokens: 3"), None, "not valid JSON"),
    (dict(text_input="hi", sampling_parameters="[1, 2]"), None, "must be a JSON object"),
    (dict(text_input="hi", sampling_parameters=b"\xc3("), None, "not valid UTF-8"),
    (dict(text_input="hi", stream=np.array([1], dtype=np.int32)), None, "must be a BOOL"),
    (dict(text_input="hi"), "not json", "request parameters is not valid JSON"),
    (dict(text_input="hi"), '{"stream": "yes"}', "must be true or false"),
])
def test_parse_rejects_garbage(tensors, params, message):
    with pytest.raises(BadRequest, match=message):
        parse_request(inputs(**tensors), params)


# ---- responses

def test_streaming_deltas_carry_held_back_tokens():
    b = ResponseBuilder(GenerateRequest("p", stream=True, return_num_output_tokens=True, return_finish_reason=True))
    assert b.on_output(Out("r", [1], "", num_output_tokens=1)) == (None, None)
    outputs, error = b.on_output(Out("r", [2], "é", num_output_tokens=2))
    assert error is None and outputs["text_output"][0].decode() == "é"
    assert outputs["num_output_tokens"][0] == 2 and outputs["finish_reason"][0] == b""
    outputs, _ = b.on_output(Out("r", [3], "", True, "length", num_output_tokens=3))
    assert outputs["text_output"][0] == b"" and outputs["num_output_tokens"][0] == 1
    assert outputs["finish_reason"][0] == b"length"
    assert outputs["num_output_tokens"].dtype == np.uint32


def test_non_streaming_one_response_with_prompt_unless_excluded():
    for exclude, expect in ((False, "p: ab"), (True, "ab")):
        b = ResponseBuilder(GenerateRequest("p: ", exclude_input_in_output=exclude, return_num_input_tokens=True))
        assert b.on_output(Out("r", [1], "a", num_output_tokens=1)) == (None, None)
        outputs, _ = b.on_output(Out("r", [2], "b", True, "stop", num_prompt_tokens=7, num_output_tokens=2))
        assert outputs["text_output"][0].decode() == expect
        assert outputs["num_input_tokens"][0] == 7 and set(outputs) == {"text_output", "num_input_tokens"}


def test_error_and_cancel_endings():
    b = ResponseBuilder(GenerateRequest("p", stream=True))
    assert b.on_output(Out("r", [], "", True, "error", error="boom"))[1].code == INTERNAL
    assert "boom" in b.on_output(Out("r", [], "", True, "error", error="boom"))[1].message
    assert b.on_output(Out("r", [], "", True, "cancelled"))[1].code == CANCELLED


def test_error_mapping():
    assert map_exception(InvalidRequestError("max_tokens must be >= 1")).code == INVALID_ARG
    assert map_exception(BadRequest("x")).code == INVALID_ARG
    e = map_exception(EngineOverloadedError("queue full"))
    assert e.code == UNAVAILABLE and "retry later" in e.message
    assert map_exception(KeyError("x")).code == INTERNAL
