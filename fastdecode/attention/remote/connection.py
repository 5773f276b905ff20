"""One R-worker: its channel (TLS, token), one long-lived Session stream and the calls pending on it."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.attention.base import AttentionError, KVCapacityError
from fastdecode.attention.remote import messages
from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from rpart.wire import HTTP2_OPTIONS, decode_reply

log = logging.getLogger("fastdecode.remote")

_END = object()                     # ends a stream's request iterator
SESSION_METHOD = "/fastdecode.rworker.RWorker/Session"


class WorkerLost(AttentionError):
    """The call's worker died or stalled; every sequence it held is gone."""


def reply_error(address: str, reply: pb.Reply) -> Exception:
    msg = f"R-worker {address}: {reply.message}"
    code = reply.code
    if code == grpc.StatusCode.NOT_FOUND.value[0]:
        return KeyError(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
        return ValueError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        return KVCapacityError(msg)
    return AttentionError(f"{msg} (status {code})")


class WorkerConnection:
    """One R-worker: a channel, one Session stream and its pending calls."""

    def __init__(self, address: str, index: int, configure: pb.Configure, timeout: float,
                 credentials, metadata, on_down) -> None:
        self.address, self.index = address, index
        self.configure, self.timeout = configure, timeout
        self.credentials, self.metadata, self.on_down = credentials, metadata, on_down
        self.lock = threading.Lock()
        self.connect_lock = threading.Lock()
        self.up = False                        # configured: takes calls
        self.live = False                      # its stream is open (up, or Configure under way)
        self.draining = False
        self.reason = "not connected yet"
        self.generation = 0
        self.pending: dict[int, tuple[Future, float]] = {}   # call id -> (future, sent at); oldest first
        self.ids = itertools.count(1)
        self.requests: queue.SimpleQueue | None = None
        self.call = None
        self.channel = None
        self.capacity_bytes = 0
        self.kernel_s = 0.0
        self.calls = 0
        self.last_probe = 0.0
        self.probing = False                   # a health check or reconnect is under way

    def _new_channel(self) -> grpc.Channel:
        options = [*HTTP2_OPTIONS,
                   ("grpc.max_send_message_length", 2 * messages.MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", 4 * messages.MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   # keepalive as rpart.wire.client_keepalive_options(): a dead R-worker host breaks the
                   # stream; pings stay >= the server's min interval (rpart.wire.MIN_CLIENT_PING_INTERVAL_MS)
                   ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
                   ("grpc.http2.ping_timeout_ms", 10_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, options=options)
        return grpc.insecure_channel(self.address, options=options)

    def connect(self) -> None:
        """(Re)open the stream and Configure it; raises on failure (the worker stays down)."""
        if self.channel is None:
            self.channel = self._new_channel()
        stub = pb_grpc.RWorkerStub(self.channel)
        stats = stub.Stats(pb.StatsRequest(), timeout=self.timeout, metadata=self.metadata)
        requests: queue.SimpleQueue = queue.SimpleQueue()
        # Requests go on the queue already serialised (see send): gRPC's sender thread then
        # only hands bytes to the C core instead of taking the GIL to serialise a message.
        session = self.channel.stream_stream(SESSION_METHOD, request_serializer=None,
                                             response_deserializer=decode_reply)
        call = session(iter(requests.get, _END), metadata=self.metadata)
        with self.lock:
            self.generation += 1
            generation = self.generation
            self.requests, self.call, self.live, self.draining = requests, call, True, stats.draining
            self.capacity_bytes = stats.capacity_bytes
        threading.Thread(target=self._read, args=(call, generation), daemon=True,
                         name=f"rworker-{self.index}-reader").start()
        # Up (open to other calls) only once configured: a call ahead of Configure on the
        # stream would be refused ("Configure must be the first call").
        try:
            reply = self.send(pb.Request(configure=self.configure), configuring=True).result(timeout=self.timeout)
        except FutureTimeout:
            self.fail(generation, f"no reply to Configure within {self.timeout:g} s")
            raise WorkerLost(f"R-worker {self.address}: {self.reason}") from None
        if reply.code:
            self.fail(generation, f"Configure refused: {reply.message}")
            raise reply_error(self.address, reply)
        with self.lock:
            if generation != self.generation or not self.live:
                raise WorkerLost(f"R-worker {self.address}: {self.reason}")
            self.up = True
        log.info("R-worker %s connected", self.address)

    def send(self, request: pb.Request, configuring: bool = False) -> Future:
        request.call_id = self.next_id()
        return self.send_bytes(request.call_id, request.SerializeToString(), configuring)

    def next_id(self) -> int:
        return next(self.ids)                # atomic under the GIL; ids need not be in stream order

    def send_bytes(self, call_id: int, data: bytes, configuring: bool = False) -> Future:
        """Send a serialised Request whose call_id is call_id; its Future gets the Reply.
        Only connect() sends (its Configure) on a stream not up yet (configuring=True)."""
        fut: Future = Future()
        with self.lock:
            if not (self.live if configuring else self.up):
                fut.set_exception(WorkerLost(f"R-worker {self.address} is down: {self.reason}"))
                return fut
            self.pending[call_id] = (fut, time.monotonic())
            self.requests.put(data)              # under the lock: stream order = call order
        return fut

    def _read(self, call, generation: int) -> None:
        reason = "stream ended"
        try:
            for reply in call:
                with self.lock:
                    entry = self.pending.pop(reply.call_id, None)
                if entry is not None:
                    entry[0].set_result(reply)
        except grpc.RpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 -- a reader that dies must take the worker down
            reason = f"{type(e).__name__}: {e}"
        self.fail(generation, reason)

    def fail(self, generation: int, reason: str) -> None:
        """Take the worker down (once per stream): fail its pending calls, report its sequences lost."""
        with self.lock:
            if generation != self.generation or not self.live:
                return
            self.up, self.live, self.reason = False, False, reason
            pending, self.pending = self.pending, {}
            self.requests.put(_END)
            call = self.call
        call.cancel()
        log.warning("R-worker %s down: %s", self.address, reason)
        self.on_down(self, reason)
        for fut, _ in pending.values():
            fut.set_exception(WorkerLost(f"R-worker {self.address}: {reason}"))

    def overdue(self, now: float) -> bool:
        with self.lock:
            oldest = next(iter(self.pending.values()), None)
        return oldest is not None and now - oldest[1] > self.timeout

    def health_future(self):
        if self.channel is None:
            self.channel = self._new_channel()
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check.future(health_pb2.HealthCheckRequest(), timeout=min(self.timeout, 2.0))

    def close(self) -> None:
        with self.lock:
            self.up, self.live, self.reason = False, False, "backend shut down"
            pending, self.pending = self.pending, {}
            if self.requests is not None:
                self.requests.put(_END)
        for fut, _ in pending.values():
            fut.set_exception(WorkerLost(f"R-worker {self.address}: backend shut down"))
        if self.channel is not None:
            self.channel.close()
