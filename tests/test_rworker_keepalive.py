"""R-worker reliability (#17): keepalive frees the KV and session of an S-worker whose host is cut
off or killed, and the S-worker's channel keepalive matches the server's policy.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading

from fastdecode.ops.testing import Spawned

from test_rworker_limits import REPO, Client, fill_and_decode, stats, wait_for


# ---- keepalive (item 7) -----------------------------------------------------------------
class FreezableProxy:
    """A TCP relay that can go silent like a cut cable: nothing forwarded, nothing closed."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self.sockets += [down, up]
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data or self.frozen.is_set():
                return                                   # stop reading; the sockets stay open
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def test_cut_off_s_worker_loses_its_kv_and_session(tmp_path):
    with Spawned(["--keepalive-time", "1", "--keepalive-timeout", "1"], tmp_path / "w.log") as w:
        bystander = Client(w.address)
        assert bystander.open([1]).code == 0
        fill_and_decode(bystander, 1, seed=8)
        kept = stats(w.address)
        proxy = FreezableProxy(w.address)
        cut = Client(proxy.address)
        try:
            assert cut.open([1, 2]).code == 0
            fill_and_decode(cut, 2, seed=9, tokens=40)
            assert stats(w.address).bytes_used > kept.bytes_used and stats(w.address).connections == 2
            proxy.frozen.set()                           # the S-worker host drops off the network
            wait_for(lambda: stats(w.address).connections == 1, what="the cut-off session to end")
            after = stats(w.address)
            assert (after.sequences, after.bytes_used) == (kept.sequences, kept.bytes_used)
            assert bystander.open([3]).code == 0         # the others keep serving
            fill_and_decode(bystander, 3, seed=10)
        finally:
            cut.channel.close()
            proxy.close()
        bystander.close()


_CLIENT = """
import sys, threading, grpc, numpy as np
from rpart.proto import rworker_pb2 as pb, rworker_pb2_grpc as pb_grpc
def reqs():
    yield pb.Request(call_id=1, configure=pb.Configure(num_layers=2, num_kv_heads=2, head_dim=16, kv_format="fp16"))
    yield pb.Request(call_id=2, open=pb.Open(seq_ids=[1]))
    k = np.ones((30, 2, 16), np.float16)
    t = pb.Tensor(data=k.tobytes(), shape=k.shape, dtype="float16")
    yield pb.Request(call_id=3, prefill=pb.Prefill(layer=0, seq_ids=[1], lens=[30], k=t, v=t))
    threading.Event().wait()
replies = pb_grpc.RWorkerStub(grpc.insecure_channel(sys.argv[1])).Session(reqs())
for r in replies:
    assert r.code == 0, r.message
    if r.call_id == 3:
        print("FILLED", flush=True)
"""


def test_killed_s_worker_loses_its_kv(tmp_path):
    with Spawned(["--keepalive-time", "1", "--keepalive-timeout", "1"], tmp_path / "w.log") as w:
        proc = subprocess.Popen([sys.executable, "-c", _CLIENT, w.address], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "FILLED"
            assert stats(w.address).bytes_used > 0
        finally:
            proc.kill()                                  # SIGKILL: no goodbye on the stream
            proc.wait(timeout=10)
        wait_for(lambda: (lambda s: (s.sequences, s.bytes_used, s.connections))(stats(w.address)) == (0, 0, 0),
                 what="the killed client's KV freed")


def test_s_worker_channel_keepalive_matches_the_server_policy(monkeypatch):
    from fastdecode.attention.remote import connection as remote
    from rpart.wire import MIN_CLIENT_PING_INTERVAL_MS, client_keepalive_options

    seen = {}
    monkeypatch.setattr(remote.grpc, "insecure_channel", lambda address, options: seen.update(options))
    remote.WorkerConnection("127.0.0.1:1", 0, None, 1.0, None, (), lambda *a: None)._new_channel()
    assert set(client_keepalive_options()) <= set(seen.items())
    assert seen["grpc.keepalive_time_ms"] >= MIN_CLIENT_PING_INTERVAL_MS      # never "too many pings"


def test_keepalive_flags_reach_the_server_options():
    from rworker.__main__ import _options, parse_args

    opts = _options(parse_args(["--keepalive-time", "5", "--keepalive-timeout", "2", "--insecure",
                                "--max-sequences-per-connection", "9", "--max-table-memory", "1M"]))
    assert (opts.keepalive_time_s, opts.keepalive_timeout_s, opts.insecure) == (5.0, 2.0, True)
    assert (opts.max_sequences_per_connection, opts.max_table_bytes) == (9, 1 << 20)
