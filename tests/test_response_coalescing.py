"""EngineHost merges the outputs of a request that queued up while the sender was busy into one
response: no token or character lost or repeated, the FINAL flag on the last, counts summed. The
outputs drained together go out from several send threads at once, each request on one of them."""
import threading
import time

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


class RecordingTransport(GatedTransport):
    """GatedTransport that also records which thread sent what, and how many sends overlapped."""

    def __init__(self, hold_s=0.05):
        super().__init__()
        self.hold_s, self.busy, self.most_at_once, self.threads = hold_s, 0, 0, []

    def send(self, sender, outputs, error, final):
        with self.cond:
            self.busy += 1
            self.most_at_once = max(self.most_at_once, self.busy)
            self.threads.append((sender, threading.get_ident()))
        time.sleep(self.hold_s)
        super().send(sender, outputs, error, final)
        with self.cond:
            self.busy -= 1


def submit_streams(host, engine, senders, n=1):
    get = {"text_input": np.array([b"hi"], dtype=np.object_), "stream": np.array([True]),
           "sampling_parameters": np.array([f'{{"n": {n}}}'.encode()], dtype=np.object_)}.get
    ids = [host.submit(s, get) for s in senders]
    return [[rid] if n == 1 else [f"{rid}.{i}" for i in range(n)] for rid in ids]


def test_outputs_drained_together_are_sent_from_several_threads_each_request_in_order():
    engine, transport = ManualEngine(), RecordingTransport()
    host = EngineHost(engine, transport, make_params=lambda d: d, cancel_poll_s=60, metrics_interval_s=60,
                      send_threads=4)
    try:
        ids = [rids[0] for rids in submit_streams(host, engine, ["s0", "s1", "s2", "s3", "s4"])]
        engine.callbacks[ids[0]](out(ids[0], [1], "a", n=1))
        assert transport.entered.wait(10)          # the sender is stuck sending s0's "a"
        for rid in ids:                            # meanwhile every request gets its last two tokens
            engine.callbacks[rid](out(rid, [2], "b", n=2))
        for rid in ids[1:]:
            engine.callbacks[rid](out(rid, [3], "c", True, "length", n=3))
        transport.gate.set()
        with transport.cond:
            assert transport.cond.wait_for(lambda: sum(final for *_, final in transport.sent) == 4, 30)
        engine.callbacks[ids[0]](out(ids[0], [3], "c", True, "length", n=3))
        with transport.cond:
            assert transport.cond.wait_for(lambda: sum(final for *_, final in transport.sent) == 5, 30)
        for sender in ("s0", "s1", "s2", "s3", "s4"):
            mine = [(o["text_output"][0].decode(), final) for s, o, _, final in transport.sent if s == sender]
            expected = [("a", False), ("b", False), ("c", True)] if sender == "s0" else [("bc", True)]
            assert mine == expected, (sender, mine)
        assert transport.most_at_once >= 2                   # s1..s4 and s0's "b" went out side by side
        assert len({t for _, t in transport.threads}) >= 2
        assert host.live_count() == 0
    finally:
        transport.gate.set()
        host.shutdown()


def test_choices_of_one_request_share_a_send_thread_and_one_thread_sends_all_when_asked():
    for threads in (4, 1):
        engine, transport = ManualEngine(), RecordingTransport(hold_s=0.01)
        transport.gate.set()
        host = EngineHost(engine, transport, make_params=lambda d: d, cancel_poll_s=60, metrics_interval_s=60,
                          send_threads=threads)
        try:
            requests = submit_streams(host, engine, ["x", "y", "z"], n=3)
            for step in (1, 2):
                for rids in requests:
                    for rid in rids:
                        engine.callbacks[rid](out(rid, [step], "t", step == 2, "length" if step == 2 else None,
                                                  n=step))
            with transport.cond:
                assert transport.cond.wait_for(lambda: sum(final for *_, final in transport.sent) == 3, 30)
            by_sender: dict[str, set] = {}
            for sender, ident in transport.threads:
                by_sender.setdefault(sender, set()).add(ident)
            assert all(len(idents) == 1 for idents in by_sender.values()), by_sender
            if threads == 1:
                assert transport.most_at_once == 1 and len(set().union(*by_sender.values())) == 1
            assert host.live_count() == 0
        finally:
            host.shutdown()
