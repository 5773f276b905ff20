"""python_backend without Triton: a fake engine (the BRIEF's Engine contract) and a fake transport."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from fastdecode.config import REPO_ROOT, EngineConfig
from python_backend.config import build_configs, model_parameters
from python_backend.errors import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE, BadRequest, map_exception
from python_backend.host import EngineHost, install_step_fault
from python_backend.metrics import Metrics, kv_tokens_by_worker
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


@pytest.fixture
def host():
    engine, transport = FakeEngine(), FakeTransport()
    h = EngineHost(engine, transport, make_params=make_params, cancel_poll_s=0.01, metrics_interval_s=0.01,
                   crash_grace_s=0.05)
    engine.start()
    yield h, engine, transport
    h.shutdown()


# ---- request parsing

def test_parse_full_request():
    r = parse_request(inputs(text_input="hi", stream=True, sampling_parameters='{"max_tokens": 4}',
                             exclude_input_in_output=True, return_finish_reason=True,
                             return_num_input_tokens=True, return_num_output_tokens=True))
    assert r == GenerateRequest("hi", True, {"max_tokens": 4}, True, True, True, True)
    assert not r.prepend_prompt
    assert parse_request(inputs(text_input="hi")).prepend_prompt


def test_parse_takes_request_parameters_without_sampling_tensor():
    r = parse_request(inputs(text_input="hi"), json.dumps({"max_tokens": 3, "stream": True, "triton_x": 1}))
    assert r.stream and r.sampling == {"max_tokens": 3}
    # the tensor wins over request parameters
    r = parse_request(inputs(text_input="hi", sampling_parameters='{"max_tokens": 5}'), '{"max_tokens": 3}')
    assert r.sampling == {"max_tokens": 5}


@pytest.mark.parametrize("tensors, params, message", [
    (dict(), None, "missing input 'text_input'"),
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


# ---- configuration

def test_build_configs_resolves_paths_and_rejects_unknown(tmp_path):
    params = model_parameters({"parameters": {"model": {"string_value": "models/x"}, "dtype": {"string_value": ""},
                                              "max_running": {"string_value": "64"},
                                              "rworkers": {"string_value": "h1:1, h2:2"},
                                              "cancel_poll_ms": {"string_value": "50"}}})
    assert "dtype" not in params
    engine, host = build_configs(params)
    assert engine.model == str(REPO_ROOT / "models/x") and engine.max_running == 64
    assert engine.rworkers == ("h1:1", "h2:2") and engine.attention == "remote"
    assert host.cancel_poll_s == 0.05
    assert build_configs({"model": "/abs/m"})[0].model == "/abs/m"
    with pytest.raises(ValueError, match="unknown model parameter"):
        build_configs({"modle": "x"})
    with pytest.raises(ValueError, match="max_running"):
        build_configs({"max_running": "many"})
    with pytest.raises(ValueError, match="cancel_poll_ms"):
        build_configs({"cancel_poll_ms": "-1"})
    assert build_configs({"kv_format": "int4", "kv_int4_fp16_tail": "off"})[0].kv_int4_fp16_tail is False
    assert build_configs({"kv_int4_fp16_tail": " True "})[0].kv_int4_fp16_tail is True
    for bad in ("maybe", "", "2"):
        with pytest.raises(ValueError, match="kv_int4_fp16_tail"):
            build_configs({"kv_int4_fp16_tail": bad})
    groups = build_configs({"kv_format": "int4", "kv_int4_k_group": "16", "kv_int4_v_group": "128"})[0]
    assert (groups.kv_int4_k_group, groups.kv_int4_v_group) == (16, 128)
    for bad in ("48", "x", "", "3.5"):
        with pytest.raises(ValueError, match="kv_int4_v_group"):
            build_configs({"kv_int4_v_group": bad})


def write_real_plan(tmp_path, seq_len=512) -> tuple[Path, dict]:
    """A plan file written by the real `plan` command (fastdecode.ops.plan.main) from a small
    linear perf model (T(B) = 2 ms + 10 us * B, as tests/test_perfmodel.py)."""
    from fastdecode.ops.plan import main
    from fastdecode.perfmodel import Curve, PerfModel

    xs = (1, 16, 64, 256, 1024)
    pm = PerfModel(8, Curve.of({x: 2e-3 + 1e-5 * x for x in xs}), Curve.of({x: 1e-3 + 1e-6 * x for x in xs}),
                   5e-8, 1e-4, {"device": "synthetic", "shape": {"num_kv_heads": 2, "head_dim": 16}})
    pm.save(tmp_path / "perf.json")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(model_dir), "--perf", str(tmp_path / "perf.json"),
                 "--seq-len", str(seq_len), "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_plan_file_from_the_plan_command_configures_the_engine(tmp_path):
    path, doc = write_real_plan(tmp_path)
    engine, _ = build_configs({"plan": str(path)})
    p = doc["plan"]
    assert (engine.scheduler, engine.max_running, engine.num_minibatches) == ("sls", p["max_running"],
                                                                                p["num_minibatches"])
    assert (engine.sls_f, engine.sls_w_lim, engine.sls_target_len) == (p["sls_f"], p["sls_w_lim"], 512)
    # config.pbtxt's own values sit above the plan's
    engine, _ = build_configs({"plan": str(path), "sls_f": "16", "scheduler": "fcfs"})
    assert (engine.sls_f, engine.scheduler, engine.max_running) == (16, "fcfs", p["max_running"])
    # relative paths resolve against the checkout, as `make serve SERVE_ARGS="--param plan=..."` passes them
    rel = path.relative_to(tmp_path)
    assert build_configs({"plan": str(rel)}, root=tmp_path)[0].sls_w_lim == p["sls_w_lim"]


def test_checked_in_plan_file_is_read():
    path = REPO_ROOT / "bench" / "results" / "plan.json"
    if not path.exists():
        pytest.skip("no bench/results/plan.json (make plan writes it)")
    engine, _ = build_configs({"plan": "bench/results/plan.json"})
    assert engine.scheduler == "sls"
    assert engine.sls_w_lim == json.loads(path.read_text())["settings"]["sls_w_lim"]


@pytest.mark.parametrize("doc, message", [
    ("not json", "cannot read a JSON object"),
    ("[1, 2]", "expected a JSON object"),
    ({"config": {"max_running": 512, "scheduler": "sls"}}, 'no "settings"'),      # not what plan writes
    ({"settings": {}, "plan": {}}, 'no "settings"'),
    ({"settings": [["max_running", 4]]}, 'no "settings"'),
    ({"settings": {"max_running": 8, "batch_per_minibatch": 4}}, r"unknown setting\(s\) \['batch_per_minibatch'\]"),
    ({"settings": {"max_running": "many"}}, 'max_running="many" is not a valid int'),
    ({"settings": {"max_running": 8.5}}, "max_running=8.5 is not a valid int"),
    ({"settings": {"max_running": True}}, "max_running=true is not a valid int"),
    ({"settings": {"scheduler": 2}}, "scheduler=2 is not a valid str"),
    ({"settings": {"rworkers": "a:1"}}, "rworkers=\"a:1\" is not a valid tuple"),
    ({"settings": {"rworker_timeout_s": None}}, "rworker_timeout_s=null is not a valid float"),
    ({"settings": {"scheduler": "lifo"}}, "its settings \\(scheduler\\) are not valid here: .*scheduler must be"),
    ({"settings": {"sls_f": 0, "max_running": 4}}, "are not valid here: .*sls_f must be >= 1"),
])
def test_bad_plan_files_are_rejected_clearly(tmp_path, doc, message):
    path = tmp_path / "plan.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError, match=f"plan {re.escape(str(path))}: .*{message}"):
        build_configs({"plan": str(path)})


def test_plan_is_not_blamed_for_a_bad_explicit_parameter(tmp_path):
    path, _ = write_real_plan(tmp_path)
    with pytest.raises(ValueError, match="kv_format") as e:
        build_configs({"plan": str(path), "kv_format": "fp3"})
    assert "plan" not in str(e.value)
    with pytest.raises(ValueError, match="plan .*missing.json: cannot read"):
        build_configs({"plan": str(tmp_path / "missing.json")})


# ---- metrics

class FakeMetric:
    def __init__(self, kind):
        self.kind, self.value, self.observed = kind, 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeSink:
    def __init__(self):
        self.metrics = {}

    def _make(self, kind, name, labels):
        key = (name, tuple(sorted(labels.items())))
        assert key not in self.metrics, f"metric made twice: {key}"
        self.metrics[key] = FakeMetric(kind)
        return self.metrics[key]

    def counter(self, name, description, labels):
        return self._make("counter", name, labels)

    def gauge(self, name, description, labels):
        return self._make("gauge", name, labels)

    def histogram(self, name, description, labels, buckets):
        assert buckets == sorted(buckets)
        return self._make("histogram", name, labels)

    def get(self, name, **labels):
        return self.metrics[(name, tuple(sorted({"model": "m", **labels}.items())))]


def test_metrics_accumulate_then_flush():
    sink = FakeSink()
    m = Metrics(sink, {"model": "m"})
    m.first_token(0.2, num_prompt_tokens=5)
    m.tokens(3)
    m.request_finished("length", decode_seconds=0.5, num_output_tokens=3)
    m.request_finished("weird", None, 0)
    assert sink.get("fastdecode_generation_tokens_total").value == 0      # nothing pushed before flush
    m.flush({"running": 2, "waiting": 1, "kv": {"workers": {"a:1": {"kv_tokens": 10}, "b:2": {"kv_tokens": 0}}}})
    assert sink.get("fastdecode_prompt_tokens_total").value == 5
    assert sink.get("fastdecode_generation_tokens_total").value == 3
    assert sink.get("fastdecode_requests_finished_total", reason="length").value == 1
    assert sink.get("fastdecode_requests_finished_total", reason="error").value == 1
    assert sink.get("fastdecode_time_to_first_token_seconds").observed == [0.2]
    assert sink.get("fastdecode_time_per_output_token_seconds").observed == [0.25]
    assert sink.get("fastdecode_requests_running").value == 2
    assert sink.get("fastdecode_kv_tokens", rworker="a:1").value == 10
    m.flush({"running": 0, "kv": {"workers": {"a:1": {"kv_tokens": 0}}}})   # gauges are reused, not remade
    assert sink.get("fastdecode_kv_tokens", rworker="a:1").value == 0
    assert sink.get("fastdecode_generation_tokens_total").value == 3


def test_kv_tokens_by_worker_shapes():
    assert kv_tokens_by_worker({"kv": {"kv_tokens": 7}}) == {"local": 7}
    assert kv_tokens_by_worker({"kv": {"workers": [{"address": "a", "kv_tokens": 1}]}}) == {"a": 1}
    assert kv_tokens_by_worker({}) == {}


def step_record(step, step_time, batch_size=2, context_tokens=10, s_time=0.0, r_time=0.0, s_wait=0.0, r_wait=0.0):
    return {"step": step, "time": 1000.0 + step, "batch_size": batch_size, "num_prefill": 0,
            "context_tokens": context_tokens, "s_time": s_time, "r_time": r_time, "s_wait": s_wait,
            "r_wait": r_wait, "step_time": step_time}


def test_trace_feeds_step_metrics_once_per_step():
    sink = FakeSink()
    m = Metrics(sink, {"model": "m"})
    trace = [step_record(0, 0.010, 1, 5, s_time=0.006, r_time=0.003, s_wait=0.002, r_wait=0.007),
             step_record(1, 0.020, 2, 12, s_time=0.012, r_time=0.010, s_wait=0.004, r_wait=None),   # not measurable
             step_record(2, 0.030, 2, 14, s_time=0.020, r_time=0.015, s_wait=0.006, r_wait=0.015)]
    m.flush({"running": 2, "waiting": 0, "scheduler": {}}, trace)
    value = lambda name, **labels: sink.get(name, **labels).value   # noqa: E731
    assert value("fastdecode_steps_total") == 3
    assert value("fastdecode_step_seconds_total") == pytest.approx(0.060)
    assert value("fastdecode_s_part_seconds_total") == pytest.approx(0.038)
    assert value("fastdecode_r_part_seconds_total") == pytest.approx(0.028)
    assert value("fastdecode_s_wait_seconds_total") == pytest.approx(0.012)
    assert value("fastdecode_r_wait_seconds_total") == pytest.approx(0.022)
    stats = {s: value("fastdecode_step_time_seconds", stat=s) for s in ("mean", "p50", "p99", "max")}
    assert stats == pytest.approx({"mean": 0.020, "p50": 0.020, "p99": 0.030, "max": 0.030})
    assert (value("fastdecode_batch_size"), value("fastdecode_context_tokens")) == (2, 14)
    # the engine's trace is its newest records: the next push counts only the steps it had not seen,
    # also when older ones have left the window
    trace = trace[2:] + [step_record(3, 0.050, 1, 7, s_time=0.04)]
    m.flush({"running": 1}, trace)
    assert value("fastdecode_steps_total") == 4
    assert value("fastdecode_step_seconds_total") == pytest.approx(0.110)
    assert value("fastdecode_s_part_seconds_total") == pytest.approx(0.078)
    assert value("fastdecode_step_time_seconds", stat="mean") == pytest.approx(0.050)   # this push's steps
    assert (value("fastdecode_batch_size"), value("fastdecode_context_tokens")) == (1, 7)
    m.flush({"running": 1}, trace)                     # no step since: a stall, not idle
    assert value("fastdecode_steps_total") == 4 and value("fastdecode_batch_size") == 1
    m.flush({"running": 0}, trace)                     # idle
    assert (value("fastdecode_batch_size"), value("fastdecode_context_tokens")) == (0, 0)
    assert value("fastdecode_step_time_seconds", stat="max") == pytest.approx(0.050)
    assert value("fastdecode_steps_total") == 4
    assert not [name for name, _ in sink.metrics if name.startswith("fastdecode_sls")]    # fcfs: no SLS gauges
    m.flush({"running": 0})                            # an engine without a trace: step metrics untouched
    assert value("fastdecode_steps_total") == 4


def test_sls_scheduler_stats_feed_w_lim_gauges():
    sink = FakeSink()
    m = Metrics(sink, {"model": "m"})
    sls = {"policy": "sls", "f": 8, "w_lim": 300, "target_len": 40, "w_in_flight": 120, "predicted_peak": 200}
    m.flush({"running": 3, "scheduler": sls}, [])
    assert sink.get("fastdecode_sls_w_lim").value == 300 and sink.get("fastdecode_sls_w_in_flight").value == 120
    m.flush({"running": 0, "scheduler": {**sls, "w_lim": 340, "w_in_flight": 0}}, [])   # derived W_lim moves
    assert sink.get("fastdecode_sls_w_lim").value == 340 and sink.get("fastdecode_sls_w_in_flight").value == 0


def test_real_engine_trace_reaches_the_metrics(tiny_model_dir, one_torch_thread):
    """The engine's own trace and stats (not a fake's) through the host into the metrics."""
    from fastdecode.engine import Engine

    w_lim = 120
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", scheduler="sls", max_running=8, sls_f=2,
                                 sls_w_lim=w_lim))
    t, sink = FakeTransport(), FakeSink()
    h = EngineHost(engine, t, Metrics(sink, {"model": "m"}), cancel_poll_s=0.01, metrics_interval_s=0.01)
    engine.start()
    try:
        for i in range(4):
            h.submit(i, inputs(text_input=f"prompt {i}", stream=True,
                               sampling_parameters='{"max_tokens": 12, "temperature": 0, "ignore_eos": true}'))
        for i in range(4):
            assert t.wait_final(i, timeout=60)[-1][1] is None
        deadline = time.monotonic() + 5
        while sink.get("fastdecode_steps_total").value < engine.stats()["steps"] and time.monotonic() < deadline:
            time.sleep(0.01)
        trace = engine.trace
        assert sink.get("fastdecode_steps_total").value == engine.stats()["steps"] == len(trace)
        assert sink.get("fastdecode_step_seconds_total").value == pytest.approx(sum(r["step_time"] for r in trace))
        assert sink.get("fastdecode_s_part_seconds_total").value == pytest.approx(sum(r["s_time"] for r in trace))
        assert 0 < sink.get("fastdecode_s_part_seconds_total").value <= sink.get("fastdecode_step_seconds_total").value
        assert sink.get("fastdecode_r_part_seconds_total").value > 0
        assert sink.get("fastdecode_sls_w_lim").value == w_lim
        deadline = time.monotonic() + 10
        while (sink.get("fastdecode_batch_size").value, sink.get("fastdecode_context_tokens").value) != (0, 0) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.get("fastdecode_batch_size").value == 0 and sink.get("fastdecode_context_tokens").value == 0
    finally:
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


def test_metrics_flow_through_the_host():
    engine, t, sink = FakeEngine(), FakeTransport(), FakeSink()
    h = EngineHost(engine, t, Metrics(sink, {"model": "m"}), make_params=make_params, cancel_poll_s=0.01,
                   metrics_interval_s=0.01)
    engine.start()
    try:
        for i in range(4):
            h.submit(i, inputs(text_input="x", stream=True))
        for i in range(4):
            t.wait_final(i)
        deadline = time.monotonic() + 10
        while (sink.get("fastdecode_requests_finished_total", reason="stop").value < 4
               or sink.get("fastdecode_generation_tokens_total").value < 4 * 6) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.get("fastdecode_generation_tokens_total").value == 4 * 6
        assert sink.get("fastdecode_prompt_tokens_total").value == 4 * 3
        assert len(sink.get("fastdecode_time_to_first_token_seconds").observed) == 4
        assert sink.get("fastdecode_requests_finished_total", reason="stop").value == 4
        assert sink.get("fastdecode_kv_tokens", rworker="local").value == 0
    finally:
        h.shutdown()


def test_engine_config_from_dict_still_accepts_what_serve_writes():
    # fastdecode.ops.serve writes these keys into config.pbtxt; EngineConfig must accept them.
    cfg = EngineConfig.from_dict({"model": "m", "attention": "remote", "rworkers": "a:1,b:2"})
    assert cfg.rworkers == ("a:1", "b:2")


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
