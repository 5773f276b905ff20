"""Fuzzing the R-worker (issue #17): its validation layer in process. (Its wire on a live server is
test_fuzz_rworker_wire.py; shapes and Configure at their limits, test_fuzz_rworker_shapes.py.)

In process, against the real kernel store: every field of every call is drawn over its whole range
(ids, lengths and shape dimensions up to +-2**63, layers and KV shapes over int32, call ids over
uint64, dtype names, byte lengths, NaN/inf values). An oracle lists the faults of each call as the
proto and rworker/service.py document them; the call must be answered OK exactly when it has none,
and otherwise with the status of one of its faults and a message naming it. The KV of every open
sequence, the fuzzing connection's and a bystander connection's, is read back after every call and
must hold exactly what the accepted calls appended; an accepted decode's o must match the float64
reference attention.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpart.kernels import reference_attention
from rpart.proto import rworker_pb2 as pb
from rworker.connection import MAX_IDS_PER_CALL
from rworker.service import RWorkerService
from rpart.wire import bf16_to_f32, f32_to_bf16


C = grpc.StatusCode
LAYERS, HKV, D = 2, 2, 16
MAX_SEQUENCES = 12
FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

INT64_EDGES = [-(1 << 63), -(1 << 40), -(1 << 31) - 1, -(1 << 31), -1, 0, 1, (1 << 31) - 1, 1 << 31, 1 << 32,
               (1 << 40) - 1, 1 << 40, 1 << 62, (1 << 63) - 1]
INT32_EDGES = [-(1 << 31), -1, 0, 1, LAYERS - 1, LAYERS, 4096, 4097, (1 << 31) - 1]
UINT64_EDGES = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
int64s = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(1 << 63), (1 << 63) - 1))
int32s = st.one_of(st.sampled_from(INT32_EDGES), st.integers(-(1 << 31), (1 << 31) - 1))
call_ids = st.one_of(st.sampled_from(UINT64_EDGES), st.integers(0, (1 << 64) - 1))
WIRE_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2}
odd_dtypes = st.one_of(st.sampled_from(["", "float64", "int8", "FLOAT16", "float16 ", "bfloat16\x00", "complex64"]),
                       st.text(max_size=12).filter(lambda s: s not in WIRE_ITEMSIZE))


@dataclass(frozen=True)
class Fault:
    code: grpc.StatusCode
    message: str          # a regex the reply's message must match

    def matches(self, code: grpc.StatusCode, message: str) -> bool:
        return code == self.code and re.search(self.message, message, re.IGNORECASE) is not None


def status(reply: pb.Reply) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code)


def check_answer(reply: pb.Reply, faults: list[Fault], what) -> None:
    code = status(reply)
    if not faults:
        assert code == C.OK, (what, reply.message)
    else:
        assert any(f.matches(code, reply.message) for f in faults), (what, code, reply.message, faults)


# ---- wire tensors: what the client sends, and what the oracle makes of it

def encode(x: np.ndarray, dtype: str) -> tuple[bytes, np.ndarray]:
    """x (float32) as wire bytes of `dtype`, and the float32 values the R-worker will read from them."""
    if dtype == "float16":
        with np.errstate(over="ignore"):           # beyond fp16: inf, as the client would send it
            h = x.astype(np.float16)
        return h.tobytes(), h.astype(np.float32)
    if dtype == "bfloat16":
        b = f32_to_bf16(x)
        return b.tobytes(), bf16_to_f32(b)
    return x.astype(np.float32).tobytes(), x.astype(np.float32)


def tensor_faults(t: pb.Tensor, name: str, want: tuple | None) -> tuple[list[Fault], np.ndarray | None]:
    """The faults of a wire tensor that should have shape `want` (None: any), else its float32 values
    (flat where `want` is None)."""
    itemsize = WIRE_ITEMSIZE.get(t.dtype)
    if itemsize is None:
        return [Fault(C.INVALID_ARGUMENT, rf"^{name}: unknown dtype")], None
    shape = tuple(t.shape)
    if any(n < 0 for n in shape):
        return [Fault(C.INVALID_ARGUMENT, rf"^{name}: negative dimension")], None
    if math.prod(n for n in shape if n) * itemsize >= 1 << 63:    # numpy cannot shape an array so
        return [Fault(C.INVALID_ARGUMENT, rf"^{name}: shape .* is too large")], None
    if math.prod(shape) * itemsize != len(t.data):
        return [Fault(C.INVALID_ARGUMENT, rf"^{name}: {len(t.data)} bytes for shape")], None
    if want is not None and shape != want:
        return [Fault(C.INVALID_ARGUMENT, rf"^{name}: .*shape")], None
    raw = np.frombuffer(t.data, {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}[t.dtype])
    values = bf16_to_f32(raw) if t.dtype == "bfloat16" else raw.astype(np.float32)
    return [], values if want is None else values.reshape(want)


def value_faults(name: str, x: np.ndarray, is_q: bool) -> list[Fault]:
    """q must be finite; k and v finite and inside the fp16 range (they are stored as fp16)."""
    if is_q:
        return [] if np.isfinite(x).all() else [Fault(C.INVALID_ARGUMENT, r"^q contains NaN")]
    bad = ~np.isfinite(x) | (np.abs(x) >= 65520)
    return [Fault(C.INVALID_ARGUMENT, rf"^{name} contains NaN")] if bad.any() else []


@st.composite
def wire_tensors(draw, shape: tuple, rng_seed: int):
    """A tensor of `shape` (valid most of the time), or one of many malformed variants of it."""
    rng = np.random.default_rng(rng_seed)
    dtype = draw(st.sampled_from(sorted(WIRE_ITEMSIZE)))
    n = math.prod(shape)
    x = (rng.standard_normal(n) * draw(st.sampled_from([0.1, 1.0, 4.0]))).astype(np.float32)
    shape = list(shape)
    fault = draw(st.sampled_from(["none"] * 6 + ["dtype", "negative", "huge", "wrap", "bytes", "rank", "rows",
                                                 "value", "many_dims"]))
    if fault == "value" and n:
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e6, -7e4]))
    data, _ = encode(x, dtype)
    if fault == "dtype":
        dtype = draw(odd_dtypes)
    elif fault == "negative":
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from([-1, -(1 << 31), -(1 << 63)]))
    elif fault == "huge":
        # sizes whose int64 product wraps around (to 0, or to the byte count sent) included
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(
            [1 << 31, 1 << 32, 1 << 58, 1 << 62, (1 << 63) - 1]))
    elif fault == "wrap":   # rows + 2**64 / (the other dims' product): the int64 element count wraps to n
        rest = math.prod(shape[1:])
        if rest >= 4 and rest & (rest - 1) == 0:
            shape[0] += (1 << 64) // rest
    elif fault == "bytes":
        data = data[:-draw(st.integers(1, 3))] if data and draw(st.booleans()) else data + b"\0" * draw(
            st.integers(1, 3))
    elif fault == "rank":
        shape = shape + [1] if draw(st.booleans()) else shape[1:]
    elif fault == "rows":                        # well-formed, one row too many
        data += b"\0" * (math.prod(shape[1:]) * WIRE_ITEMSIZE[dtype])
        shape[0] += 1
    elif fault == "many_dims":
        shape = shape + [1] * draw(st.integers(30, 40))
    return pb.Tensor(data=data, shape=shape, dtype=dtype)


# ---- the client-side model of what the store holds

class Side:
    """One connection and the KV its client expects: id -> per-layer lists of fp16 [Hkv, D] rows."""

    def __init__(self, service: RWorkerService, name: str) -> None:
        self.service = service
        self.conn = service._connect(name)
        self.kv: dict[int, tuple[list[list], list[list]]] = {}
        self.next_call = 0

    def call(self, call_id: int | None = None, **op) -> pb.Reply:
        self.next_call += 1
        call_id = self.next_call if call_id is None else call_id
        answer = self.service._call(self.conn, pb.Request(call_id=call_id, **op))
        reply = pb.Reply.FromString(answer) if isinstance(answer, bytes) else answer
        assert reply.call_id == call_id
        return reply

    def append(self, seq: int, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        ks, vs = self.kv[seq]
        ks[layer].extend(k.astype(np.float16))
        vs[layer].extend(v.astype(np.float16))

    def cache(self, seq: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        ks, vs = self.kv[seq]
        empty = np.zeros((0, HKV, D), np.float16)
        return (np.array(ks[layer]) if ks[layer] else empty), (np.array(vs[layer]) if vs[layer] else empty)

    def check_store(self) -> None:
        """The store holds exactly this client's KV (read back through the kernel)."""
        store = self.service.store
        for seq in self.kv:
            for layer in range(LAYERS):
                k, v = store.read(self.conn.base + seq, layer)
                want_k, want_v = self.cache(seq, layer)
                np.testing.assert_array_equal(k, want_k.astype(np.float32), err_msg=f"seq {seq} layer {layer} K")
                np.testing.assert_array_equal(v, want_v.astype(np.float32), err_msg=f"seq {seq} layer {layer} V")


def id_faults(ids: list[int]) -> list[Fault]:
    if len(ids) > MAX_IDS_PER_CALL:
        return [Fault(C.INVALID_ARGUMENT, r"sequence ids in one call")]
    if any(not 0 <= s < 1 << 40 for s in ids):
        return [Fault(C.INVALID_ARGUMENT, r"sequence ids must be in \[0, 2\*\*40\)")]
    return []


def lookup_faults(side: Side, ids: list[int]) -> list[Fault]:
    faults = []
    if any(s not in side.kv for s in ids):
        faults.append(Fault(C.NOT_FOUND, r"unknown sequence id"))
    if len(set(ids)) != len(ids):
        faults.append(Fault(C.INVALID_ARGUMENT, r"appears twice"))
    return faults


def layer_faults(layer: int) -> list[Fault]:
    return [] if 0 <= layer < LAYERS else [Fault(C.INVALID_ARGUMENT, rf"layer {layer} out of range")]


# ---- drawing calls

OPEN_IDS = [0, 1, 2, 3, 4, 5, 6, 7, (1 << 40) - 1]


def draw_ids(data, side: Side) -> list[int]:
    """Open ids of this side mostly; sometimes duplicates, unknown ids, any int64, or too many."""
    held = sorted(side.kv)
    fine = st.lists(st.sampled_from(held), unique=True, max_size=4) if held else st.just([])
    return data.draw(st.one_of(
        fine, fine, fine,
        fine.map(lambda ids: ids + ids[:1]),
        st.lists(st.sampled_from(OPEN_IDS) | int64s, max_size=4),
        st.just(list(range(MAX_IDS_PER_CALL + 1)))))


def do_open(data, side: Side, bystander: Side) -> None:
    ids = data.draw(st.one_of(st.lists(st.sampled_from(OPEN_IDS), max_size=4),
                              st.lists(st.sampled_from(OPEN_IDS) | int64s, max_size=3),
                              st.just(list(range(MAX_IDS_PER_CALL + 1)))))
    faults = id_faults(ids)
    if len(set(ids)) != len(ids) or set(ids) & set(side.kv):
        faults.append(Fault(C.ALREADY_EXISTS, r"already open"))
    if len(side.kv) + len(bystander.kv) + len(ids) > MAX_SEQUENCES:
        faults.append(Fault(C.RESOURCE_EXHAUSTED, r"--max-sequences"))
    reply = side.call(open=pb.Open(seq_ids=ids))
    check_answer(reply, faults, ("open", ids[:8]))
    if not faults:
        for s in ids:
            side.kv[s] = ([[] for _ in range(LAYERS)], [[] for _ in range(LAYERS)])


def do_close(data, side: Side) -> None:
    ids = draw_ids(data, side)
    reply = side.call(close=pb.Close(seq_ids=ids))
    faults = id_faults(ids)
    check_answer(reply, faults, ("close", ids[:8]))
    if not faults:
        for s in ids:
            side.kv.pop(s, None)


def do_prefill(data, side: Side) -> None:
    ids = draw_ids(data, side)
    layer = data.draw(st.integers(0, LAYERS - 1) | int32s)
    n = len(ids) if len(ids) <= 8 else 1        # too many ids: refused whatever the lengths
    lens = data.draw(st.one_of(st.lists(st.integers(0, 5), min_size=n, max_size=n),
                               st.lists(st.integers(0, 5) | int64s, min_size=n, max_size=n),
                               st.lists(st.integers(0, 5), max_size=5)))
    faults = id_faults(ids) + layer_faults(layer)
    if len(lens) != len(ids) or any(not 0 <= n <= (1 << 31) - 1 for n in lens):
        faults.append(Fault(C.INVALID_ARGUMENT, r"prefill: need one length"))
    rows = sum(n for n in lens if 0 <= n <= 5)
    seed = data.draw(st.integers(0, 2**32 - 1))
    k = data.draw(wire_tensors((rows, HKV, D), seed))
    v = data.draw(wire_tensors((rows, HKV, D), seed + 1))
    want = (sum(lens), HKV, D)
    k_faults, kx = tensor_faults(k, "k", want)
    v_faults, vx = tensor_faults(v, "v", want)
    faults += k_faults + v_faults
    if kx is not None and vx is not None:
        faults += value_faults("k", kx, False) + value_faults("v", vx, False) + lookup_faults(side, ids)
    reply = side.call(prefill=pb.Prefill(layer=layer, seq_ids=ids, lens=lens, k=k, v=v))
    check_answer(reply, faults, ("prefill", layer, ids[:8], lens[:8], k.shape, k.dtype, v.shape, v.dtype))
    if not faults:
        at = 0
        for s, n in zip(ids, lens):
            side.append(s, layer, kx[at:at + n], vx[at:at + n])
            at += n


def do_decode(data, side: Side) -> None:
    ids = draw_ids(data, side)
    layer = data.draw(st.integers(0, LAYERS - 1) | int32s)
    rows = len(ids) if len(ids) <= 8 else 1
    heads = data.draw(st.sampled_from([HKV, 2 * HKV, 4 * HKV, 64 * HKV]) | st.sampled_from([0, 1, 3, 65 * HKV]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    q = data.draw(wire_tensors((rows, heads, D), seed))
    k = data.draw(wire_tensors((rows, HKV, D), seed + 1))
    v = data.draw(wire_tensors((rows, HKV, D), seed + 2))
    faults = id_faults(ids) + layer_faults(layer)
    q_faults, qx = tensor_faults(q, "q", None)               # any shape: its own checks follow
    faults += q_faults
    q_shape = tuple(q.shape)
    if qx is not None and (len(q_shape) != 3 or q_shape[0] != len(ids) or q_shape[2] != D or q_shape[1] % HKV):
        faults.append(Fault(C.INVALID_ARGUMENT, r"^q: shape"))
    elif qx is not None and not 1 <= q_shape[1] <= 64 * HKV:
        faults.append(Fault(C.INVALID_ARGUMENT, r"^q must have shape"))
    elif qx is not None:
        qx = qx.reshape(q_shape)
    k_faults, kx = tensor_faults(k, "k", (len(ids), HKV, D))
    v_faults, vx = tensor_faults(v, "v", (len(ids), HKV, D))
    faults += k_faults + v_faults
    if qx is not None and kx is not None and vx is not None:
        faults += (value_faults("q", qx, True) + value_faults("k", kx, False) + value_faults("v", vx, False)
                   + lookup_faults(side, ids))
    reply = side.call(decode=pb.Decode(layer=layer, seq_ids=ids, q=q, k=k, v=v))
    check_answer(reply, faults, ("decode", layer, ids[:8], q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype))
    if faults:
        return
    assert tuple(reply.o.shape) == qx.shape and reply.o.dtype == q.dtype
    o = np.frombuffer(reply.o.data, {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}[q.dtype])
    o = (bf16_to_f32(o) if q.dtype == "bfloat16" else o.astype(np.float32)).reshape(qx.shape)
    tol = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}[q.dtype]
    for i, s in enumerate(ids):
        side.append(s, layer, kx[i:i + 1], vx[i:i + 1])
        ck, cv = side.cache(s, layer)
        np.testing.assert_allclose(o[i], reference_attention(qx[i], ck, cv), rtol=tol, atol=tol)


def do_configure(data, side: Side) -> None:
    c = pb.Configure(num_layers=data.draw(st.just(LAYERS) | int32s), num_kv_heads=data.draw(st.just(HKV) | int32s),
                     head_dim=data.draw(st.just(D) | int32s),
                     kv_format=data.draw(st.sampled_from(["fp16", "int4", "", "fp8", "FP16"]) | st.text(max_size=6)))
    faults = []
    if not (1 <= c.num_layers <= 4096 and 1 <= c.num_kv_heads <= 4096 and 1 <= c.head_dim <= 1024):
        faults.append(Fault(C.INVALID_ARGUMENT, r"bad KV shape"))
    if c.kv_format not in ("fp16", "int4"):
        faults.append(Fault(C.INVALID_ARGUMENT, r"unknown kv_format"))
    if (c.num_layers, c.num_kv_heads, c.head_dim, c.kv_format) != (LAYERS, HKV, D, "fp16"):
        if side.kv:
            faults.append(Fault(C.FAILED_PRECONDITION, r"cannot reconfigure a connection with open sequences"))
        faults.append(Fault(C.FAILED_PRECONDITION, r"other connected session"))   # the bystander holds it
    check_answer(side.call(configure=c), faults, ("configure", c))


def configure(side: Side) -> None:
    reply = side.call(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, kv_format="fp16"))
    assert reply.code == 0, reply.message


def test_every_call_gets_the_status_its_faults_call_for_and_others_keep_their_kv():
    service = RWorkerService(8 << 20, threads=1, max_sequences=MAX_SEQUENCES)
    rng = np.random.default_rng(0)
    bystander = Side(service, "bystander")
    configure(bystander)
    assert bystander.call(open=pb.Open(seq_ids=[0, 1])).code == 0
    bystander.kv = {s: ([[] for _ in range(LAYERS)], [[] for _ in range(LAYERS)]) for s in (0, 1)}
    for layer in range(LAYERS):
        kv = rng.standard_normal((2, 6, HKV, D)).astype(np.float16)     # k, v of 2 sequences x 3 tokens
        assert bystander.call(prefill=pb.Prefill(layer=layer, seq_ids=[0, 1], lens=[3, 3],
                                                 k=pb.Tensor(data=kv[0].tobytes(), shape=(6, HKV, D), dtype="float16"),
                                                 v=pb.Tensor(data=kv[1].tobytes(), shape=(6, HKV, D),
                                                             dtype="float16"))).code == 0
        for s in (0, 1):
            bystander.append(s, layer, kv[0][3 * s:3 * s + 3], kv[1][3 * s:3 * s + 3])
    counts: dict[str, int] = {}

    @FUZZ
    @given(st.data())
    def calls(data):
        """A fresh connection and a few calls on it; its sequences are freed when it ends."""
        side = Side(service, "fuzz")
        try:
            configure(side)
            for _ in range(data.draw(st.integers(1, 6))):
                kind = data.draw(st.sampled_from(["open", "open", "close", "prefill", "prefill", "decode", "decode",
                                                  "decode", "configure", "nothing"]))
                counts[kind] = counts.get(kind, 0) + 1
                if kind == "open":
                    do_open(data, side, bystander)
                elif kind == "close":
                    do_close(data, side)
                elif kind == "prefill":
                    do_prefill(data, side)
                elif kind == "decode":
                    do_decode(data, side)
                elif kind == "configure":
                    do_configure(data, side)
                else:
                    call_id = data.draw(call_ids)
                    reply = side.call(call_id=call_id)
                    check_answer(reply, [Fault(C.INVALID_ARGUMENT, r"no operation")], "empty request")
                side.check_store()
                bystander.check_store()
                assert service.store.stats()["sequences"] == len(side.kv) + len(bystander.kv)
        finally:
            service._release(side.conn)
        assert service.store.stats()["sequences"] == len(bystander.kv)

    calls()
    assert all(counts.get(k, 0) >= 5 for k in ("open", "close", "prefill", "decode", "configure")), counts
    # the bystander still decodes correctly over its whole cache
    q = rng.standard_normal((2, 2 * HKV, D)).astype(np.float32)
    kv = rng.standard_normal((2, 2, HKV, D)).astype(np.float16)
    reply = bystander.call(decode=pb.Decode(layer=1, seq_ids=[0, 1], q=pb.Tensor(data=q.tobytes(), shape=q.shape,
                                                                                 dtype="float32"),
                                            k=pb.Tensor(data=kv[0].tobytes(), shape=(2, HKV, D), dtype="float16"),
                                            v=pb.Tensor(data=kv[1].tobytes(), shape=(2, HKV, D), dtype="float16")))
    assert reply.code == 0, reply.message
    o = np.frombuffer(reply.o.data, np.float32).reshape(q.shape)
    for s in (0, 1):
        bystander.append(s, 1, kv[0][s:s + 1], kv[1][s:s + 1])
        np.testing.assert_allclose(o[s], reference_attention(q[s], *bystander.cache(s, 1)), rtol=1e-4, atol=1e-4)
    assert service.store.stats()["sequences"] == 2
    bystander.check_store()
