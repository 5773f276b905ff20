"""R-worker reliability under load (#17): the KV shape cannot change under a connected session and
a store that fails to build breaks nobody; per-connection limits hold against a client that tries
to exceed them; connection numbers never overflow the stored ids. (A non-loopback bind and the
deployment files: test_rworker_exposure.py; keepalive: test_rworker_keepalive.py.)
"""
from __future__ import annotations

import contextlib
import queue
import time
from pathlib import Path

import grpc
import numpy as np

from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from rworker.refstore import NumpyKVStore
from rworker.server import RWorkerServer, ServerOptions
from rworker.connection import CONNECTION_BITS, ID_BITS, MAX_LAYERS, Connection, table_bytes


C = grpc.StatusCode
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16, kv_format="fp16")
OTHER_SHAPE = dict(num_layers=3, num_kv_heads=2, head_dim=16, kv_format="fp16")
H = 4
REPO = Path(__file__).resolve().parent.parent


def code(reply) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code)


class Client:
    """One Session stream; call() sends one request and waits for its reply."""

    def __init__(self, address: str, shape: dict | None = SHAPE) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = pb_grpc.RWorkerStub(self.channel).Session(iter(self.requests.get, None))
        self.next_id = 0
        if shape is not None:
            r = self.configure(shape)
            assert r.code == 0, r.message

    def call(self, **op) -> pb.Reply:
        self.next_id += 1
        self.requests.put(pb.Request(call_id=self.next_id, **op))
        reply = next(self.replies)
        assert reply.call_id == self.next_id
        return reply

    def configure(self, shape: dict) -> pb.Reply:
        return self.call(configure=pb.Configure(**shape))

    def open(self, ids) -> pb.Reply:
        return self.call(open=pb.Open(seq_ids=list(ids)))

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def tensor(a: np.ndarray) -> pb.Tensor:
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=a.dtype.name)


def fill_and_decode(client: Client, seq_id: int, seed: int, shape: dict = SHAPE, tokens: int = 5) -> np.ndarray:
    """Prefill `tokens` tokens of every layer, then decode one on layer 0; checks o against numpy."""
    rng = np.random.default_rng(seed)
    hkv, d = shape["num_kv_heads"], shape["head_dim"]
    ks = vs = None
    for layer in range(shape["num_layers"]):
        k = rng.standard_normal((tokens, hkv, d)).astype(np.float16)
        v = rng.standard_normal((tokens, hkv, d)).astype(np.float16)
        r = client.call(prefill=pb.Prefill(layer=layer, seq_ids=[seq_id], lens=[tokens], k=tensor(k), v=tensor(v)))
        assert r.code == 0, r.message
        if layer == 0:
            ks, vs = k, v
    q = rng.standard_normal((1, H, d)).astype(np.float32)
    k1 = rng.standard_normal((1, hkv, d)).astype(np.float16)
    v1 = rng.standard_normal((1, hkv, d)).astype(np.float16)
    r = client.call(decode=pb.Decode(layer=0, seq_ids=[seq_id], q=tensor(q), k=tensor(k1), v=tensor(v1)))
    assert r.code == 0, r.message
    o = np.frombuffer(r.o.data, np.float32).reshape(tuple(r.o.shape))[0]
    kk = np.repeat(np.concatenate([ks, k1]).astype(np.float32), H // hkv, axis=1)
    vv = np.repeat(np.concatenate([vs, v1]).astype(np.float32), H // hkv, axis=1)
    s = np.einsum("hd,thd->ht", q[0], kk) / np.sqrt(d)
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(o, np.einsum("ht,thd->hd", p / p.sum(1, keepdims=True), vv), rtol=1e-4, atol=1e-5)
    return o


def stats(address: str) -> pb.StatsReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def in_process(store_factory=NumpyKVStore, **opts):
    """An RWorkerServer in this process (its service is reachable for white-box checks)."""
    server = RWorkerServer(ServerOptions(listen="127.0.0.1:0", kv_capacity=4 << 20, threads=1, **opts),
                           store_factory)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


class CountingStore:
    """A store that holds no KV: for limits checked before any allocation."""

    isa = "counting"

    def __init__(self, **kwargs) -> None:
        self.ids: set[int] = set()

    def create(self, ids) -> None:
        self.ids.update(int(i) for i in ids)

    def free(self, ids) -> None:
        self.ids.difference_update(int(i) for i in ids)

    def stats(self) -> dict:
        return {"sequences": len(self.ids)}


# ---- the KV shape (item 2) --------------------------------------------------------------
def test_another_shape_is_refused_while_a_session_uses_the_store():
    with in_process() as server:
        idle = Client(server.address)                    # configured, no sequence yet
        other = Client(server.address, shape=None)
        r = other.configure(OTHER_SHAPE)
        assert code(r) == C.FAILED_PRECONDITION, r.message
        assert "layers=2" in r.message and "layers=3" in r.message, r.message   # both shapes named
        assert idle.open([1]).code == 0                  # the idle S-worker's next calls still work
        fill_and_decode(idle, 1, seed=0)
        assert code(other.open([1])) == C.FAILED_PRECONDITION                    # not configured
        idle.close()
        wait_for(lambda: stats(server.address).connections == 1, what="the idle session to end")
        assert other.configure(OTHER_SHAPE).code == 0    # nobody uses the old shape: it may change
        assert other.open([1]).code == 0
        fill_and_decode(other, 1, seed=1, shape=OTHER_SHAPE)
        other.close()


def test_a_store_that_fails_to_build_leaves_no_broken_store():
    built = []

    def factory(**kwargs):
        built.append(kwargs["head_dim"])
        if kwargs["head_dim"] == 64:
            raise ValueError("cannot build a store for head_dim 64")
        return NumpyKVStore(**kwargs)

    bad_shape = {**SHAPE, "head_dim": 64}
    with in_process(factory) as server:
        tenant = Client(server.address)                                           # configured, idle
        prober = Client(server.address, shape=None)
        assert code(prober.configure(bad_shape)) == C.FAILED_PRECONDITION        # the tenant's shape is in use
        assert built == [16]                                                      # nothing rebuilt
        assert tenant.open([1]).code == 0
        fill_and_decode(tenant, 1, seed=2)
        tenant.close()
        wait_for(lambda: stats(server.address).connections == 1, what="the tenant's session to end")

        assert prober.configure(SHAPE).code == 0                                  # alone now: it may reshape
        r = prober.configure(bad_shape)                                           # and that build fails
        assert code(r) == C.INVALID_ARGUMENT and "head_dim 64" in r.message, r.message
        r = prober.open([1])
        assert code(r) == C.FAILED_PRECONDITION, r.message                         # refused cleanly, not INTERNAL
        assert stats(server.address).sequences == 0
        late = Client(server.address)                                             # a good shape builds a store
        assert late.open([1]).code == 0
        fill_and_decode(late, 1, seed=3)
        assert prober.configure(SHAPE).code == 0 and prober.open([1]).code == 0
        fill_and_decode(prober, 1, seed=4)
        late.close()
        prober.close()


# ---- connection numbers (item 9) --------------------------------------------------------
def test_connection_numbers_wrap_below_the_id_limit_and_skip_those_in_use():
    top = (1 << CONNECTION_BITS) - 1
    assert Connection("x", top).base + (1 << ID_BITS) - 1 < 1 << 63             # the largest stored id fits int64
    with in_process() as server:
        first = Client(server.address)                                          # number 1
        server.service.next_number = top                                        # as after 2**23 - 2 sessions
        last = Client(server.address)                                           # the largest number
        wrapped = Client(server.address)                                        # wraps; 1 is in use
        assert sorted(server.service.connections) == [1, 2, top]
        outputs = []
        for seed, client in enumerate((first, last, wrapped)):
            assert client.open([7]).code == 0                                   # the same client id on each
            outputs.append(fill_and_decode(client, 7, seed=10 + seed))
        assert stats(server.address).sequences == 3
        assert not np.allclose(outputs[0], outputs[1])                          # three distinct caches
        for client in (first, last, wrapped):
            client.close()
        wait_for(lambda: stats(server.address).sequences == 0, what="sequences freed")


# ---- per-connection limits (item 5) -----------------------------------------------------
def test_too_many_layers_are_refused_and_others_keep_serving():
    with in_process() as server:
        tenant = Client(server.address)
        assert tenant.open([1]).code == 0
        greedy = Client(server.address, shape=None)
        r = greedy.configure({**SHAPE, "num_layers": MAX_LAYERS + 1})
        assert code(r) == C.INVALID_ARGUMENT and "num_layers" in r.message, r.message
        fill_and_decode(tenant, 1, seed=5)
        greedy.close()
        tenant.close()


def test_sequences_per_connection_are_limited():
    with in_process(max_sequences_per_connection=4) as server:
        greedy, other = Client(server.address), Client(server.address)
        r = greedy.open(range(5))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-sequences-per-connection" in r.message, r.message
        assert stats(server.address).sequences == 0                             # none of them opened
        assert greedy.open(range(4)).code == 0
        assert code(greedy.open([4])) == C.RESOURCE_EXHAUSTED
        assert other.open(range(4)).code == 0                                   # another tenant has its own quota
        fill_and_decode(other, 3, seed=6)
        assert greedy.call(close=pb.Close(seq_ids=[0])).code == 0
        assert greedy.open([4]).code == 0
        assert stats(server.address).sequences == 8
        greedy.close()
        other.close()


def test_table_memory_outside_the_kv_pool_is_limited():
    with in_process(max_table_bytes=table_bytes(SHAPE["num_layers"], 6)) as server:
        greedy, other = Client(server.address), Client(server.address)
        r = greedy.open(range(7))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-table-memory" in r.message, r.message
        assert greedy.open(range(4)).code == 0
        assert other.open([1, 2]).code == 0
        assert code(other.open([3])) == C.RESOURCE_EXHAUSTED
        fill_and_decode(other, 1, seed=7)
        greedy.close()
        wait_for(lambda: stats(server.address).sequences == 2, what="the greedy client's sequences freed")
        assert other.open([3]).code == 0
        other.close()


def test_many_layers_times_many_sequences_cannot_exhaust_memory_by_default():
    """4096 layers x 65536 sequences would be ~8.6 GB of block tables outside --kv-capacity."""
    huge = {**SHAPE, "num_layers": MAX_LAYERS, "num_kv_heads": 1, "head_dim": 1}
    with in_process(CountingStore) as server:
        greedy, other = Client(server.address, huge), Client(server.address, huge)
        r = greedy.open(range(1 << 16))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-table-memory" in r.message, r.message
        assert other.open(range(100)).code == 0
        assert stats(server.address).sequences == 100
        greedy.close()
        other.close()
