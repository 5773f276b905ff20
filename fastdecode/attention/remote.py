"""Remote attention: the R-Part on a fleet of R-workers over gRPC (rworker/).

Workers form groups of `head_shards`; member j of a group holds kv heads
shard j of every sequence placed on the group (query heads follow their kv
heads). With head_shards=1 a group is one worker holding whole sequences.

- open() places each sequence on the live group with the least KV load (tokens), all or
  nothing: ids a group refuses for capacity (its --max-sequences) go to groups with room
  (the refusing one is offered fewer); when none has room, nothing stays open (here or on
  a worker) and KVCapacityError is raised.
- submit_decode() ships each worker the q, k, v rows of its sequences as one
  message on its long-lived stream and returns a Future at once; replies are
  written into one output tensor as they arrive, on the stream's reader thread.
- A worker whose stream breaks, or that misses the deadline (rworker_timeout_s),
  is marked down: its sequences' futures raise SequencesLost (with o valid for
  the other rows); the engine re-opens them (placed on live groups) and
  re-prefills. A monitor thread probes down workers (health service) and
  reconnects them; a returning worker takes new sequences again.

Wire dtypes: k, v travel as fp16 (the store keeps fp16, so this loses nothing);
q and o travel in q's dtype (fp32, fp16 or bf16 bits; o is rounded on the worker to
that dtype, which the S-Part casts it to anyway), so results match the local backend
bit for bit in the engine's dtype.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastdecode.attention.base import AttentionBackend, AttentionError, KVCapacityError, KVSpec, SequencesLost
from rworker.auth import bearer, channel_credentials
from rworker.proto import rworker_pb2 as pb
from rworker.proto import rworker_pb2_grpc as pb_grpc
from rworker.wire import (HTTP2_OPTIONS, WIRE_DTYPES, bf16_to_f32, decode_reply, encode_decode_request,
                          keep_freed_memory, to_tensor)

log = logging.getLogger("fastdecode.remote")

MAX_MESSAGE_BYTES = 16 << 20        # the client splits bigger calls; the server accepts 64 MiB
PROBE_INTERVAL_S = 0.5              # how often down workers are probed for a reconnect
_END = object()                     # ends a stream's request iterator
SESSION_METHOD = "/fastdecode.rworker.RWorker/Session"


class WorkerLost(AttentionError):
    """The call's worker died or stalled; every sequence it held is gone."""


def _reply_error(address: str, reply: pb.Reply) -> Exception:
    msg = f"R-worker {address}: {reply.message}"
    code = reply.code
    if code == grpc.StatusCode.NOT_FOUND.value[0]:
        return KeyError(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
        return ValueError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        return KVCapacityError(msg)
    return AttentionError(f"{msg} (status {code})")


def _to_fp16(x: torch.Tensor) -> np.ndarray:
    """x as float16 (round to nearest even), converted in pieces below torch's parallel grain
    (32768 elements): vectorised on this thread, no wake-up of the intra-op thread pool
    (which costs milliseconds on a busy machine) and ~10x faster than numpy's astype."""
    out = torch.empty(x.shape, dtype=torch.float16)
    rows = max(1, 32768 // max(1, x[0].numel())) if len(x) else 1
    for a in range(0, x.shape[0], rows):
        out[a:a + rows].copy_(x[a:a + rows])
    return out.numpy()


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"tensors must be on the CPU, got {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"expected float32, bfloat16 or float16, got {x.dtype}")


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A contiguous float32/float16 numpy view of a CPU tensor (bfloat16 widened to float32)."""
    _check(x)
    if x.dtype == torch.bfloat16:
        x = x.float()
    return np.ascontiguousarray(x.detach().numpy())


class _Worker:
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
                   ("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", 4 * MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   # keepalive as rworker.wire.client_keepalive_options(): a dead R-worker host breaks the
                   # stream; pings stay >= the server's min interval (rworker.wire.MIN_CLIENT_PING_INTERVAL_MS)
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
            raise _reply_error(self.address, reply)
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


class _Group:
    """head_shards workers that together hold all kv heads of their sequences."""

    def __init__(self, index: int, workers: list[_Worker]) -> None:
        self.index, self.workers = index, workers
        self.seqs: set[int] = set()
        self.tokens = 0

    @property
    def up(self) -> bool:
        return all(w.up for w in self.workers)

    @property
    def accepting(self) -> bool:
        return self.up and not any(w.draining for w in self.workers)


class _Gather:
    """Collects the parts of one decode call into `out`; resolves `future` when all are in."""

    def __init__(self, out: torch.Tensor, seq_ids: Sequence[int], parts: int, backend: "RemoteAttention",
                 t0: float) -> None:
        self.out, self.out_np = out, out.numpy()
        self.seq_ids, self.backend = seq_ids, backend
        self.future: Future = Future()
        self.lock = threading.Lock()
        self.remaining = parts
        self.lost_rows: list[np.ndarray] = []
        self.refused_rows: list[np.ndarray] = []     # a worker's RESOURCE_EXHAUSTED: only its rows
        self.reason = ""
        self.error: Exception | None = None
        self.kernel_s = 0.0                  # of the slowest part
        self.handler_s = 0.0                 # that part's time in the worker's handler
        self.t0 = t0                         # submit time: conversion and serialisation count as comm
        self.t0_ns = time.perf_counter_ns()
        self.encoded_ns = 0                  # every message built, none sent yet
        self.parts: list[tuple] = []         # per reply: worker's recv_ns, reply_ns, kernel_s; read_ns, decoded_ns

    def lose(self, rows: np.ndarray, reason: str) -> None:
        with self.lock:
            self.lost_rows.append(rows)
            self.reason = self.reason or reason

    def part_done(self, fut: Future, worker: _Worker, rows: np.ndarray, heads: slice) -> None:
        read_ns = time.perf_counter_ns()
        try:
            reply = fut.result()
            if reply.code:
                raise _reply_error(worker.address, reply)
            o = reply.o
            a = np.frombuffer(reply.o_data, dtype=WIRE_DTYPES[o.dtype]).reshape(tuple(o.shape))
            self.out_np[rows, heads] = bf16_to_f32(a) if o.dtype == "bfloat16" else a
            worker.kernel_s += reply.kernel_s
            worker.calls += 1
            with self.lock:
                if reply.kernel_s >= self.kernel_s:
                    self.kernel_s, self.handler_s = reply.kernel_s, reply.handler_s
                self.parts.append((reply.recv_ns, reply.reply_ns, reply.kernel_s, read_ns, time.perf_counter_ns()))
        except WorkerLost as e:
            self.lose(rows, str(e))
        except KVCapacityError as e:
            with self.lock:
                self.refused_rows.append(rows)
                self.reason = self.reason or str(e)
        except Exception as e:  # noqa: BLE001 -- handed to the caller through the future
            with self.lock:
                self.error = self.error or e
        with self.lock:
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            self.finish()

    def finish(self) -> None:
        self.backend._account(time.perf_counter() - self.t0, self.kernel_s, self.handler_s)
        if self.parts and self.error is None and not self.lost_rows and not self.refused_rows:
            self.backend.call_trace.append({"submit_ns": self.t0_ns, "encoded_ns": self.encoded_ns,
                                            "done_ns": time.perf_counter_ns(), "parts": self.parts})
        if self.error is not None:
            self.future.set_exception(self.error)
        elif self.refused_rows:          # lost rows with them: the engine recomputes both alike
            rows = np.unique(np.concatenate(self.refused_rows + self.lost_rows))
            self.future.set_exception(KVCapacityError(self.reason, [self.seq_ids[i] for i in rows], self.out))
        elif self.lost_rows:
            rows = np.unique(np.concatenate(self.lost_rows))
            lost = [self.seq_ids[i] for i in rows]
            self.future.set_exception(SequencesLost(lost, self.reason, output=self.out))
        else:
            self.future.set_result(self.out)


class RemoteAttention(AttentionBackend):
    def __init__(self, spec: KVSpec, config) -> None:
        super().__init__(spec)
        keep_freed_memory()                  # message buffers reused, not page-faulted in per call
        addresses = list(config.rworkers)
        shards = config.head_shards
        if not addresses:
            raise ValueError("RemoteAttention: no R-worker addresses (EngineConfig.rworkers)")
        if len(addresses) % shards:
            raise ValueError(f"RemoteAttention: {len(addresses)} R-worker(s) cannot form groups of "
                             f"head_shards={shards}")
        if shards > spec.num_kv_heads:
            raise ValueError(f"RemoteAttention: head_shards={shards} > num_kv_heads={spec.num_kv_heads}")
        self.timeout = float(config.rworker_timeout_s)
        self.decode_backstop_s = 3 * self.timeout + 5.0      # the monitor fails overdue calls long before
        self.kv_format = config.kv_format
        group = spec.num_heads // spec.num_kv_heads
        bounds = [j * spec.num_kv_heads // shards for j in range(shards + 1)]
        self.kv_heads = [slice(bounds[j], bounds[j + 1]) for j in range(shards)]
        self.q_heads = [slice(s.start * group, s.stop * group) for s in self.kv_heads]
        credentials = None
        if config.rworker_tls_ca:
            credentials = channel_credentials(config.rworker_tls_ca, config.rworker_tls_cert, config.rworker_tls_key)
        metadata = bearer(config.rworker_token)

        self.lock = threading.RLock()
        self.workers = [
            _Worker(a, i, pb.Configure(num_layers=spec.num_layers, num_kv_heads=s.stop - s.start,
                                       head_dim=spec.head_dim, kv_format=config.kv_format),
                    self.timeout, credentials, metadata, self._worker_down)
            for i, (a, s) in enumerate(zip(addresses, itertools.cycle(self.kv_heads)))]
        self.groups = [_Group(g, self.workers[g * shards:(g + 1) * shards]) for g in range(len(addresses) // shards)]
        self.group_of_worker = {w.index: self.groups[w.index // shards] for w in self.workers}
        self.placement: dict[int, _Group | None] = {}    # None: lost, waiting for the engine to re-open it
        self.lost_reason: dict[int, str] = {}
        self.seq_tokens: dict[int, int] = {}
        self._plans: dict[tuple, list] = {}
        self.decode_calls, self.decode_wall_s, self.decode_kernel_s, self.decode_handler_s = 0, 0.0, 0.0, 0.0
        self.decode_submit_s = 0.0           # inside submit_decode: conversion, row gathering, message building
        self.lost_total = 0
        # Per decode call, for benchmarks: perf_counter_ns stamps of submit, submit_decode's return,
        # the future's resolution and per reply the worker's (same host: same clock) and ours.
        self.call_trace: collections.deque = collections.deque(maxlen=4096)
        self._stop = threading.Event()

        threads = [threading.Thread(target=self._try_connect, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not any(g.up for g in self.groups):
            errors = "; ".join(f"{w.address}: {w.reason}" for w in self.workers)
            self.shutdown()
            raise AttentionError(f"RemoteAttention: no R-worker group reachable ({errors})")
        self._monitor = threading.Thread(target=self._monitor_loop, daemon=True, name="rworker-monitor")
        self._monitor.start()

    # ---- worker health ------------------------------------------------------------------
    def _try_connect(self, w: _Worker) -> bool:
        with w.connect_lock:                   # the monitor and open() may both try
            if w.up:
                return True
            w.last_probe = time.monotonic()
            try:
                w.connect()
                return True
            except (grpc.RpcError, AttentionError, ValueError, KeyError) as e:
                if isinstance(e, grpc.RpcError):
                    w.reason = f"{e.code().name}: {e.details()}"
                log.info("R-worker %s not connected: %s", w.address, w.reason)
                return False

    def _worker_down(self, w: _Worker, reason: str) -> None:
        """A member is down: every sequence of its group is lost; free them on the other members."""
        g = self.group_of_worker[w.index]
        with self.lock:
            lost = list(g.seqs)
            for s in lost:
                self.placement[s] = None
                self.lost_reason[s] = f"R-worker {w.address} down: {reason}"
                self.seq_tokens[s] = 0
            g.seqs.clear()
            g.tokens = 0
            self.lost_total += len(lost)
            self._plans.clear()
        if lost:
            for other in g.workers:
                if other is not w and other.up:
                    other.send(pb.Request(close=pb.Close(seq_ids=lost)))
            log.warning("%d sequence(s) lost with R-worker %s", len(lost), w.address)

    def _monitor_loop(self) -> None:
        """Deadlines of calls in flight, and health probes; never blocks on a worker."""
        tick = min(0.05, self.timeout / 10)
        while not self._stop.wait(tick):
            now = time.monotonic()
            for w in self.workers:
                if w.up and w.overdue(now):
                    w.fail(w.generation, f"no reply within rworker_timeout_s={self.timeout:g} s")
                elif not w.probing and now - w.last_probe > PROBE_INTERVAL_S * (1 if not w.up else 5):
                    self._probe(w)

    def _probe(self, w: _Worker) -> None:
        """Health check in the background: a down worker that serves again is reconnected,
        an up one that stopped serving (draining) gets no new sequences."""
        w.last_probe, w.probing = time.monotonic(), True

        def done(fut) -> None:
            try:
                serving = fut.result().status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                w.probing = False
                return
            if w.up:
                w.draining = not serving
                w.probing = False
            elif serving and not self._stop.is_set():
                threading.Thread(target=self._reconnect, args=(w,), daemon=True).start()
            else:
                w.probing = False

        try:
            w.health_future().add_done_callback(done)
        except Exception:  # noqa: BLE001 -- e.g. the channel closed during shutdown
            w.probing = False

    def _reconnect(self, w: _Worker) -> None:
        try:
            self._try_connect(w)
        finally:
            w.probing = False

    def _revive_all(self) -> None:
        """Before giving up for lack of workers: one synchronous reconnect attempt each."""
        for w in self.workers:
            if not w.up:
                self._try_connect(w)

    # ---- AttentionBackend ---------------------------------------------------------------
    def open(self, seq_ids: Sequence[int]) -> None:
        """All or nothing: every id is opened (each on one live group) or, on error, none is.
        A group that refuses k ids for capacity (RESOURCE_EXHAUSTED: its --max-sequences or its
        pool) is offered at most k // 2 of them again in this call, the rest go to the other
        groups; KVCapacityError is raised when no live group has room left."""
        seq_ids = [int(s) for s in seq_ids]
        with self.lock:
            dup = [s for s in seq_ids if self.placement.get(s) is not None]
            was_lost = {s: self.lost_reason.get(s, "lost") for s in seq_ids if s in self.placement}
        if dup or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence(s) already open: {dup[:8] or seq_ids[:8]}")
        opened: list[int] = []               # placed by this call: undone if it fails
        room: dict[int, int] = {}            # group index -> at most this many more, in this call
        refusals: dict[int, str] = {}        # group index -> its last capacity refusal
        todo = seq_ids
        # Rounds: failed groups (down, draining) and halvings of a refusing group's room.
        rounds = 2 * len(self.workers) + 2 + len(self.groups) * max(1, len(seq_ids)).bit_length()
        try:
            for _ in range(rounds):
                if not todo:
                    return
                todo = self._open_once(todo, opened, room, refusals)
            if todo:
                raise AttentionError(f"could not place {len(todo)} sequence(s) on any R-worker")
        except BaseException:
            self.close(opened)               # frees them on their workers too (ordered on the stream)
            with self.lock:                  # lost ones stay lost, for the engine to re-open
                for s, reason in was_lost.items():
                    if s not in self.placement:
                        self.placement[s], self.lost_reason[s] = None, reason
                self._plans.clear()
            raise

    def _open_once(self, seq_ids: list[int], opened: list[int], room: dict[int, int],
                   refusals: dict[int, str]) -> list[int]:
        """Place and open; appends the ids now open to `opened`, lowers `room` of the groups
        that refused for capacity (and of those that took ids), and returns the ids that must
        be placed again (their group failed, or no group had room in this round)."""
        groups = [g for g in self.groups if g.accepting and room.get(g.index, 1) > 0]
        if not any(g.accepting for g in self.groups):     # not when they are only full
            self._revive_all()
            groups = [g for g in self.groups if g.accepting and room.get(g.index, 1) > 0]
        if not groups:
            if refusals:
                raise KVCapacityError(f"no R-worker has room for {len(seq_ids)} more sequence(s), none opened: "
                                      + "; ".join(refusals.values())[:1000])
            states = "; ".join(f"{w.address}: {'draining' if w.up else 'down (' + w.reason + ')'}"
                               for w in self.workers)
            raise AttentionError(f"no R-worker available for new sequences ({states})")
        chosen = self._place(seq_ids, groups, room)
        placed = {s for ids in chosen.values() for s in ids}
        retry = [s for s in seq_ids if s not in placed]
        calls = []
        for g, ids in chosen.items():
            for w in g.workers:
                calls.append((g, w, ids, w.send(pb.Request(open=pb.Open(seq_ids=ids)))))
        error = None
        failed_groups = set()
        for g, w, ids, fut in calls:
            try:
                reply = fut.result(timeout=self.timeout + 1.0)
            except (WorkerLost, FutureTimeout) as e:
                if isinstance(e, FutureTimeout):
                    w.fail(w.generation, f"no reply to Open within {self.timeout:g} s")
                failed_groups.add(g.index)
                continue
            if reply.code == grpc.StatusCode.UNAVAILABLE.value[0]:      # draining
                w.draining = True
                failed_groups.add(g.index)
            elif reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:   # no room for all of ids
                room[g.index] = min(room.get(g.index, len(ids)), len(ids) // 2)
                refusals[g.index] = f"{w.address}: {reply.message}"
                failed_groups.add(g.index)
            elif reply.code:
                error = error or _reply_error(w.address, reply)
                failed_groups.add(g.index)
        with self.lock:
            for g, ids in chosen.items():
                if g.index in failed_groups:
                    for w in g.workers:            # undo the members that did open them
                        if w.up:
                            w.send(pb.Request(close=pb.Close(seq_ids=ids)))
                    retry.extend(ids)
                    continue
                for s in ids:
                    self.placement[s] = g
                    self.lost_reason.pop(s, None)
                    self.seq_tokens[s] = 0
                    g.seqs.add(s)
                opened.extend(ids)
                if g.index in room:
                    room[g.index] -= len(ids)
            self._plans.clear()
        if error is not None:
            raise error
        return retry

    def _place(self, seq_ids: list[int], groups: list[_Group],
               room: dict[int, int] | None = None) -> dict[_Group, list[int]]:
        """Least KV load (tokens) first. A new, still empty sequence counts as the mean length
        of those already placed, so a batch of opens spreads instead of piling on one group.
        A group gets at most room[index] ids (when given); ids no group has room for are left out."""
        room = dict(room or {})
        with self.lock:
            n = sum(len(g.seqs) for g in self.groups)
            mean = max(1.0, sum(g.tokens for g in self.groups) / n) if n else 1.0
            load = {g: g.tokens + mean * sum(1 for s in g.seqs if self.seq_tokens.get(s, 0) == 0) for g in groups}
        chosen: dict[_Group, list[int]] = {}
        for s in seq_ids:
            fit = [g for g in groups if room.get(g.index, 1) > 0]
            if not fit:
                break
            g = min(fit, key=lambda g: (load[g], g.index))
            chosen.setdefault(g, []).append(s)
            load[g] += mean
            if g.index in room:
                room[g.index] -= 1
        return chosen

    def close(self, seq_ids: Sequence[int]) -> None:
        by_group: dict[_Group, list[int]] = {}
        with self.lock:
            for s in seq_ids:
                s = int(s)
                g = self.placement.pop(s, None)
                self.lost_reason.pop(s, None)
                tokens = self.seq_tokens.pop(s, 0)
                if g is not None:
                    g.seqs.discard(s)
                    g.tokens -= tokens
                    by_group.setdefault(g, []).append(s)
            self._plans.clear()
        for g, ids in by_group.items():
            for w in g.workers:
                w.send(pb.Request(close=pb.Close(seq_ids=ids)))   # ordered on the stream; no wait

    def _plan(self, seq_ids: Sequence[int]):
        """Rows of the batch per live group, and the rows whose KV is lost; cached per batch."""
        key = tuple(map(int, seq_ids))
        with self.lock:
            plan = self._plans.get(key)
            if plan is not None:
                return plan
            rows: dict[_Group, list[int]] = {}
            lost: list[int] = []
            for i, s in enumerate(key):
                if s not in self.placement:
                    raise KeyError(f"unknown sequence id {s}")
                g = self.placement[s]
                if g is None:
                    lost.append(i)
                else:
                    rows.setdefault(g, []).append(i)
            parts = [(g, np.asarray(r, dtype=np.int64), [key[i] for i in r]) for g, r in rows.items()]
            plan = (parts, np.asarray(lost, dtype=np.int64))
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
            return plan

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.spec.num_layers})")

    def _kv_wire(self, x: torch.Tensor) -> np.ndarray:
        """k, v as sent: fp16 for an fp16 store (what it keeps anyway), else fp32/fp16 as given."""
        if self.kv_format == "fp16" and x.dtype != torch.float16:
            _check(x)
            return _to_fp16(x.detach())
        return _numpy(x)

    def submit_decode(self, layer, seq_ids, q, k, v) -> Future:
        t0 = time.perf_counter()
        self._check_layer(layer)
        spec, b = self.spec, len(seq_ids)
        if q.shape != (b, spec.num_heads, spec.head_dim) or k.shape != (b, spec.num_kv_heads, spec.head_dim) \
                or v.shape != k.shape:
            raise ValueError(f"decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                             f"{b} sequences of {spec}")
        parts, lost_rows = self._plan(seq_ids)
        if q.dtype == torch.bfloat16:           # its bits, widened on the worker
            qn, q_wire = np.ascontiguousarray(q.detach().contiguous().view(torch.int16).numpy().view(np.uint16)), \
                "bfloat16"
        else:
            qn = _numpy(q)
            q_wire = qn.dtype.name
        kn, vn = self._kv_wire(k), self._kv_wire(v)
        out = torch.empty(b, spec.num_heads, spec.head_dim, dtype=torch.float32)
        row_bytes = (qn[0].nbytes + kn[0].nbytes + vn[0].nbytes) if b else 1
        chunk = max(1, MAX_MESSAGE_BYTES // max(1, row_bytes // len(self.kv_heads)))
        sends = []
        for g, rows, ids in parts:
            whole = len(parts) == 1 and len(rows) == b      # one group holds the batch: no gather copy
            for a in range(0, len(rows), chunk):
                r, r_ids = rows[a:a + chunk], ids[a:a + chunk]
                whole_chunk = whole and len(r) == b
                for w, hq, hk in zip(g.workers, self.q_heads, self.kv_heads):
                    sends.append((w, r, r_ids, hq, hk, whole_chunk))
        gather = _Gather(out, seq_ids, len(sends), self, t0)
        if len(lost_rows):
            ids = [seq_ids[i] for i in lost_rows]
            gather.lose(lost_rows, "; ".join(sorted({self.lost_reason.get(s, "lost") for s in ids}))[:500])
        if layer == 0:
            with self.lock:
                for g, rows, ids in parts:
                    g.tokens += len(ids)
                    for s in ids:
                        self.seq_tokens[s] += 1
        if not sends:
            gather.finish()
            return gather.future
        requests = []
        for w, r, r_ids, hq, hk, whole_chunk in sends:
            if whole_chunk and len(self.kv_heads) == 1:
                qa, ka, va = qn, kn, vn
            elif len(self.kv_heads) == 1:            # whole rows: np.take is a row memcpy
                qa, ka, va = qn.take(r, axis=0), kn.take(r, axis=0), vn.take(r, axis=0)
            else:
                qa, ka, va = qn[r, hq], kn[r, hk], vn[r, hk]
            call_id = w.next_id()
            requests.append((call_id, encode_decode_request(call_id, layer, r_ids, qa, ka, va, q_wire)))
        # Build every message before sending any: a stream's sender thread woken early would
        # contend for the GIL with this one (costly when the OS deschedules the holder).
        gather.encoded_ns = time.perf_counter_ns()
        for (w, r, _, hq, _, _), (call_id, data) in zip(sends, requests):
            fut = w.send_bytes(call_id, data)
            fut.add_done_callback(lambda f, w=w, r=r, hq=hq: gather.part_done(f, w, r, hq))
        self.decode_submit_s += time.perf_counter() - t0
        return gather.future

    def prefill(self, layer, seq_ids, lens, k, v) -> None:
        self._check_layer(layer)
        spec = self.spec
        lens = [int(n) for n in lens]
        if len(lens) != len(seq_ids) or any(n < 0 for n in lens):
            raise ValueError("prefill: need one length >= 0 per sequence")
        want = (sum(lens), spec.num_kv_heads, spec.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"prefill: k {tuple(k.shape)}, v {tuple(v.shape)}, expected {want}")
        parts, lost_rows = self._plan(seq_ids)
        if len(lost_rows):
            ids = [seq_ids[i] for i in lost_rows]
            raise SequencesLost(ids, self.lost_reason.get(ids[0], "lost"))
        kn, vn = self._kv_wire(k), self._kv_wire(v)
        starts = np.concatenate([[0], np.cumsum(lens)])
        token_bytes = max(1, kn[0].nbytes * 2 // len(self.kv_heads)) if len(kn) else 1
        budget = max(1, MAX_MESSAGE_BYTES // token_bytes)      # tokens per message
        calls = []
        for g, rows, ids in parts:
            for chunk_ids, chunk_lens, tok in self._prefill_chunks(rows, ids, lens, starts, budget):
                for w, hk in zip(g.workers, self.kv_heads):
                    req = pb.Request(prefill=pb.Prefill(layer=layer, seq_ids=chunk_ids, lens=chunk_lens,
                                                        k=to_tensor(kn[tok, hk]), v=to_tensor(vn[tok, hk])))
                    calls.append((g, w, chunk_ids, w.send(req)))
        lost, error, refused = [], None, []
        for g, w, ids, fut in calls:
            try:
                reply = fut.result(timeout=self.timeout + 1.0)
                if reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:     # that worker's only
                    refused.append((ids, f"R-worker {w.address}: {reply.message}"))
                elif reply.code:
                    error = error or _reply_error(w.address, reply)
            except FutureTimeout:
                w.fail(w.generation, f"no reply to Prefill within {self.timeout:g} s")
                lost.extend(ids)
            except WorkerLost:
                lost.extend(ids)
        if refused:                      # lost ones with them: the engine recomputes both alike
            ids = list(dict.fromkeys([s for r, _ in refused for s in r] + lost))
            raise KVCapacityError(refused[0][1], ids)
        if lost:
            lost = list(dict.fromkeys(lost))
            raise SequencesLost(lost, self.lost_reason.get(lost[0], "R-worker lost"))
        if error is not None:
            raise error
        if layer == 0:
            with self.lock:
                for s, n in zip(seq_ids, lens):
                    g = self.placement.get(s)
                    if g is not None:
                        self.seq_tokens[s] += n
                        g.tokens += n

    @staticmethod
    def _prefill_chunks(rows, ids, lens, starts, budget):
        """Split one group's prefill into messages of <= budget tokens (a long prompt spans several)."""
        chunk_ids, chunk_lens, chunk_tok, used = [], [], [], 0
        for i, s in zip(rows, ids):
            a, n = int(starts[i]), lens[i]
            while True:
                take = min(n, budget - used)
                chunk_ids.append(s)
                chunk_lens.append(take)
                chunk_tok.append(np.arange(a, a + take))
                used += take
                a, n = a + take, n - take
                if used >= budget:
                    yield chunk_ids, chunk_lens, np.concatenate(chunk_tok)
                    chunk_ids, chunk_lens, chunk_tok, used = [], [], [], 0
                if n == 0:
                    break
        if chunk_ids:
            yield chunk_ids, chunk_lens, np.concatenate(chunk_tok)

    # ---- bookkeeping --------------------------------------------------------------------
    def _account(self, wall_s: float, kernel_s: float, handler_s: float) -> None:
        with self.lock:
            self.decode_calls += 1
            self.decode_wall_s += wall_s
            self.decode_kernel_s += kernel_s
            self.decode_handler_s += handler_s

    def available(self) -> bool:
        return any(g.accepting for g in self.groups)

    def stats(self) -> dict:
        spec = self.spec
        per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (2 if self.kv_format == "fp16" else 1)
        with self.lock:
            workers = [{"address": w.address, "up": w.up, "draining": w.draining, "reason": "" if w.up else w.reason,
                        "sequences": len(self.group_of_worker[w.index].seqs),
                        "kv_tokens": self.group_of_worker[w.index].tokens,
                        "calls": w.calls, "kernel_s": w.kernel_s} for w in self.workers]
            tokens = sum(g.tokens for g in self.groups)
            return {"sequences": sum(len(g.seqs) for g in self.groups), "kv_tokens": tokens,
                    "kv_bytes": tokens * per_token if self.kv_format == "fp16" else tokens * per_token // 4,
                    "capacity_bytes": sum(w.capacity_bytes for w in self.workers if w.up),
                    "lost_sequences": self.lost_total, "decode_calls": self.decode_calls,
                    "decode_wall_s": self.decode_wall_s, "decode_kernel_s": self.decode_kernel_s,
                    "decode_handler_s": self.decode_handler_s, "decode_submit_s": self.decode_submit_s,
                    "workers": workers}

    def shutdown(self) -> None:
        self._stop.set()
        if getattr(self, "_monitor", None) is not None:
            self._monitor.join(timeout=2.0)
        for w in self.workers:
            w.close()
