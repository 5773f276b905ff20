"""Fuzzing the Triton request inputs (issue #17): python_backend/request.py's parse_request and the
engine's SamplingParams.from_dict, which together turn a request's tensors and parameters into a
prompt and sampling parameters, and EngineHost.submit, which answers with their errors.

Inputs are what Triton's python backend can hand over (numpy arrays of any dtype and shape, object
arrays of bytes, strings, numbers, None) and arbitrary or extreme JSON (huge and non-finite numbers,
deep nesting, wrong types, invalid UTF-8). Every outcome must be the project's error for bad input
(BadRequest / InvalidRequestError, with a message) or a usable result: a non-empty prompt (text, or
token ids as Python ints: the engine checks them against the vocabulary), bool
flags, and SamplingParams that the engine's sampler accepts for a step.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.engine import InvalidRequestError, SamplingParams
from fastdecode.engine.sampling import TokenHistory, sample
from python_backend.errors import INVALID_ARG, BadRequest
from python_backend.host import EngineHost
from python_backend.request import FLAGS, GenerateRequest, parse_request

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NAMES = ("text_input", "input_ids", "sampling_parameters", *FLAGS)
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "logprobs",
                 "prompt_logprobs", "logit_bias")

# ---- what Triton can hand the backend

scalars = st.one_of(
    st.binary(max_size=24), st.text(max_size=24), st.booleans(), st.none(),
    st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True, allow_infinity=True))
SHAPES = [(), (0,), (1,), (2,), (1, 1), (2, 3), (1, 0)]
DTYPES = [np.bool_, np.int8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64, "S8", "U8"]


@st.composite
def arrays(draw):
    shape = draw(st.sampled_from(SHAPES))
    n = int(np.prod(shape))
    if draw(st.booleans()):   # STRING/BYTES tensors arrive as object arrays
        a = np.empty(n, dtype=np.object_)
        for i in range(n):
            a[i] = draw(scalars)
        return a.reshape(shape)
    dtype = draw(st.sampled_from(DTYPES))
    raw = draw(st.binary(min_size=n * np.dtype(dtype).itemsize, max_size=n * np.dtype(dtype).itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


# numbers at and past every bound a sampling parameter has, and of every JSON type
extreme_numbers = st.one_of(
    st.sampled_from([0, 1, -1, 2, 20, 21, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400,
                     0.0, -0.0, 1e-320, 0.5, 1.0, 1.0000001, 2.0, 2.5, 1e308, -1e308, float("inf"), float("-inf"),
                     float("nan")]),
    st.integers(-(1 << 80), 1 << 80), st.floats())
json_values = st.recursive(
    st.none() | st.booleans() | extreme_numbers | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(0, 60).map(str),
                                                                inner, max_size=4),
    max_leaves=12)
sampling_dicts = st.dictionaries(st.sampled_from(SAMPLING_KEYS) | st.text(max_size=10),
                                 json_values | extreme_numbers, max_size=6)


def dumps(value) -> str:
    """JSON as a client may send it: Python's json writes NaN/Infinity, which json.loads reads back."""
    return json.dumps(value)


sampling_texts = st.one_of(
    sampling_dicts.map(dumps), sampling_dicts.map(dumps),
    json_values.map(dumps), st.text(max_size=40),
    st.sampled_from(["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000,
                     '{"max_tokens": 1' + "0" * 5000 + "}", '{"temperature": 1' + "0" * 400 + "}",
                     '{"top_k": 1' + "0" * 30 + "}", '{"seed": 1e400}', "", "null", "{}", "\ufeff{}",
                     '{"stop": ["a", ""]}', '{"max_tokens": 1, "max_tokens": 2}']))


@st.composite
def requests(draw):
    if draw(st.integers(0, 9)) == 0:      # a plain valid request now and then: the refusals stay honest
        tensors = {"text_input": np.array([draw(st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                                        min_size=1, max_size=16)).encode()], dtype=np.object_)}
        return tensors, draw(st.none() | st.just({"max_tokens": draw(st.integers(1, 16))}))
    tensors = {}
    for name in NAMES:
        kind = draw(st.sampled_from(["absent", "typical", "array"]))
        if kind == "array":
            tensors[name] = draw(arrays())
        elif kind == "typical" and name == "text_input":
            tensors[name] = np.array([draw(st.binary(max_size=16) | st.text(max_size=16).map(str.encode))],
                                     dtype=np.object_)
        elif kind == "typical" and name == "sampling_parameters":
            text = draw(sampling_texts)
            tensors[name] = np.array([text.encode("utf-8", "surrogatepass") if draw(st.booleans()) else text],
                                     dtype=np.object_)
        elif kind == "typical":
            tensors[name] = np.array([draw(st.booleans())])
    parameters = draw(st.one_of(st.none(), sampling_texts, sampling_dicts,
                                st.dictionaries(st.sampled_from(FLAGS) | st.just("triton_x"), json_values, max_size=3),
                                st.binary(max_size=20)))
    return tensors, parameters


def usable(params: SamplingParams) -> None:
    """The engine's sampler takes params for a step over a small vocabulary (as engine/sequence.py
    sets a sequence up: a generator for a seed, a token history where the params need one)."""
    if params.logit_bias and params.logit_bias[-1][0] >= 40:
        return      # ids past the vocabulary: Engine.add_request refuses them (test_sampling_params)
    generator = None if params.seed is None else torch.Generator(device="cpu").manual_seed(params.seed)
    history = TokenHistory([1, 2, 3]) if params.needs_history else None
    logits = torch.randn(1, 40)
    tokens = sample(logits, [params], [generator], [history], eos_token_ids=(0,))
    assert tokens.shape == (1,) and 0 <= int(tokens[0]) < 40


@FUZZ
@given(requests())
def test_parsing_gives_the_projects_error_or_a_usable_request(request):
    tensors, parameters = request
    try:
        parsed = parse_request(tensors.get, parameters)
    except BadRequest as e:
        assert str(e)
        return
    assert isinstance(parsed, GenerateRequest)
    assert parsed.prompt and (isinstance(parsed.prompt, str) or all(type(t) is int for t in parsed.prompt))
    assert all(isinstance(getattr(parsed, f), bool) for f in FLAGS)
    assert isinstance(parsed.sampling, dict)
    try:
        params = SamplingParams.from_dict(parsed.sampling)
    except InvalidRequestError as e:
        assert str(e)
        return
    usable(params)


@FUZZ
@given(sampling_dicts)
def test_sampling_params_from_any_json_object(values):
    """Straight into SamplingParams.from_dict (what a sampling_parameters tensor carries after parsing)."""
    try:
        params = SamplingParams.from_dict(values)
    except InvalidRequestError as e:
        assert str(e)
        return
    usable(params)


class RecordingEngine:
    """Takes every request the host hands it; no tokens."""

    def __init__(self) -> None:
        self.added = []

    def add_request(self, prompt, params, request_id=None, on_output=None):
        self.added.append((prompt, params))
        return request_id

    def abort(self, request_id):
        pass

    def stats(self):
        return {"running": 0, "waiting": 0, "kv": {"kv_tokens": 0}}


class Transport:
    def __init__(self) -> None:
        self.sent = {}
        self.lock = threading.Lock()

    def send(self, sender, outputs, error, final):
        with self.lock:
            self.sent.setdefault(sender, []).append((outputs, error, final))

    def is_cancelled(self, sender):
        return False

    def unload(self):
        pass

    def log(self, level, message):
        pass


def test_the_host_refuses_bad_requests_as_invalid_arg_never_internal():
    engine, transport = RecordingEngine(), Transport()
    host = EngineHost(engine, transport, cancel_poll_s=0.01, metrics_interval_s=0.05)   # the engine's from_dict
    seen = {"accepted": 0, "refused": 0}
    try:
        @FUZZ
        @given(requests())
        def check(request):
            tensors, parameters = request
            sender = object()
            rid = host.submit(sender, tensors.get, parameters)
            if rid is None:
                seen["refused"] += 1
                (outputs, error, final), = transport.sent[sender]
                assert final and outputs is None
                assert error.code == INVALID_ARG, error.message
                assert error.message.startswith("invalid request: ") and len(error.message) > len("invalid request: ")
            else:
                seen["accepted"] += 1
                prompt, params = engine.added[-1]
                assert prompt and (isinstance(prompt, str) or all(type(t) is int for t in prompt))
                assert isinstance(params, SamplingParams)
                usable(params)

        check()
    finally:
        host.shutdown()
    assert seen["refused"] >= 20 and seen["accepted"] >= 1, seen


# ---- what the fuzzing found (each failed before its fix)

@pytest.mark.parametrize("tensors, parameters", [
    (dict(sampling_parameters="[" * 5000 + "]" * 5000), None),                 # RecursionError escaped
    (dict(sampling_parameters='{"max_tokens": 1' + "0" * 5000 + "}"), None),   # ValueError (int digits limit)
    (dict(), b"\x80{}"),                                                       # UnicodeDecodeError
], ids=["deep nesting", "5000-digit integer", "request parameters not UTF-8"])
def test_json_the_decoder_chokes_on_is_a_bad_request(tensors, parameters):
    get = {"text_input": np.array([b"hi"], dtype=np.object_),
           **{k: np.array([v], dtype=np.object_) for k, v in tensors.items()}}.get
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request(get, parameters)


@pytest.mark.parametrize("values, message", [
    ({"top_k": 2**63}, "top_k"),                    # accepted, then the sampler's int64 overflowed: the step died
    ({"top_k": 2**64 + 5}, "top_k"),
    ({"repetition_penalty": 10**400}, "repetition_penalty"),   # OverflowError, not InvalidRequestError
])
def test_sampling_values_beyond_what_the_sampler_holds_are_refused(values, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict(values)
    usable(SamplingParams.from_dict({k: 2**63 - 1 if k == "top_k" else 1e300 for k in values}))
