"""The R-worker gRPC server: service + health + token/TLS, and its drain-then-exit lifecycle."""
from __future__ import annotations

import ipaddress
import logging
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rpart.auth import TokenInterceptor, server_credentials
from rpart.proto import rworker_pb2 as pb
from rworker.service import RWorkerService, default_store_factory
from rpart.wire import (HTTP2_OPTIONS, KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, keep_freed_memory,
                          server_keepalive_options)

log = logging.getLogger("rworker")
SERVICE_NAME = "fastdecode.rworker.RWorker"


def _reply_bytes(reply) -> bytes:
    """Session replies: decode replies come already serialised (rpart.wire.encode_reply_o)."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def _add_service(service: RWorkerService, server: grpc.Server) -> None:
    """What the generated add_RWorkerServicer_to_server does, but with _reply_bytes for Session."""
    handlers = {
        "Session": grpc.stream_stream_rpc_method_handler(
            service.Session, request_deserializer=pb.Request.FromString, response_serializer=_reply_bytes),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, request_deserializer=pb.StatsRequest.FromString,
            response_serializer=pb.StatsReply.SerializeToString),
        "Drain": grpc.unary_unary_rpc_method_handler(
            service.Drain, request_deserializer=pb.DrainRequest.FromString,
            response_serializer=pb.DrainReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


@dataclass
class ServerOptions:
    listen: str = "127.0.0.1:50061"
    kv_capacity: int = 1 << 30
    threads: int = 0
    block_size: int = 16
    int4_fp16_tail: bool = True  # int4 KV: keep each sequence's newest block in fp16 too
    int4_k_group: int = 0        # int4 KV: channels per scale and zero of keys / values; 0 = the kernel's
    int4_v_group: int = 0
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    max_message_bytes: int = 64 << 20
    max_connections: int = 64
    max_sequences: int = 1 << 18
    max_sequences_per_connection: int = 1 << 16
    max_table_bytes: int = 512 << 20  # per-sequence tables outside the KV pool, all clients together
    drain_timeout_s: float = 60.0
    keepalive_time_s: float = KEEPALIVE_TIME_MS / 1000
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_MS / 1000
    insecure: bool = False       # serve a non-loopback address without a token or mutual TLS
    health_listen: str = ""      # also serve grpc.health.v1 alone, in plaintext, here (for kubelet probes)


def is_loopback(listen: str) -> bool:
    """Whether only this host can reach `listen` (HOST:PORT, [V6]:PORT or unix:PATH)."""
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                 # a host name: it may resolve to any interface


def check_exposure(opts: ServerOptions) -> None:
    """Refuse to serve a non-loopback address unauthenticated unless opts.insecure says so."""
    mtls = bool(opts.tls_cert and opts.tls_key and opts.tls_client_ca)
    if is_loopback(opts.listen) or opts.token or mtls:
        if opts.token and not opts.tls_cert and not is_loopback(opts.listen):
            log.warning("the token crosses the network in plaintext: add --tls-cert/--tls-key")
        return
    if not opts.insecure:
        raise ValueError(f"refusing to listen on {opts.listen} without authentication: give --token/--token-file "
                         "or mutual TLS (--tls-cert, --tls-key, --tls-client-ca), bind a loopback address, "
                         "or pass --insecure to serve anyone who can reach the port")
    log.warning("--insecure: %s serves anyone who can reach it (no token, no mutual TLS)", opts.listen)


class RWorkerServer:
    def __init__(self, opts: ServerOptions, store_factory=default_store_factory) -> None:
        check_exposure(opts)
        self.opts = opts
        keep_freed_memory()
        self.service = RWorkerService(opts.kv_capacity, opts.threads, opts.block_size, store_factory,
                                      opts.max_sequences, int4_fp16_tail=opts.int4_fp16_tail,
                                      int4_k_group=opts.int4_k_group, int4_v_group=opts.int4_v_group,
                                      max_sequences_per_connection=opts.max_sequences_per_connection,
                                      max_table_bytes=opts.max_table_bytes)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.service.on_drain = lambda: self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # A stream holds one thread for its life; a few more serve Stats, Drain and health.
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=opts.max_connections + 8, thread_name_prefix="rpc"),
            interceptors=[TokenInterceptor(opts.token)] if opts.token else [],
            options=[("grpc.max_receive_message_length", opts.max_message_bytes),
                     ("grpc.max_send_message_length", opts.max_message_bytes),
                     *HTTP2_OPTIONS,
                     *server_keepalive_options(int(opts.keepalive_time_s * 1000),
                                               int(opts.keepalive_timeout_s * 1000)),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=opts.max_connections + 8)
        _add_service(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = _listen(self.server, opts)
        self.health_server, self.health_address = self._health_only(opts.health_listen)

    def _health_only(self, listen: str) -> tuple[grpc.Server | None, str]:
        """A plaintext server of the health service alone: probes that cannot speak (m)TLS."""
        if not listen:
            return None, ""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                             options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        return server, f"{listen.rsplit(':', 1)[0]}:{port}"

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _servers(self) -> list[grpc.Server]:
        return [self.server] + ([self.health_server] if self.health_server is not None else [])

    def start(self) -> None:
        for server in self._servers():
            server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None = None) -> None:
        for server in self._servers():
            server.stop(grace).wait()

    def drain_and_stop(self) -> None:
        """Refuse new sequences, wait for the open ones to close (bounded), then stop."""
        self.service.drain()
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while self.service.open_sequences() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.service.open_sequences()
        if left:
            log.warning("drain timeout: stopping with %d sequence(s) still open", left)
        self.health.enter_graceful_shutdown()
        self.stop(grace=1.0)
        log.info("stopped")


def _listen(server: grpc.Server, opts: ServerOptions) -> str:
    """Add the service port (TLS when a certificate is given); its host:port."""
    if opts.tls_cert or opts.tls_key:
        if not (opts.tls_cert and opts.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        creds = server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)
    elif opts.tls_client_ca:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    try:
        port = server.add_secure_port(opts.listen, creds) if opts.tls_cert else server.add_insecure_port(opts.listen)
    except RuntimeError as e:               # grpc raises where older versions returned 0
        raise OSError(f"cannot listen on {opts.listen}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {opts.listen}")
    return f"{opts.listen.rsplit(':', 1)[0]}:{port}"


def serve(opts: ServerOptions, store_factory=default_store_factory) -> int:
    server = RWorkerServer(opts, store_factory)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    log.info("serving on %s (capacity %d bytes, threads %d, tls %s, token %s, keepalive %gs + %gs)",
             server.address, opts.kv_capacity, opts.threads, bool(opts.tls_cert), bool(opts.token),
             opts.keepalive_time_s, opts.keepalive_timeout_s)
    if server.health_address:
        log.info("health service alone, in plaintext, on %s", server.health_address)
    print(f"READY {server.address}", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    log.info("SIGTERM: draining")
    server.drain_and_stop()
    return 0
