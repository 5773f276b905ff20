"""rpart.wire fast paths: hand-built messages parse exactly like protobuf's, garbage is refused."""
import platform

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from rpart.proto import rworker_pb2 as pb
from rpart.wire import decode_reply, encode_decode_request, encode_reply_o, keep_freed_memory, to_tensor


@pytest.mark.parametrize("b", [0, 1, 5, 300])
def test_encode_decode_request_equals_protobuf(b):
    rng = np.random.default_rng(b)
    q = rng.standard_normal((b, 9, 64)).astype(np.float32)
    k = rng.standard_normal((b, 3, 64)).astype(np.float16)
    v = k[::-1]                                             # not contiguous: encoded from a copy
    ids = list(range(2**39, 2**39 + b))
    want = pb.Request(call_id=2**50 + 3, decode=pb.Decode(layer=29, seq_ids=ids, q=to_tensor(q), k=to_tensor(k),
                                                         v=to_tensor(np.ascontiguousarray(v))))
    got = pb.Request.FromString(encode_decode_request(2**50 + 3, 29, ids, q, k, v))
    assert got == want
    bf = pb.Request.FromString(encode_decode_request(1, 0, ids, q.view(np.uint16)[..., ::2].copy(), k, k, "bfloat16"))
    assert bf.decode.q.dtype == "bfloat16" and list(bf.decode.q.shape) == [b, 9, 64]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reply_round_trip(dtype):
    o = np.random.default_rng(0).standard_normal((7, 9, 64)).astype(dtype)
    head = pb.Reply(call_id=11, kernel_s=0.25, handler_s=0.5, recv_ns=3, reply_ns=4)
    wire = encode_reply_o(head, o, np.dtype(dtype).name)
    full = pb.Reply.FromString(wire)                        # what a plain protobuf client sees
    assert full.o.data == o.tobytes() and tuple(full.o.shape) == o.shape and full.call_id == 11
    r = decode_reply(wire)
    assert (r.call_id, r.kernel_s, r.handler_s, r.recv_ns, r.reply_ns) == (11, 0.25, 0.5, 3, 4)
    assert bytes(r.o_data) == o.tobytes() and tuple(r.o.shape) == o.shape and r.o.dtype == np.dtype(dtype).name
    # fields in protobuf's own order, and an error reply without o
    r = decode_reply(full.SerializeToString())
    assert bytes(r.o_data) == o.tobytes() and r.kernel_s == 0.25
    r = decode_reply(pb.Reply(call_id=2, code=5, message="unknown").SerializeToString())
    assert (r.call_id, r.code, r.message, bytes(r.o_data)) == (2, 5, "unknown", b"")


@pytest.mark.parametrize("garbage", [b"\xff", b"\x22\x05ab", b"\x0a\x01", b"\x22\x03\x0a\x09x", bytes(range(256)),
                                     b"\x08" + b"\xff" * 11])
def test_decode_reply_refuses_garbage(garbage):
    with pytest.raises(DecodeError):
        decode_reply(garbage)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only")
def test_keep_freed_memory_tunes_glibc():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True                      # idempotent
