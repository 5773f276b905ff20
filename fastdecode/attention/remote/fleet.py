"""The R-workers of one backend, in groups of `head_shards`, and their health.

Member j of a group holds kv heads shard j of every sequence placed on the group (query
heads follow their kv heads); with head_shards=1 a group is one worker holding whole
sequences. A monitor thread fails calls that miss the deadline (rworker_timeout_s), probes
down workers (health service) and reconnects them, and stops placing on draining ones.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from fastdecode.attention.base import AttentionError, KVSpec
from fastdecode.attention.remote.connection import WorkerConnection
from rpart.auth import bearer, channel_credentials
from rpart.proto import rworker_pb2 as pb

log = logging.getLogger("fastdecode.remote")

PROBE_INTERVAL_S = 0.5              # how often down workers are probed for a reconnect


class WorkerGroup:
    """head_shards workers that together hold all kv heads of their sequences."""

    def __init__(self, index: int, workers: list[WorkerConnection]) -> None:
        self.index, self.workers = index, workers
        self.seqs: set[int] = set()
        self.tokens = 0

    @property
    def up(self) -> bool:
        return all(w.up for w in self.workers)

    @property
    def accepting(self) -> bool:
        return self.up and not any(w.draining for w in self.workers)


class Fleet:
    """Connections to config.rworkers, grouped for head sharding; start() connects them and
    keeps them connected. A worker going down calls _worker_down."""

    def __init__(self, spec: KVSpec, config) -> None:
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
        group = spec.num_heads // spec.num_kv_heads
        bounds = [j * spec.num_kv_heads // shards for j in range(shards + 1)]
        self.kv_heads = [slice(bounds[j], bounds[j + 1]) for j in range(shards)]
        self.q_heads = [slice(s.start * group, s.stop * group) for s in self.kv_heads]
        credentials = None
        if config.rworker_tls_ca:
            credentials = channel_credentials(config.rworker_tls_ca, config.rworker_tls_cert, config.rworker_tls_key)
        metadata = bearer(config.rworker_token)
        # A TLS port closes a plaintext connection, and a mutual-TLS port one without a client
        # certificate its --tls-client-ca signed, before any reply: the client reads only "Socket closed".
        self.closed_hint = " (closed before any reply: " + (
            "if the R-worker serves TLS, set rworker_tls_ca" if not config.rworker_tls_ca else
            "if it wants mutual TLS, set rworker_tls_cert and rworker_tls_key" if not config.rworker_tls_cert else
            "if it wants mutual TLS, its --tls-client-ca must have signed rworker_tls_cert") + ")"
        self.workers = [
            WorkerConnection(a, i, pb.Configure(num_layers=spec.num_layers, num_kv_heads=s.stop - s.start,
                                                head_dim=spec.head_dim, kv_format=config.kv_format),
                             self.timeout, credentials, metadata, self._worker_down)
            for i, (a, s) in enumerate(zip(addresses, itertools.cycle(self.kv_heads)))]
        self.groups = [WorkerGroup(g, self.workers[g * shards:(g + 1) * shards])
                       for g in range(len(addresses) // shards)]
        self.group_of_worker = {w.index: self.groups[w.index // shards] for w in self.workers}
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        """Connect every worker (in parallel) and start the monitor; raises AttentionError
        when no group is reachable."""
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

    def _worker_down(self, w: WorkerConnection, reason: str) -> None:
        """w's stream broke (called once per stream, before its pending calls fail)."""

    def _try_connect(self, w: WorkerConnection) -> bool:
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
                    if "Socket closed" in (e.details() or ""):
                        w.reason += self.closed_hint
                log.info("R-worker %s not connected: %s", w.address, w.reason)
                return False

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

    def _probe(self, w: WorkerConnection) -> None:
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

    def _reconnect(self, w: WorkerConnection) -> None:
        try:
            self._try_connect(w)
        finally:
            w.probing = False

    def _revive_all(self) -> None:
        """Before giving up for lack of workers: one synchronous reconnect attempt each."""
        for w in self.workers:
            if not w.up:
                self._try_connect(w)

    def available(self) -> bool:
        return any(g.accepting for g in self.groups)

    def shutdown(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2.0)
        for w in self.workers:
            w.close()
