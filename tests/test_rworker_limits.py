"""R-worker reliability and security under load (#17): the KV shape cannot change under a
connected session and a store that fails to build breaks nobody; per-connection limits hold
against a client that tries to exceed them; connection numbers never overflow the stored ids;
a non-loopback bind needs a token, mutual TLS or --insecure; keepalive frees the KV of an
S-worker whose host is cut off.
"""
from __future__ import annotations

import contextlib
import queue
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from rworker.refstore import NumpyKVStore
from rworker.server import RWorkerServer, ServerOptions, check_exposure, is_loopback
from rworker.connection import CONNECTION_BITS, ID_BITS, MAX_LAYERS, Connection, table_bytes
from fastdecode.ops.testing import Spawned

C = grpc.StatusCode
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16, kv_format="fp16")
OTHER_SHAPE = dict(num_layers=3, num_kv_heads=2, head_dim=16, kv_format="fp16")
H = 4
REPO = Path(__file__).resolve().parent.parent


def code(reply) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code)


class Client:
    """One Session stream; call() sends one request and waits for its reply."""

    def __init__(self, address: str, shape: dict | None = SHAPE) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = pb_grpc.RWorkerStub(self.channel).Session(iter(self.requests.get, None))
        self.next_id = 0
        if shape is not None:
            r = self.configure(shape)
            assert r.code == 0, r.message

    def call(self, **op) -> pb.Reply:
        self.next_id += 1
        self.requests.put(pb.Request(call_id=self.next_id, **op))
        reply = next(self.replies)
        assert reply.call_id == self.next_id
        return reply

    def configure(self, shape: dict) -> pb.Reply:
        return self.call(configure=pb.Configure(**shape))

    def open(self, ids) -> pb.Reply:
        return self.call(open=pb.Open(seq_ids=list(ids)))

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def tensor(a: np.ndarray) -> pb.Tensor:
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=a.dtype.name)


def fill_and_decode(client: Client, seq_id: int, seed: int, shape: dict = SHAPE, tokens: int = 5) -> np.ndarray:
    """Prefill `tokens` tokens of every layer, then decode one on layer 0; checks o against numpy."""
    rng = np.random.default_rng(seed)
    hkv, d = shape["num_kv_heads"], shape["head_dim"]
    ks = vs = None
    for layer in range(shape["num_layers"]):
        k = rng.standard_normal((tokens, hkv, d)).astype(np.float16)
        v = rng.standard_normal((tokens, hkv, d)).astype(np.float16)
        r = client.call(prefill=pb.Prefill(layer=layer, seq_ids=[seq_id], lens=[tokens], k=tensor(k), v=tensor(v)))
        assert r.code == 0, r.message
        if layer == 0:
            ks, vs = k, v
    q = rng.standard_normal((1, H, d)).astype(np.float32)
    k1 = rng.standard_normal((1, hkv, d)).astype(np.float16)
    v1 = rng.standard_normal((1, hkv, d)).astype(np.float16)
    r = client.call(decode=pb.Decode(layer=0, seq_ids=[seq_id], q=tensor(q), k=tensor(k1), v=tensor(v1)))
    assert r.code == 0, r.message
    o = np.frombuffer(r.o.data, np.float32).reshape(tuple(r.o.shape))[0]
    kk = np.repeat(np.concatenate([ks, k1]).astype(np.float32), H // hkv, axis=1)
    vv = np.repeat(np.concatenate([vs, v1]).astype(np.float32), H // hkv, axis=1)
    s = np.einsum("hd,thd->ht", q[0], kk) / np.sqrt(d)
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(o, np.einsum("ht,thd->hd", p / p.sum(1, keepdims=True), vv), rtol=1e-4, atol=1e-5)
    return o


def stats(address: str) -> pb.StatsReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def in_process(store_factory=NumpyKVStore, **opts):
    """An RWorkerServer in this process (its service is reachable for white-box checks)."""
    server = RWorkerServer(ServerOptions(listen="127.0.0.1:0", kv_capacity=4 << 20, threads=1, **opts),
                           store_factory)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


class CountingStore:
    """A store that holds no KV: for limits checked before any allocation."""

    isa = "counting"

    def __init__(self, **kwargs) -> None:
        self.ids: set[int] = set()

    def create(self, ids) -> None:
        self.ids.update(int(i) for i in ids)

    def free(self, ids) -> None:
        self.ids.difference_update(int(i) for i in ids)

    def stats(self) -> dict:
        return {"sequences": len(self.ids)}


# ---- the KV shape (item 2) --------------------------------------------------------------
def test_another_shape_is_refused_while_a_session_uses_the_store():
    with in_process() as server:
        idle = Client(server.address)                    # configured, no sequence yet
        other = Client(server.address, shape=None)
        r = other.configure(OTHER_SHAPE)
        assert code(r) == C.FAILED_PRECONDITION, r.message
        assert "layers=2" in r.message and "layers=3" in r.message, r.message   # both shapes named
        assert idle.open([1]).code == 0                  # the idle S-worker's next calls still work
        fill_and_decode(idle, 1, seed=0)
        assert code(other.open([1])) == C.FAILED_PRECONDITION                    # not configured
        idle.close()
        wait_for(lambda: stats(server.address).connections == 1, what="the idle session to end")
        assert other.configure(OTHER_SHAPE).code == 0    # nobody uses the old shape: it may change
        assert other.open([1]).code == 0
        fill_and_decode(other, 1, seed=1, shape=OTHER_SHAPE)
        other.close()


def test_a_store_that_fails_to_build_leaves_no_broken_store():
    built = []

    def factory(**kwargs):
        built.append(kwargs["head_dim"])
        if kwargs["head_dim"] == 64:
            raise ValueError("cannot build a store for head_dim 64")
        return NumpyKVStore(**kwargs)

    bad_shape = {**SHAPE, "head_dim": 64}
    with in_process(factory) as server:
        tenant = Client(server.address)                                           # configured, idle
        prober = Client(server.address, shape=None)
        assert code(prober.configure(bad_shape)) == C.FAILED_PRECONDITION        # the tenant's shape is in use
        assert built == [16]                                                      # nothing rebuilt
        assert tenant.open([1]).code == 0
        fill_and_decode(tenant, 1, seed=2)
        tenant.close()
        wait_for(lambda: stats(server.address).connections == 1, what="the tenant's session to end")

        assert prober.configure(SHAPE).code == 0                                  # alone now: it may reshape
        r = prober.configure(bad_shape)                                           # and that build fails
        assert code(r) == C.INVALID_ARGUMENT and "head_dim 64" in r.message, r.message
        r = prober.open([1])
        assert code(r) == C.FAILED_PRECONDITION, r.message                         # refused cleanly, not INTERNAL
        assert stats(server.address).sequences == 0
        late = Client(server.address)                                             # a good shape builds a store
        assert late.open([1]).code == 0
        fill_and_decode(late, 1, seed=3)
        assert prober.configure(SHAPE).code == 0 and prober.open([1]).code == 0
        fill_and_decode(prober, 1, seed=4)
        late.close()
        prober.close()


# ---- connection numbers (item 9) --------------------------------------------------------
def test_connection_numbers_wrap_below_the_id_limit_and_skip_those_in_use():
    top = (1 << CONNECTION_BITS) - 1
    assert Connection("x", top).base + (1 << ID_BITS) - 1 < 1 << 63             # the largest stored id fits int64
    with in_process() as server:
        first = Client(server.address)                                          # number 1
        server.service.next_number = top                                        # as after 2**23 - 2 sessions
        last = Client(server.address)                                           # the largest number
        wrapped = Client(server.address)                                        # wraps; 1 is in use
        assert sorted(server.service.connections) == [1, 2, top]
        outputs = []
        for seed, client in enumerate((first, last, wrapped)):
            assert client.open([7]).code == 0                                   # the same client id on each
            outputs.append(fill_and_decode(client, 7, seed=10 + seed))
        assert stats(server.address).sequences == 3
        assert not np.allclose(outputs[0], outputs[1])                          # three distinct caches
        for client in (first, last, wrapped):
            client.close()
        wait_for(lambda: stats(server.address).sequences == 0, what="sequences freed")


# ---- per-connection limits (item 5) -----------------------------------------------------
def test_too_many_layers_are_refused_and_others_keep_serving():
    with in_process() as server:
        tenant = Client(server.address)
        assert tenant.open([1]).code == 0
        greedy = Client(server.address, shape=None)
        r = greedy.configure({**SHAPE, "num_layers": MAX_LAYERS + 1})
        assert code(r) == C.INVALID_ARGUMENT and "num_layers" in r.message, r.message
        fill_and_decode(tenant, 1, seed=5)
        greedy.close()
        tenant.close()


def test_sequences_per_connection_are_limited():
    with in_process(max_sequences_per_connection=4) as server:
        greedy, other = Client(server.address), Client(server.address)
        r = greedy.open(range(5))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-sequences-per-connection" in r.message, r.message
        assert stats(server.address).sequences == 0                             # none of them opened
        assert greedy.open(range(4)).code == 0
        assert code(greedy.open([4])) == C.RESOURCE_EXHAUSTED
        assert other.open(range(4)).code == 0                                   # another tenant has its own quota
        fill_and_decode(other, 3, seed=6)
        assert greedy.call(close=pb.Close(seq_ids=[0])).code == 0
        assert greedy.open([4]).code == 0
        assert stats(server.address).sequences == 8
        greedy.close()
        other.close()


def test_table_memory_outside_the_kv_pool_is_limited():
    with in_process(max_table_bytes=table_bytes(SHAPE["num_layers"], 6)) as server:
        greedy, other = Client(server.address), Client(server.address)
        r = greedy.open(range(7))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-table-memory" in r.message, r.message
        assert greedy.open(range(4)).code == 0
        assert other.open([1, 2]).code == 0
        assert code(other.open([3])) == C.RESOURCE_EXHAUSTED
        fill_and_decode(other, 1, seed=7)
        greedy.close()
        wait_for(lambda: stats(server.address).sequences == 2, what="the greedy client's sequences freed")
        assert other.open([3]).code == 0
        other.close()


def test_many_layers_times_many_sequences_cannot_exhaust_memory_by_default():
    """4096 layers x 65536 sequences would be ~8.6 GB of block tables outside --kv-capacity."""
    huge = {**SHAPE, "num_layers": MAX_LAYERS, "num_kv_heads": 1, "head_dim": 1}
    with in_process(CountingStore) as server:
        greedy, other = Client(server.address, huge), Client(server.address, huge)
        r = greedy.open(range(1 << 16))
        assert code(r) == C.RESOURCE_EXHAUSTED and "--max-table-memory" in r.message, r.message
        assert other.open(range(100)).code == 0
        assert stats(server.address).sequences == 100
        greedy.close()
        other.close()


# ---- binding (item 5) -------------------------------------------------------------------
@pytest.mark.parametrize("listen,local", [
    ("127.0.0.1:1", True), ("127.8.9.10:1", True), ("localhost:50061", True), ("[::1]:1", True),
    ("unix:/tmp/rworker.sock", True), ("0.0.0.0:1", False), ("[::]:1", False), ("10.0.0.7:50061", False),
    ("rworker-0.rworker:50061", False), ("256.1.1.1:99999", False)])
def test_is_loopback(listen, local):
    assert is_loopback(listen) is local


def test_exposure_needs_a_token_mutual_tls_or_insecure():
    exposed = "0.0.0.0:0"
    with pytest.raises(ValueError, match="--insecure"):
        check_exposure(ServerOptions(listen=exposed))
    with pytest.raises(ValueError, match="--insecure"):                          # TLS without client certs
        check_exposure(ServerOptions(listen=exposed, tls_cert="c", tls_key="k"))
    for ok in (dict(token="t"), dict(tls_cert="c", tls_key="k", tls_client_ca="ca"), dict(insecure=True)):
        check_exposure(ServerOptions(listen=exposed, **ok))
    check_exposure(ServerOptions(listen="127.0.0.1:0"))


def _start(args: list[str], timeout: float = 60.0) -> tuple[int | None, str]:
    """(exit status, or None if it served; its stderr so far) of `python -m rworker args`."""
    proc = subprocess.Popen([sys.executable, "-m", "rworker", "--store", "numpy", "--threads", "1",
                             "--kv-capacity", "4M", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not any("READY" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    rc = proc.poll()
    if rc is None:
        proc.kill()
    proc.wait(timeout=10)
    reader.join(timeout=10)
    return rc, "".join(lines)


def test_non_loopback_bind_without_auth_refuses_to_start_unless_insecure():
    rc, err = _start(["--listen", "0.0.0.0:0"])
    assert rc is not None and rc != 0, err
    assert "READY" not in err and "Traceback" not in err
    assert "--insecure" in err and "--token" in err and "--tls-client-ca" in err, err
    rc, err = _start(["--listen", "0.0.0.0:0", "--insecure"])
    assert rc is None and "READY" in err and "--insecure" in err, err          # serves, with a warning
    rc, err = _start(["--listen", "0.0.0.0:0", "--token", "s3cret"])
    assert rc is None and "READY" in err, err


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


# ---- deployment files (item 5) ----------------------------------------------------------
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
needs_ansible = pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-core is not installed")


def _dry_run(tmp_path: Path, host_vars: str) -> subprocess.CompletedProcess:
    """`ansible-playbook --check --diff` of the rworker play against this machine (installs nothing)."""
    tag = f"fdlim{os.getpid()}"
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[rworkers]\nlocalnode ansible_connection=local ansible_python_interpreter={sys.executable} "
                   f"rworker_host=192.0.2.11 {host_vars}\n[rworkers:vars]\nrworker_prefix={tmp_path / 'opt'}\n"
                   f"rworker_unit=fastdecode-rworker-{tag}\nrworker_user={tag}\nrworker_wheelhouse={tmp_path}\n")
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": "/tmp/.ansible-fd-test"}
    return subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(REPO / "deploy/ansible/rworkers.yml"),
                           "--check", "--diff"], capture_output=True, text=True, env=env, timeout=300)


@needs_ansible
def test_ansible_refuses_a_host_address_without_token_or_mutual_tls(tmp_path):
    r = _dry_run(tmp_path, "")
    assert r.returncode != 0 and "192.0.2.11 is not a loopback address" in r.stdout, r.stdout[-2000:]
    r = _dry_run(tmp_path, "rworker_insecure=true")                 # explicit: the unit says --insecure
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    exec_start = re.search(r"^\+ExecStart=(.*)$", r.stdout, re.M).group(1).split()
    assert "--insecure" in exec_start and "--listen" in exec_start


def test_k8s_manifest_serves_mutual_tls_and_probes_a_plaintext_health_port():
    import yaml

    from rworker.__main__ import _options, parse_args

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "deploy/k8s/rworker.yaml").read_text()) if d}
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: "10.0.0.7" if m.group(1) == "POD_IP" else "1G", a) for a in c["args"]]
    args = parse_args(expanded)
    check_exposure(_options(parse_args([a for a in expanded if a not in ("--token-file", args.token_file)])))
    assert args.tls_cert and args.tls_key and args.tls_client_ca and args.token_file
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca, args.token_file):
        assert volumes[mounts[str(Path(path).parent)]]["secret"]["secretName"], path
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]   # can read the Secrets
    health_port = int(args.health_listen.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health_port != 50061, probe
    assert {p["containerPort"] for p in c["ports"]} == {50061, health_port}


def test_health_port_serves_probes_in_plaintext_while_the_service_port_needs_mutual_tls(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fastdecode.ops.testing import self_signed_cert

    ca = self_signed_cert(tmp_path, "ca")
    cert, key = self_signed_cert(tmp_path, "server", ca=ca)
    opts = dict(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca[0]), health_listen="127.0.0.1:0")
    with in_process(**opts) as server:
        def health() -> int:
            with grpc.insecure_channel(server.health_address) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status

        assert health() == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(server.health_address) as ch:                 # nothing else there
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert e.value.code() == C.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as e:                                 # plaintext on the TLS port
            stats(server.address)
        assert e.value.code() == C.UNAVAILABLE and "Socket closed" in e.value.details(), e.value.details()
        server.service.drain()
        assert health() == health_pb2.HealthCheckResponse.NOT_SERVING
