"""The R-worker service: KV store + attention behind a gRPC stream.

One KV store per process, shaped by Configure (the R-worker knows nothing of
models); while any connected session uses that shape, another one is refused.
Every stream is a connection with its own namespace of sequence ids: a client's
id s is stored as (connection << ID_BITS) | s, so two S-workers cannot collide,
and a connection's sequences are freed when it ends. Connection numbers are
recycled below 2**CONNECTION_BITS so the stored ids stay within int64.
Calls into the store are serialised by one lock; the store parallelises inside.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np

from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from rpart.errors import KVCapacityError
from rpart.formats import KV_FORMATS
from rpart.wire import encode_reply_o, f32_to_bf16
from rworker.connection import (CONNECTION_BITS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_SPAN_TOKENS, CallError,
                                Connection, check_room, describe_shape, tensor_to_numpy)

log = logging.getLogger("rworker")

OK = grpc.StatusCode.OK


def default_store_factory(**kwargs):
    from rpart.kernels import KVStore
    return KVStore(**kwargs)


def _is_capacity_error(e: Exception) -> bool:
    return isinstance(e, KVCapacityError)


class RWorkerService(pb_grpc.RWorkerServicer):
    def __init__(self, capacity_bytes: int, threads: int = 0, block_size: int = 16,
                 store_factory=default_store_factory, max_sequences: int = 1 << 18,
                 int4_fp16_tail: bool = True, int4_k_group: int = 0, int4_v_group: int = 0,
                 max_sequences_per_connection: int = 1 << 16, max_table_bytes: int = 512 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_sequences_per_connection = max_sequences_per_connection
        self.max_table_bytes = max_table_bytes
        self.int4_fp16_tail = int4_fp16_tail
        self.int4_groups = {"k_group": int4_k_group, "v_group": int4_v_group}  # 0: the kernel's default
        self.max_sequences = max_sequences
        self.threads = threads
        self.block_size = block_size
        self.store_factory = store_factory
        self.store = None
        self.store_config: tuple | None = None
        self.lock = threading.Lock()          # guards the store and the bookkeeping below
        self.connections: dict[int, Connection] = {}
        self.next_number = 1                  # the next connection number to try
        self.draining = threading.Event()
        self.on_drain = lambda: None          # the server flips its health status here
        self.busy_s = 0.0
        self.calls = 0

    # ---- stream -------------------------------------------------------------------------
    def Session(self, request_iterator, context):
        conn = self._connect(context.peer())
        context.add_callback(lambda: self._release(conn))
        log.info("connection %d from %s", conn.number, conn.peer)
        try:
            for req in request_iterator:
                yield self._call(conn, req)
        finally:
            self._release(conn)

    def _call(self, conn: Connection, req: pb.Request) -> pb.Reply | bytes:
        """The reply: a Reply, or for a decode its serialised form (o appended without copies;
        the Session's response serializer passes bytes through, see server.py)."""
        recv_ns = time.perf_counter_ns()
        t0 = time.perf_counter()
        reply = pb.Reply(call_id=req.call_id, recv_ns=recv_ns)
        op = req.WhichOneof("op")
        o = None
        try:
            if op == "decode":
                o = self._decode(conn, req.decode, reply)
            elif op == "prefill":
                self._prefill(conn, req.prefill, reply)
            elif op == "open":
                self._open(conn, req.open)
            elif op == "close":
                self._close(conn, req.close)
            elif op == "configure":
                self._configure(conn, req.configure)
            else:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, "request carries no operation")
        except CallError as e:
            reply.code, reply.message = e.code.value[0], str(e)
        except KeyError as e:
            reply.code, reply.message = grpc.StatusCode.NOT_FOUND.value[0], str(e.args[0] if e.args else e)
        except ValueError as e:
            reply.code, reply.message = grpc.StatusCode.INVALID_ARGUMENT.value[0], str(e)
        except Exception as e:  # noqa: BLE001 -- every failure is answered, the stream lives on
            if _is_capacity_error(e):
                reply.code, reply.message = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], str(e)
            else:
                log.exception("call %d (%s) failed", req.call_id, op)
                reply.code, reply.message = grpc.StatusCode.INTERNAL.value[0], f"{type(e).__name__}: {e}"
        if reply.code:
            log.debug("call %d (%s) -> %d %s", req.call_id, op, reply.code, reply.message)
        reply.handler_s = time.perf_counter() - t0
        reply.reply_ns = time.perf_counter_ns()
        if o is not None and not reply.code:
            return encode_reply_o(reply, o, req.decode.q.dtype)
        return reply

    def _connect(self, peer: str) -> Connection:
        """A registered Connection with the next number not in use, wrapping below 2**CONNECTION_BITS."""
        limit = 1 << CONNECTION_BITS
        with self.lock:
            if len(self.connections) >= limit - 1:
                raise RuntimeError("no free connection number")
            number = self.next_number
            while number in self.connections:
                number = number % (limit - 1) + 1
            self.next_number = number % (limit - 1) + 1
            conn = self.connections[number] = Connection(peer, number)
        return conn

    def _release(self, conn: Connection) -> None:
        with self.lock:
            if self.connections.pop(conn.number, None) is None:
                return
            conn.closed = True
            if conn.seqs and self.store is not None:
                self.store.free(np.fromiter(conn.seqs, np.int64) + conn.base)
            freed = len(conn.seqs)
            conn.seqs.clear()
        log.info("connection %d closed, %d sequence(s) freed", conn.number, freed)

    # ---- operations ---------------------------------------------------------------------
    def _configure(self, conn: Connection, c: pb.Configure) -> None:
        if not (1 <= c.num_layers <= MAX_LAYERS and 1 <= c.num_kv_heads <= MAX_HEADS
                and 1 <= c.head_dim <= MAX_HEAD_DIM):
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"bad KV shape: num_layers={c.num_layers} num_kv_heads={c.num_kv_heads} "
                            f"head_dim={c.head_dim}")
        if c.kv_format not in KV_FORMATS:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"unknown kv_format {c.kv_format!r} (expected one of {KV_FORMATS})")
        config = (c.num_layers, c.num_kv_heads, c.head_dim, c.kv_format)
        with self.lock:
            if conn.seqs and conn.config != config:
                raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                                "cannot reconfigure a connection with open sequences")
            if self.store_config != config:
                self._check_reshape_allowed(conn, config)
                conn.config = None              # until the new store exists
                self._build_store(config)
            conn.config = config

    def _check_reshape_allowed(self, conn: Connection, config: tuple) -> None:
        users = sum(1 for other in self.connections.values() if other is not conn and other.config is not None)
        held = self.store.stats()["sequences"] if self.store is not None else 0
        if users or held:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this R-worker serves KV of shape ({describe_shape(self.store_config)}) to {users} "
                            f"other connected session(s), {held} sequence(s) open; cannot switch to "
                            f"({describe_shape(config)}) until they disconnect")

    def _build_store(self, config: tuple) -> None:
        """Replace the store (nobody uses it); when the new one fails to build, none is left and
        every connection must Configure again (refused cleanly by _ids, never a call on None)."""
        if self.store is not None and hasattr(self.store, "close"):
            self.store.close()                  # free the old pool before allocating the new one
        self.store, self.store_config = None, None
        num_layers, num_kv_heads, head_dim, kv_format = config
        int4 = {"fp16_tail": self.int4_fp16_tail, **self.int4_groups} if kv_format == "int4" else {}
        self.store = self.store_factory(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            capacity_bytes=self.capacity_bytes, block_size=self.block_size,
            kv_format=kv_format, num_threads=self.threads, **int4)
        self.store_config = config
        log.info("KV store: layers=%d kv_heads=%d head_dim=%d format=%s isa=%s", *config,
                 getattr(self.store, "isa", "?"))

    def _open(self, conn: Connection, m: pb.Open) -> None:
        ids = conn.ids(m.seq_ids, self.store_config)
        if self.draining.is_set():
            raise CallError(grpc.StatusCode.UNAVAILABLE, "R-worker is draining: no new sequences")
        if len(set(m.seq_ids)) != len(m.seq_ids) or conn.seqs.intersection(m.seq_ids):
            raise CallError(grpc.StatusCode.ALREADY_EXISTS,
                            f"sequence id(s) already open: {sorted(conn.seqs.intersection(m.seq_ids))[:8]}")
        with self.lock:
            conn.check_open()
            check_room(conn, len(ids), sum(len(c.seqs) for c in self.connections.values()), self.max_sequences,
                       self.max_sequences_per_connection, self.max_table_bytes)
            self.store.create(ids + conn.base)
            conn.seqs.update(m.seq_ids)

    def _close(self, conn: Connection, m: pb.Close) -> None:
        ids = conn.ids(m.seq_ids, self.store_config)
        with self.lock:
            conn.check_open()
            self.store.free(ids + conn.base)
            conn.seqs.difference_update(m.seq_ids)

    def _prefill(self, conn: Connection, m: pb.Prefill, reply: pb.Reply) -> None:
        ids = conn.ids(m.seq_ids, self.store_config)
        conn.check_layer(m.layer)
        lens = np.asarray(m.lens, dtype=np.int64)
        if len(lens) != len(ids) or (lens.size and (lens.min() < 0 or lens.max() > MAX_SPAN_TOKENS)):
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"prefill: need one length in [0, {MAX_SPAN_TOKENS}] per sequence")
        k, v = tensor_to_numpy(m.k, "k"), tensor_to_numpy(m.v, "v")
        total = sum(int(n) for n in lens)       # Python ints: a numpy sum of int64 lengths could wrap
        conn.check_kv("k", k, total)
        conn.check_kv("v", v, total)
        with self.lock:
            conn.check_open()
            t0 = time.perf_counter()
            try:
                self.store.append_span(m.layer, ids + conn.base, lens, k, v)
            except KeyError:
                raise conn.not_found(m.seq_ids) from None
            reply.kernel_s = self._account(t0)

    def _decode(self, conn: Connection, m: pb.Decode, reply: pb.Reply) -> np.ndarray:
        """Append k, v and attend; returns o in q's wire dtype (sent by _call)."""
        ids = conn.ids(m.seq_ids, self.store_config)
        conn.check_layer(m.layer)
        q, k, v = tensor_to_numpy(m.q, "q"), tensor_to_numpy(m.k, "k"), tensor_to_numpy(m.v, "v")
        rows, hkv, dim = len(ids), conn.config[1], conn.config[2]
        if q.ndim != 3 or q.shape[0] != rows or q.shape[2] != dim or q.shape[1] % hkv:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"q: shape {q.shape}, expected ({rows}, a multiple of {hkv}, {dim})")
        conn.check_kv("k", k, rows)
        conn.check_kv("v", v, rows)
        with self.lock:
            conn.check_open()
            t0 = time.perf_counter()
            try:
                o = self.store.decode(m.layer, ids + conn.base, q, k, v)
            except KeyError:
                raise conn.not_found(m.seq_ids) from None
            reply.kernel_s = self._account(t0)
        # o goes back in q's wire dtype: the S-Part would round it to that dtype anyway.
        if m.q.dtype == "float16":
            return o.astype(np.float16)
        if m.q.dtype == "bfloat16":
            return f32_to_bf16(o)
        return o

    def _account(self, t0: float) -> float:
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.calls += 1
        return dt

    # ---- unary --------------------------------------------------------------------------
    def Stats(self, request, context) -> pb.StatsReply:
        with self.lock:
            s = self.store.stats() if self.store is not None else {}
            return pb.StatsReply(
                sequences=s.get("sequences", 0), kv_tokens=s.get("kv_tokens", 0),
                bytes_used=s.get("bytes_used", 0), capacity_bytes=s.get("capacity_bytes", self.capacity_bytes),
                busy_s=self.busy_s, connections=len(self.connections), draining=self.draining.is_set(),
                isa=getattr(self.store, "isa", ""), calls=self.calls)

    def Drain(self, request, context) -> pb.DrainReply:
        self.drain()
        return pb.DrainReply(sequences=self.open_sequences())

    def drain(self) -> None:
        if not self.draining.is_set():
            log.info("draining: new sequences are refused, open ones are served")
        self.draining.set()
        self.on_drain()

    def open_sequences(self) -> int:
        with self.lock:
            return sum(len(c.seqs) for c in self.connections.values())
