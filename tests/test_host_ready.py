"""While the engine says it is not ready (every R-worker down), new requests get UNAVAILABLE at
once instead of queuing to fail; the fastdecode_ready gauge and the preemption counter follow
engine.stats()."""
import numpy as np

from python_backend.errors import UNAVAILABLE
from python_backend.host import EngineHost
from python_backend.metrics import Metrics
from test_response_coalescing import GatedTransport, ManualEngine


def fakes():
    """test_response_coalescing's engine and transport: requests registered, responses recorded."""
    engine, transport = ManualEngine(), GatedTransport()
    engine.ready = True
    transport.gate.set()
    return engine, transport


def request():
    return {"text_input": np.array([b"hi"], dtype=np.object_)}.get


def test_requests_are_refused_with_unavailable_while_the_engine_is_not_ready():
    engine, transport = fakes()
    host = EngineHost(engine, transport, make_params=lambda d: d, cancel_poll_s=60, metrics_interval_s=60)
    try:
        engine.ready = False
        assert host.submit("a", request()) is None
        (sender, outputs, error, final), = transport.sent
        assert (sender, outputs, final, error.code) == ("a", None, True, UNAVAILABLE)
        assert "R-worker" in error.message and not engine.callbacks
        engine.ready = True                       # the workers are back: requests flow again
        assert host.submit("b", request()) is not None and len(engine.callbacks) == 1
    finally:
        host.shutdown()


class Gauge:
    def __init__(self):
        self.value = None
        self.total = 0.0

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.total += v

    def observe(self, v):
        pass


class Sink:
    def __init__(self):
        self.made = {}

    def _make(self, name, description, labels, *rest):
        return self.made.setdefault((name, tuple(sorted(labels.items()))), Gauge())

    counter = gauge = histogram = _make


def test_ready_gauge_and_preemption_counter_follow_the_engine_stats():
    sink = Sink()
    m = Metrics(sink, {"model": "m"})
    ready = sink.made[("fastdecode_ready", (("model", "m"),))]
    preempted = sink.made[("fastdecode_preemptions_total", (("model", "m"),))]
    m.flush({"ready": True, "preemptions": 3})
    assert ready.value == 1.0 and preempted.total == 3
    m.flush({"ready": False, "preemptions": 5})
    assert ready.value == 0.0 and preempted.total == 5     # counted once: the engine's total is cumulative
    m.flush({"ready": False, "preemptions": 5})
    assert preempted.total == 5
    m.flush({"preemptions": "garbage"})
    assert preempted.total == 5 and ready.value == 1.0     # no "ready" key: an engine without one is ready
