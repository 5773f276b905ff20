"""EngineHost merges the outputs of a request that queued up while the sender was busy into one
response: no token or character lost or repeated, the FINAL flag on the last, counts summed."""
import threading

import numpy as np

from fastdecode.engine.sequence import RequestOutput
from python_backend.host import EngineHost, coalesce


def out(rid, tokens, text, finished=False, reason=None, n=0):
    return RequestOutput(rid, tokens, text, finished, reason, num_prompt_tokens=3, num_output_tokens=n)


def test_coalesce_merges_per_request_in_order():
    batch = [out("a", [1], "x", n=1), out("b", [7], "p", n=1), out("a", [2], "", n=2),
             out("a", [3], "yz", True, "length", n=3), out("b", [8], "q", n=2)]
    merged = {o.request_id: o for o in coalesce(batch)}
    assert [o.request_id for o in coalesce(batch)] == ["a", "b"]
    a, b = merged["a"], merged["b"]
    assert (a.token_ids, a.text, a.finished, a.finish_reason, a.num_output_tokens) == ([1, 2, 3], "xyz", True, "length", 3)
    assert (b.token_ids, b.text, b.finished, b.num_output_tokens) == ([7, 8], "pq", False, 2)
    assert batch[0].token_ids == [1] and batch[0].text == "x"          # the engine's objects are not modified


def test_coalesce_keeps_every_tokens_logprobs():
    a1, a2 = out("a", [1], "x", n=1), out("a", [2, 3], "yz", n=3)
    a1.logprobs, a2.logprobs = ["lp1"], ["lp2", "lp3"]
    (merged,) = coalesce([a1, a2])
    assert merged.token_ids == [1, 2, 3] and merged.logprobs == ["lp1", "lp2", "lp3"]
    assert a1.logprobs == ["lp1"]


def test_coalesce_leaves_single_outputs_alone():
    batch = [out("a", [1], "x", n=1), out("b", [2], "y", n=1)]
    assert coalesce(batch) == batch
    assert coalesce([]) == []


class GatedTransport:
    """send() blocks until the gate opens: the sender thread is busy while the engine goes on."""

    def __init__(self):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sent = []
        self.cond = threading.Condition()

    def send(self, sender, outputs, error, final):
        self.entered.set()
        self.gate.wait(30)
        with self.cond:
            self.sent.append((sender, outputs, error, final))
            self.cond.notify_all()

    def is_cancelled(self, sender):
        return False

    def unload(self):
        pass

    def log(self, level, message):
        pass


class ManualEngine:
    max_model_len = 100

    def __init__(self):
        self.callbacks = {}
        self.healthy = True

    def add_request(self, prompt, params, request_id=None, on_output=None):
        self.callbacks[request_id] = on_output
        return request_id

    def abort(self, request_id):
        pass

    def stop(self):
        pass

    def stats(self):
        return {}


def test_outputs_queued_behind_a_busy_sender_go_out_as_one_response():
    engine, transport = ManualEngine(), GatedTransport()
    host = EngineHost(engine, transport, make_params=lambda d: d, cancel_poll_s=60, metrics_interval_s=60)
    try:
        get = {"text_input": np.array([b"hi"], dtype=np.object_), "stream": np.array([True]),
               "return_num_output_tokens": np.array([True])}.get
        rid = host.submit("s1", get)
        emit = engine.callbacks[rid]
        emit(out(rid, [1], "a", n=1))
        assert transport.entered.wait(10)          # the sender is stuck sending "a"
        emit(out(rid, [2], "b", n=2))
        emit(out(rid, [3], "c", n=3))
        emit(out(rid, [4], "d", True, "length", n=4))
        transport.gate.set()
        with transport.cond:
            assert transport.cond.wait_for(lambda: any(final for *_, final in transport.sent), 30)
        texts = [o["text_output"][0].decode() for _, o, _, _ in transport.sent]
        counts = [int(o["num_output_tokens"][0]) for _, o, _, _ in transport.sent]
        assert texts == ["a", "bcd"] and counts == [1, 3]
        assert [final for *_, final in transport.sent] == [False, True]
        assert host.live_count() == 0
    finally:
        transport.gate.set()
        host.shutdown()
