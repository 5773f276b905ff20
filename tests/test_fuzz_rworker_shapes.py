"""Fuzzing the R-worker (issue #17), in process: wire tensor shapes whose element count wraps int64
or that have too many dimensions, and Configure over the whole int32 range of KV shapes. The
oracle (Fault, check_answer, Side) is test_fuzz_rworker.py's."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpart.kernels import reference_attention
from rpart.proto import rworker_pb2 as pb
from rworker.connection import CallError, tensor_to_numpy
from rworker.service import RWorkerService

from test_fuzz_rworker import C, FUZZ, Fault, check_answer, Side


@pytest.mark.parametrize("shape, data", [
    ((1 << 59, 2, 16), b""),                        # 2**64 elements: the int64 count wrapped to 0 bytes expected
    (((1 << 59) + 1, 2, 16), bytes(64)),            # wrapped to the 32 elements sent
    ((0, 1 << 58, 16), b""),                        # no elements, but 2**63 bytes without the zero
    ((0, (1 << 63) - 1, 16), b""),
], ids=["wraps to 0", "wraps to the bytes sent", "zero rows, 2**63 bytes", "zero rows, int64 max"])
def test_a_wire_shape_too_large_for_an_array_is_refused_naming_it(shape, data):
    """Found by the fuzzing above: the int64 product of such a shape wrapped around and passed the
    byte count check, or had a zero in it; numpy's reshape then refused it, in numpy's words."""
    with pytest.raises(CallError, match=r"^k: shape \(.*\) is too large for an array"):
        tensor_to_numpy(pb.Tensor(data=data, shape=shape, dtype="float16"), "k")
    ok = tensor_to_numpy(pb.Tensor(data=b"", shape=(0, (1 << 62) - 1), dtype="float16"), "k")   # just fits
    assert ok.shape == (0, (1 << 62) - 1)


def test_a_wire_shape_of_many_dimensions_is_refused_naming_it():
    with pytest.raises(CallError, match=r"^v: shape \(1, 1, .*\) has 40 dimensions"):
        tensor_to_numpy(pb.Tensor(data=bytes(4), shape=[1] * 40, dtype="float32"), "v")


CONFIGURE_EDGES = st.sampled_from([-(1 << 31), -1, 0, 1, 2, 3, 16, 64, 1024, 1025, 4096, 4097, (1 << 31) - 1])


@FUZZ
@given(layers=CONFIGURE_EDGES | st.integers(-(1 << 31), (1 << 31) - 1),
       heads=CONFIGURE_EDGES | st.integers(1, 64), head_dim=CONFIGURE_EDGES | st.integers(1, 256),
       kv_format=st.sampled_from(["fp16", "int4"]) | st.text(max_size=5))
def test_configure_over_int32_builds_a_working_store_or_says_why(layers, heads, head_dim, kv_format):
    """Shapes within the documented limits get a store (the pool holds one block of the largest);
    then a one-token prefill and a decode on the last layer work. Others are refused, naming why."""
    service = RWorkerService(260 << 20, threads=1)
    try:
        side = Side(service, "fuzz")
        faults = []
        if not (1 <= layers <= 4096 and 1 <= heads <= 4096 and 1 <= head_dim <= 1024):
            faults.append(Fault(C.INVALID_ARGUMENT, r"bad KV shape"))
        if kv_format not in ("fp16", "int4"):
            faults.append(Fault(C.INVALID_ARGUMENT, r"unknown kv_format"))
        if kv_format == "int4" and head_dim % 16:
            faults.append(Fault(C.INVALID_ARGUMENT, r"int4 KV needs head_dim % 16 == 0"))
        reply = side.call(configure=pb.Configure(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                                                 kv_format=kv_format))
        check_answer(reply, faults, (layers, heads, head_dim, kv_format))
        if faults:
            assert service.store is None
            reply = side.call(open=pb.Open(seq_ids=[0]))
            check_answer(reply, [Fault(C.FAILED_PRECONDITION, r"Configure must be the first call")], "unconfigured")
            return
        if heads * head_dim > 1 << 16:
            return                     # built and accepted; the round trip below would move megabytes
        rng = np.random.default_rng(layers ^ heads ^ head_dim)
        kv = rng.standard_normal((2, 1, heads, head_dim)).astype(np.float16)
        q = rng.standard_normal((1, heads, head_dim)).astype(np.float32)
        assert side.call(open=pb.Open(seq_ids=[0])).code == 0
        t = [pb.Tensor(data=x.tobytes(), shape=x.shape, dtype="float16") for x in kv]
        reply = side.call(prefill=pb.Prefill(layer=layers - 1, seq_ids=[0], lens=[1], k=t[0], v=t[1]))
        assert reply.code == 0, reply.message
        reply = side.call(decode=pb.Decode(layer=layers - 1, seq_ids=[0], k=t[0], v=t[1],
                                           q=pb.Tensor(data=q.tobytes(), shape=q.shape, dtype="float32")))
        assert reply.code == 0, reply.message
        o = np.frombuffer(reply.o.data, np.float32).reshape(q.shape)
        k2, v2 = np.concatenate([kv[0], kv[0]]), np.concatenate([kv[1], kv[1]])
        if kv_format == "fp16":
            np.testing.assert_allclose(o[0], reference_attention(q[0], k2, v2), rtol=1e-4, atol=1e-4)
        else:   # int4: against the cache as stored (dequantized)
            np.testing.assert_allclose(o[0], reference_attention(q[0], *service.store.read(side.conn.base, layers - 1)),
                                       rtol=1e-4, atol=1e-4)
    finally:
        if service.store is not None:
            service.store.close()
