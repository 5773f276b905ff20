"""One client connection of an R-worker: its state, and the checks every call makes against it and
against the wire format, before the store is touched."""
from __future__ import annotations

import math

import grpc
import numpy as np

from rpart.proto import rworker_pb2 as pb
from rpart.wire import WIRE_DTYPES, bf16_to_f32

ID_BITS = 40                                 # client sequence ids: 0 <= id < 2**40
CONNECTION_BITS = 63 - ID_BITS               # connection numbers: 1 <= n < 2**23 (stored ids are int64)
MAX_IDS_PER_CALL = 1 << 16
MAX_TENSOR_RANK = 8                           # wire tensors are 3-D; numpy takes at most 32
MAX_SPAN_TOKENS = (1 << 31) - 1               # tokens of one sequence in one prefill (the store counts in int)
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 4096, 4096, 1024
# Bookkeeping of one open sequence outside the KV pool: the store's per-layer block table,
# length and tail (kernel: a vector + 2 ints per layer) and its map entry, plus our id set.
TABLE_BYTES_PER_LAYER, TABLE_BYTES_PER_SEQUENCE = 32, 256


class CallError(Exception):
    """A failed call: answered with `code` on the stream, which stays open."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_MAX_ARRAY_BYTES = (1 << 63) - 1


def tensor_to_numpy(t: pb.Tensor, name: str) -> np.ndarray:
    """Zero-copy view of a wire tensor; INVALID_ARGUMENT when it is malformed."""
    dtype = WIRE_DTYPES.get(t.dtype)
    if dtype is None:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}: unknown dtype {t.dtype!r} (expected one of {sorted(WIRE_DTYPES)})")
    shape = tuple(t.shape)
    if len(shape) > MAX_TENSOR_RANK:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}: shape {shape} has {len(shape)} dimensions (at most {MAX_TENSOR_RANK})")
    if any(n < 0 for n in shape):
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: negative dimension in shape {shape}")
    itemsize = np.dtype(dtype).itemsize
    if math.prod(n for n in shape if n) * itemsize > _MAX_ARRAY_BYTES:   # numpy's limit, zeros aside
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}: shape {shape} is too large for an array (over 2**63 bytes without its zeros)")
    expected = math.prod(shape) * itemsize   # Python ints: an int64 product wraps around
    data = t.data                            # each access of a bytes field copies it: once only
    if len(data) != expected:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{name}: {len(data)} bytes for shape {shape} {t.dtype} (expected {expected})")
    a = np.frombuffer(data, dtype=dtype).reshape(shape)
    return bf16_to_f32(a) if t.dtype == "bfloat16" else a


def table_bytes(num_layers: int, sequences: int) -> int:
    """Memory outside the KV pool that `sequences` open sequences of num_layers layers take."""
    return sequences * (TABLE_BYTES_PER_SEQUENCE + TABLE_BYTES_PER_LAYER * num_layers)


def describe_shape(config: tuple | None) -> str:
    if config is None:
        return "none"
    return "layers={} kv_heads={} head_dim={} format={}".format(*config)


class Connection:
    def __init__(self, peer: str, number: int = 1) -> None:
        self.number = number
        self.base = number << ID_BITS
        self.peer = peer
        self.config: tuple | None = None
        self.seqs: set[int] = set()          # client-side ids open on this connection
        self.closed = False                  # set under the service lock once its sequences are freed

    def ids(self, seq_ids, store_config: tuple | None) -> np.ndarray:
        """The call's sequence ids, checked: -> int64 array (client-side ids)."""
        if self.config is None:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, "Configure must be the first call")
        if self.config != store_config:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this connection's KV shape ({describe_shape(self.config)}) is not the store's "
                            f"({describe_shape(store_config)}): Configure again")
        if len(seq_ids) > MAX_IDS_PER_CALL:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(seq_ids)} sequence ids in one call (at most {MAX_IDS_PER_CALL})")
        ids = np.asarray(seq_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= 1 << ID_BITS):
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"sequence ids must be in [0, 2**{ID_BITS})")
        return ids

    def check_open(self) -> None:
        """Under the lock: the stream may have ended (its sequences freed) while this call waited."""
        if self.closed:
            raise CallError(grpc.StatusCode.CANCELLED, "connection closed")

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config[0]:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"layer {layer} out of range [0, {self.config[0]})")

    def check_kv(self, name: str, x: np.ndarray, rows: int) -> None:
        want = (rows, self.config[1], self.config[2])
        if x.shape != want:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: shape {x.shape}, expected {want}")

    def not_found(self, seq_ids) -> CallError:
        missing = [s for s in seq_ids if s not in self.seqs]
        return CallError(grpc.StatusCode.NOT_FOUND, f"unknown sequence id(s) {missing[:8]}")


def check_room(conn: Connection, more: int, total: int, max_sequences: int, max_per_connection: int,
               max_table_bytes: int) -> None:
    """The limits on open sequences (`total` open on all connections now): all clients, this
    connection, and their tables' memory."""
    if total + more > max_sequences:
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{total} sequences open, {more} more asked; this R-worker takes at most "
                        f"{max_sequences} (--max-sequences)")
    if len(conn.seqs) + more > max_per_connection:
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{len(conn.seqs)} sequences open on this connection, {more} more asked; at most "
                        f"{max_per_connection} per connection (--max-sequences-per-connection)")
    tables = table_bytes(conn.config[0], total + more)
    if tables > max_table_bytes:
        raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{total + more} sequences of {conn.config[0]} layers need ~{tables} bytes of tables "
                        f"outside the KV pool; at most {max_table_bytes} (--max-table-memory)")
