"""Fuzzing the R-worker (issue #17) on the wire: random bytes and mutated encodings of valid requests
sent to a live `python -m rworker` end only their own stream (when they do not parse) or get a reply
with a client-error status; the server keeps serving and a bystander's cache answers correctly
throughout. (The in-process fuzzing of its validation layer is test_fuzz_rworker.py.)
"""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpart.kernels import reference_attention
from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from fastdecode.ops.testing import local_fleet

from test_fuzz_rworker import C, LAYERS, HKV, D, call_ids, status
from test_rworker_server import RawClient


# ---- a live R-worker: bytes off the wire

SESSION = "/fastdecode.rworker.RWorker/Session"
CONFIGURE = pb.Request(call_id=1, configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                                                         kv_format="fp16")).SerializeToString()
CLIENT_CODES = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION,
                C.ALREADY_EXISTS}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with local_fleet(1, tmp_path_factory.mktemp("fuzz_rw"), kv_capacity="4M",
                     extra_args=("--max-message-size", "1M", "--max-sequences", "64")) as fleet:
        yield fleet.addresses[0]


def valid_requests(rng) -> list[bytes]:
    """One encoded request of each operation, to be mutated."""
    q = rng.standard_normal((2, 2 * HKV, D)).astype(np.float32)
    kv = rng.standard_normal((2, 2, HKV, D)).astype(np.float16)
    t = lambda x: pb.Tensor(data=x.tobytes(), shape=x.shape, dtype=x.dtype.name)  # noqa: E731
    ops = [dict(open=pb.Open(seq_ids=[1, 2])), dict(close=pb.Close(seq_ids=[1])),
           dict(prefill=pb.Prefill(layer=1, seq_ids=[1, 2], lens=[1, 1], k=t(kv[0]), v=t(kv[1]))),
           dict(decode=pb.Decode(layer=0, seq_ids=[1, 2], q=t(q), k=t(kv[0]), v=t(kv[1]))),
           dict(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, kv_format="fp16"))]
    return [pb.Request(call_id=7, **op).SerializeToString() for op in ops]


VALID_REQUESTS = valid_requests(np.random.default_rng(5))


def unknown_field(number: int, value: int | bytes) -> bytes:
    """A well-formed field this proto does not define: a varint, or a length-delimited run of bytes."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out + bytes([n]))
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


@st.composite
def payloads(draw):
    kind = draw(st.sampled_from(["bytes", "mutated", "mutated", "extended"]))
    if kind == "bytes":
        return draw(st.binary(max_size=600))
    if kind == "extended":   # parses: a valid request, its call id anywhere in uint64, unknown fields around it
        request = pb.Request.FromString(draw(st.sampled_from(VALID_REQUESTS)))
        request.call_id = draw(call_ids)
        extra = draw(st.lists(st.tuples(st.integers(16, (1 << 29) - 1),
                                        st.integers(0, (1 << 64) - 1) | st.binary(max_size=40)), max_size=3))
        return request.SerializeToString() + b"".join(unknown_field(n, v) for n, v in extra)
    base = bytearray(draw(st.sampled_from(VALID_REQUESTS)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "cut", "insert", "varint"]))
        at = draw(st.integers(0, len(base)))
        if how == "flip" and base:
            base[min(at, len(base) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif how == "cut":
            del base[at:at + draw(st.integers(1, 16))]
        elif how == "insert":
            base[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:   # a maximal varint: a length or value of 2**63 and more
            base[at:at] = b"\xff" * 9 + b"\x01"
    return bytes(base)


def session_of_bytes(address: str, messages: list[bytes]):
    """Sends raw messages on one stream; (the replies received, the stream's error or None)."""
    replies = []
    with grpc.insecure_channel(address) as ch:
        try:
            for r in ch.stream_stream(SESSION)(iter(messages), timeout=30):
                replies.append(pb.Reply.FromString(r))
        except grpc.RpcError as e:
            return replies, e
    return replies, None


def stats(address: str) -> pb.StatsReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)


def bystander_decodes_correctly(client: RawClient, ks, vs, rng) -> None:
    q = rng.standard_normal((1, 2 * HKV, D)).astype(np.float32)
    kv = rng.standard_normal((2, 1, HKV, D)).astype(np.float16)
    t = lambda x: pb.Tensor(data=x.tobytes(), shape=x.shape, dtype=x.dtype.name)  # noqa: E731
    reply = client.call(decode=pb.Decode(layer=0, seq_ids=[9], q=t(q), k=t(kv[0]), v=t(kv[1])))
    assert reply.code == 0, reply.message
    ks.append(kv[0][0])
    vs.append(kv[1][0])
    o = np.frombuffer(reply.o.data, np.float32).reshape(q.shape)
    np.testing.assert_allclose(o[0], reference_attention(q[0], np.array(ks), np.array(vs)), rtol=1e-4, atol=1e-4)


def test_random_bytes_end_only_their_stream_and_the_worker_keeps_serving(worker):
    rng = np.random.default_rng(11)
    bystander = RawClient(worker, configure=False)
    assert bystander.call(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                                                 kv_format="fp16")).code == 0
    assert bystander.call(open=pb.Open(seq_ids=[9])).code == 0
    ks, vs = [], []
    bystander_decodes_correctly(bystander, ks, vs, rng)
    outcomes = {"parsed": 0, "refused": 0}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(payloads())
    def check(payload):
        try:
            request = pb.Request.FromString(payload)
        except Exception:  # noqa: BLE001 -- protobuf's DecodeError: the server cannot parse it either
            request = None
        replies, error = session_of_bytes(worker, [CONFIGURE, payload])
        assert replies and replies[0].call_id == 1 and replies[0].code == 0, (replies, error)
        if request is None:
            outcomes["refused"] += 1
            assert len(replies) == 1 and error is not None, (payload, replies)
            assert error.code() in (C.INTERNAL, C.INVALID_ARGUMENT, C.UNKNOWN), error
        else:
            outcomes["parsed"] += 1
            assert error is None, (payload, error)
            assert len(replies) == 2 and replies[1].call_id == request.call_id, (payload, replies)
            assert status(replies[1]) in CLIENT_CODES, (request, replies[1].message)

    check()
    assert outcomes["parsed"] >= 10 and outcomes["refused"] >= 10, outcomes
    bystander_decodes_correctly(bystander, ks, vs, rng)
    deadline = time.monotonic() + 60          # every fuzzing stream has ended and freed its sequences
    while (stats(worker).connections, stats(worker).sequences) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    s = stats(worker)
    assert (s.connections, s.sequences) == (1, 1)
    assert s.kv_tokens == len(ks)
    bystander.close()
