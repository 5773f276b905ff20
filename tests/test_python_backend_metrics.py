"""python_backend's metrics without Triton: a fake metric sink fed by Metrics, by the engine's step
trace and stats (a fake's and the real engine's), and through the host. The fakes are test_python_backend.py's."""
from __future__ import annotations

import time

import pytest

from fastdecode.config import EngineConfig
from python_backend.host import EngineHost
from python_backend.metrics import Metrics, kv_tokens_by_worker

from test_python_backend import FakeEngine, make_params, FakeTransport, inputs


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
