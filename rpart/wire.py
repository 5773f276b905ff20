"""What both ends of the R-worker stream agree on besides the proto: tensor encoding
and HTTP/2 settings."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import numpy as np

from rpart.proto import rworker_pb2 as pb

# bfloat16 travels as its uint16 bit patterns (numpy has no bfloat16).
WIRE_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}

# A step's message is a few hundred KB: with HTTP/2's default 64 KB flow-control window
# each one would wait for window updates, a scheduler wake-up of each side apiece.
HTTP2_OPTIONS = [("grpc.http2.lookahead_bytes", 16 << 20),
                 ("grpc.http2.max_frame_size", (1 << 24) - 1)]    # the largest HTTP/2 allows

# Keepalive: each end pings the other while connected, with or without calls and data, and
# drops a connection whose pings go unanswered. A dead or cut-off S-worker host then ends
# its streams on the R-worker, which frees their KV; a dead R-worker breaks the S-worker's.
# The server accepts client pings down to MIN_CLIENT_PING_INTERVAL_MS apart (closer ones are
# strikes, and too many strikes close the connection): keep the client's interval above it.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_CLIENT_PING_INTERVAL_MS = 10_000
_PING_ALWAYS = [("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]         # 0: no cap on pings between data frames


def _keepalive(time_ms: int, timeout_ms: int) -> list:
    # ping_timeout: a keepalive ping that joins one already unanswered (e.g. a flow-control
    # probe sent as the peer vanished) waits on that one, for a minute by default.
    return [("grpc.keepalive_time_ms", time_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), *_PING_ALWAYS]


def client_keepalive_options(time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> list:
    return _keepalive(max(time_ms, MIN_CLIENT_PING_INTERVAL_MS), timeout_ms)


def server_keepalive_options(time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS) -> list:
    return [*_keepalive(time_ms, timeout_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS)]


# glibc hands every free()d block over 128 KB back to the OS (munmap, heap trim), so each
# message buffer (protobuf, gRPC slices, numpy) of a call is fresh memory that page-faults
# in on first touch: 2-3 ms per call of B=512 on a busy 2-core box, more than the copies.
# Keeping freed blocks up to 32 MB (glibc's maximum) in the heap makes them reusable.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 128 << 20


def keep_freed_memory() -> bool:
    """Tune this process's glibc malloc as above; False (and nothing done) elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False                                   # not glibc (e.g. musl)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def to_tensor(a: np.ndarray, dtype: str = "") -> pb.Tensor:
    """Raw little-endian bytes + shape + dtype name (x86/Arm hosts are little-endian)."""
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=dtype or a.dtype.name)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even like torch's .to(bfloat16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _len_prefix(field: int, length: int) -> bytes:
    """Tag and length of a length-delimited protobuf field."""
    return _varint(field << 3 | 2) + _varint(length)


def encode_decode_request(call_id: int, layer: int, seq_ids, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          q_dtype: str = "") -> bytes:
    """A serialised Request{call_id, decode{layer, seq_ids, q, k, v}}, byte for byte what protobuf
    would accept as that message, built with ONE copy of the tensor data (bytes.join over the
    arrays' buffers) instead of tobytes + message copy + serialisation copy. Sub-messages are
    emitted as header-only Tensor{shape, dtype} followed by their data field inside the same
    length-delimited Tensor field, so the receiver parses an ordinary Request."""
    head = pb.Decode(layer=layer, seq_ids=seq_ids).SerializeToString()
    pieces, size = [head], len(head)
    for field, a, dtype in ((3, q, q_dtype or q.dtype.name), (4, k, k.dtype.name), (5, v, v.dtype.name)):
        a = np.ascontiguousarray(a)
        meta = pb.Tensor(shape=a.shape, dtype=dtype).SerializeToString()
        data_prefix = _len_prefix(1, a.nbytes)
        body = len(meta) + len(data_prefix) + a.nbytes
        prefix = _len_prefix(field, body)
        pieces += [prefix, meta, data_prefix, a.reshape(-1).view(np.uint8)]
        size += len(prefix) + body
    top = pb.Request(call_id=call_id).SerializeToString() + _len_prefix(6, size)
    return b"".join([top, *pieces])


def encode_reply_o(reply: pb.Reply, o: np.ndarray, dtype: str = "") -> bytes:
    """reply (without o) serialised, plus o = Tensor{data, shape, dtype}: one copy of o's data."""
    o = np.ascontiguousarray(o)
    meta = pb.Tensor(shape=o.shape, dtype=dtype or o.dtype.name).SerializeToString()
    data_prefix = _len_prefix(1, o.nbytes)
    body = len(meta) + len(data_prefix) + o.nbytes
    return b"".join([reply.SerializeToString(), _len_prefix(4, body), meta, data_prefix, o.reshape(-1).view(np.uint8)])


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _split_field(buf, field: int):
    """Top-level fields of a serialised message: (the bytes of all but `field`, the [start, end) span
    of `field`'s payload); the span is None when the field is absent. ValueError when malformed
    or when `field` occurs more than once (protobuf would merge the occurrences)."""
    rest, span, i, n = [], None, 0, len(buf)
    while i < n:
        start = i
        key, i = _read_varint(buf, i)
        wire_type = key & 7
        if wire_type == 0:
            _, i = _read_varint(buf, i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        elif wire_type == 2:
            length, i = _read_varint(buf, i)
            if key >> 3 == field:
                if span is not None:
                    raise ValueError("field repeated")
                span = (i, i + length)
                i += length
                continue
            i += length
        else:
            raise ValueError(f"wire type {wire_type}")
        rest.append(buf[start:i])
    if i != n:
        raise ValueError("truncated message")
    return rest, span


class WireReply:
    """A Reply whose o.data is left in the received buffer (o_data, a memoryview: no copy);
    every other attribute is the parsed Reply's (o.data there is empty)."""

    __slots__ = ("msg", "o_data")

    def __init__(self, msg: pb.Reply, o_data) -> None:
        self.msg, self.o_data = msg, o_data

    def __getattr__(self, name):
        return getattr(self.msg, name)


def decode_reply(buf: bytes) -> WireReply:
    """Client-side Reply deserializer: parses everything but o's data, which stays a view into buf
    (a reply of B=512 carries ~1 MB; protobuf would copy it twice). Falls back to plain parsing
    for anything unusual."""
    try:
        mv = memoryview(buf)
        rest, span = _split_field(mv, 4)
        if span is None:
            return WireReply(pb.Reply.FromString(buf), b"")
        t_rest, d_span = _split_field(mv[span[0]:span[1]], 1)
        msg = pb.Reply.FromString(b"".join(rest))
        msg.o.MergeFromString(b"".join(t_rest))
        data = mv[span[0] + d_span[0]:span[0] + d_span[1]] if d_span is not None else b""
        return WireReply(msg, data)
    except (ValueError, IndexError):
        msg = pb.Reply.FromString(buf)                  # raises DecodeError when truly malformed
        return WireReply(msg, msg.o.data)
