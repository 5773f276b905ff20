"""The R-worker server on the wire: real `python -m rworker` processes, raw stream clients.

Bad input gets the right status code, per call on the stream (which stays open) or as
the stream's status; the server keeps serving other clients with their caches intact;
a client's sequences are freed when its stream ends; SIGTERM drains then exits 0.
"""
from __future__ import annotations

import queue
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpart.auth import bearer
from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from fastdecode.ops.testing import Spawned, local_fleet

C = grpc.StatusCode
LAYERS, HKV, H, D = 2, 2, 4, 16


def tensor(a: np.ndarray) -> pb.Tensor:
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=a.dtype.name)


def reference(q, ks, vs):
    """o [H, D] of one sequence over its cached ks, vs [T, Hkv, D] (fp16-rounded)."""
    kk = np.repeat(ks.astype(np.float32), H // HKV, axis=1)
    vv = np.repeat(vs.astype(np.float32), H // HKV, axis=1)
    s = np.einsum("hd,thd->ht", q, kk) / np.sqrt(D)
    p = np.exp(s - s.max(1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(1, keepdims=True), vv)


class RawClient:
    """One Session stream; call() sends one request and waits for its reply."""

    def __init__(self, address: str, token: str = "", configure: bool = True, max_send: int = -1) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_send)])
        self.stub = pb_grpc.RWorkerStub(self.channel)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = self.stub.Session(iter(self.requests.get, None), metadata=bearer(token))
        self.next_id = 0
        if configure:
            assert self.call(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                                                    kv_format="fp16")).code == 0

    def call(self, **op) -> pb.Reply:
        self.next_id += 1
        self.requests.put(pb.Request(call_id=self.next_id, **op))
        reply = next(self.replies)
        assert reply.call_id == self.next_id
        return reply

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def code(reply: pb.Reply) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code)


def stats(address: str, token: str = "") -> pb.StatsReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5, metadata=bearer(token))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    # Small pool and message limit so "over capacity" and "oversized" are cheap to reach.
    with local_fleet(1, tmp_path_factory.mktemp("rw"), kv_capacity="2M",
                     extra_args=("--max-message-size", "4M", "--max-sequences", "64")) as fleet:
        yield fleet.addresses[0]


class Seq:
    """A client-side copy of one sequence's KV (fp16), to check the server's answers."""

    def __init__(self, rng, prompt: int) -> None:
        self.k = [rng.standard_normal((prompt, HKV, D)).astype(np.float16) for _ in range(LAYERS)]
        self.v = [rng.standard_normal((prompt, HKV, D)).astype(np.float16) for _ in range(LAYERS)]


def prefill(client: RawClient, ids, seqs) -> None:
    for layer in range(LAYERS):
        k = np.concatenate([s.k[layer] for s in seqs])
        v = np.concatenate([s.v[layer] for s in seqs])
        r = client.call(prefill=pb.Prefill(layer=layer, seq_ids=ids, lens=[len(s.k[layer]) for s in seqs],
                                           k=tensor(k), v=tensor(v)))
        assert r.code == 0, r.message


def decode_and_check(client: RawClient, ids, seqs, rng, layer: int = 0) -> None:
    q = rng.standard_normal((len(ids), H, D)).astype(np.float32)
    k = rng.standard_normal((len(ids), HKV, D)).astype(np.float16)
    v = rng.standard_normal((len(ids), HKV, D)).astype(np.float16)
    r = client.call(decode=pb.Decode(layer=layer, seq_ids=ids, q=tensor(q), k=tensor(k), v=tensor(v)))
    assert r.code == 0, r.message
    o = np.frombuffer(r.o.data, np.float32).reshape(tuple(r.o.shape))
    for i, s in enumerate(seqs):
        s.k[layer] = np.concatenate([s.k[layer], k[i:i + 1]])
        s.v[layer] = np.concatenate([s.v[layer], v[i:i + 1]])
        np.testing.assert_allclose(o[i], reference(q[i], s.k[layer], s.v[layer]), rtol=1e-4, atol=1e-5)
    assert r.kernel_s > 0


def test_bad_input_gets_status_and_others_keep_their_cache(worker):
    rng = np.random.default_rng(0)
    bystander = RawClient(worker)
    bystander_seqs = [Seq(rng, 5), Seq(rng, 3)]
    assert bystander.call(open=pb.Open(seq_ids=[1, 2])).code == 0
    prefill(bystander, [1, 2], bystander_seqs)
    decode_and_check(bystander, [1, 2], bystander_seqs, rng)

    bad = RawClient(worker, configure=False)
    assert code(bad.call(open=pb.Open(seq_ids=[1]))) == C.FAILED_PRECONDITION        # not configured
    assert code(bad.call(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                                                kv_format="fp8"))) == C.INVALID_ARGUMENT
    assert code(bad.call(configure=pb.Configure(num_layers=0, num_kv_heads=HKV, head_dim=D,
                                                kv_format="fp16"))) == C.INVALID_ARGUMENT
    assert code(bad.call(configure=pb.Configure(num_layers=LAYERS + 1, num_kv_heads=HKV, head_dim=D,
                                                kv_format="fp16"))) == C.FAILED_PRECONDITION  # worker busy
    assert bad.call(configure=pb.Configure(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D,
                                           kv_format="fp16")).code == 0
    assert code(bad.call()) == C.INVALID_ARGUMENT                                      # no operation
    # The same ids as the bystander's: namespaced per connection, no collision.
    assert bad.call(open=pb.Open(seq_ids=[1, 2])).code == 0
    assert code(bad.call(open=pb.Open(seq_ids=[2]))) == C.ALREADY_EXISTS
    assert code(bad.call(open=pb.Open(seq_ids=[-1]))) == C.INVALID_ARGUMENT
    assert code(bad.call(open=pb.Open(seq_ids=[1 << 41]))) == C.INVALID_ARGUMENT
    kept = stats(worker)
    r = bad.call(open=pb.Open(seq_ids=range(100, 200)))
    assert code(r) == C.RESOURCE_EXHAUSTED and "--max-sequences" in r.message, r.message
    assert stats(worker).sequences == kept.sequences                                   # none of them opened
    assert code(bad.call(close=pb.Close(seq_ids=range(70000)))) == C.INVALID_ARGUMENT     # ids per call

    q = rng.standard_normal((1, H, D)).astype(np.float32)
    kv = rng.standard_normal((1, HKV, D)).astype(np.float16)

    def dec(ids=(1,), q=tensor(q), k=tensor(kv), v=tensor(kv), layer=0):
        return bad.call(decode=pb.Decode(layer=layer, seq_ids=list(ids), q=q, k=k, v=v))

    short = pb.Tensor(data=kv.tobytes()[:-2], shape=kv.shape, dtype="float16")
    assert code(dec(k=short)) == C.INVALID_ARGUMENT                                    # wrong byte length
    r = dec(q=pb.Tensor(data=q.tobytes(), shape=q.shape, dtype="complex64"))
    assert code(r) == C.INVALID_ARGUMENT and "dtype" in r.message                     # unknown dtype
    assert code(dec(k=tensor(np.zeros((1, HKV + 1, D), np.float16)))) == C.INVALID_ARGUMENT  # shape
    assert code(dec(q=tensor(np.zeros((1, 3, D), np.float32)))) == C.INVALID_ARGUMENT  # H not multiple
    assert code(dec(ids=(1, 2))) == C.INVALID_ARGUMENT                                # rows != ids
    assert code(dec(layer=LAYERS)) == C.INVALID_ARGUMENT                               # layer range
    assert code(dec(k=tensor(np.full((1, HKV, D), np.nan, np.float16)))) == C.INVALID_ARGUMENT
    r = dec(ids=(7,))
    assert code(r) == C.NOT_FOUND and "7" in r.message                                 # unknown sequence
    assert code(bad.call(prefill=pb.Prefill(layer=0, seq_ids=[1], lens=[3], k=tensor(kv), v=tensor(kv)))) \
        == C.INVALID_ARGUMENT                                                          # lens vs rows
    # Lengths whose int64 sum wraps to the rows sent (2**64 + 1 -> 1): refused, not a segfault.
    assert bad.call(open=pb.Open(seq_ids=[3, 4])).code == 0
    r = bad.call(prefill=pb.Prefill(layer=0, seq_ids=[1, 2, 3, 4], lens=[1 << 62] * 3 + [(1 << 62) + 1],
                                    k=tensor(kv), v=tensor(kv)))
    assert code(r) == C.INVALID_ARGUMENT and "length" in r.message, r.message
    assert bad.call(close=pb.Close(seq_ids=[3, 4])).code == 0
    # Over capacity: 2 MiB hold ~8k tokens of this shape; nothing of the failed call is kept.
    big = np.zeros((20000, HKV, D), np.float16)
    kept = stats(worker)
    r = bad.call(prefill=pb.Prefill(layer=0, seq_ids=[2], lens=[20000], k=tensor(big), v=tensor(big)))
    assert code(r) == C.RESOURCE_EXHAUSTED, r.message
    after = stats(worker)
    assert (after.sequences, after.kv_tokens, after.bytes_used) == (kept.sequences, kept.kv_tokens, kept.bytes_used)
    assert kept.kv_tokens > 0 and kept.bytes_used > 0                                  # the others' KV is counted
    assert dec().code == 0                                                             # stream still works

    # The bystander's cache is intact and it keeps decoding correctly.
    decode_and_check(bystander, [1, 2], bystander_seqs, rng, layer=1)
    before = stats(worker).sequences
    bad.close()   # its stream ends: its 2 sequences are freed, the bystander's stay
    deadline = time.monotonic() + 5
    while stats(worker).sequences != before - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(worker).sequences == before - 2
    decode_and_check(bystander, [1, 2], bystander_seqs, rng)
    assert bystander.call(close=pb.Close(seq_ids=[1, 2, 99])).code == 0                # unknown ids ignored
    bystander.close()


def test_oversized_message_ends_only_that_stream(worker):
    rng = np.random.default_rng(1)
    bystander = RawClient(worker)
    seqs = [Seq(rng, 4)]
    assert bystander.call(open=pb.Open(seq_ids=[3])).code == 0
    prefill(bystander, [3], seqs)

    bad = RawClient(worker)
    assert bad.call(open=pb.Open(seq_ids=[3])).code == 0
    big = np.zeros((70000, HKV, D), np.float16)                                       # 4.5 MB > 4 MiB limit
    with pytest.raises(grpc.RpcError) as e:
        bad.call(prefill=pb.Prefill(layer=0, seq_ids=[3], lens=[70000], k=tensor(big), v=tensor(big)))
    assert e.value.code() == C.RESOURCE_EXHAUSTED
    decode_and_check(bystander, [3], seqs, rng)
    deadline = time.monotonic() + 5
    while stats(worker).connections != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(worker).sequences == 1                                                # bad's seq freed
    bystander.close()


def test_token_is_checked_on_every_call(tmp_path):
    with local_fleet(1, tmp_path, extra_args=("--token", "s3cret")) as fleet:
        address = fleet.addresses[0]
        for token, reason in (("", "missing R-worker token"), ("wrong", "wrong R-worker token")):
            with pytest.raises(grpc.RpcError) as e:
                stats(address, token)
            assert (e.value.code(), e.value.details()) == (C.UNAUTHENTICATED, reason)
            client = RawClient(address, token=token, configure=False)
            with pytest.raises(grpc.RpcError) as e:
                client.call(open=pb.Open(seq_ids=[1]))
            assert (e.value.code(), e.value.details()) == (C.UNAUTHENTICATED, reason)
            client.close()
        assert stats(address, "s3cret").sequences == 0
        client = RawClient(address, token="s3cret")
        assert client.call(open=pb.Open(seq_ids=[1])).code == 0
        client.close()
        with grpc.insecure_channel(address) as ch:   # health stays open to probes without the secret
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_token_file_and_bad_cli_arguments(tmp_path):
    import subprocess
    import sys

    (tmp_path / "empty").write_text("\n")
    empty, missing = str(tmp_path / "empty"), str(tmp_path / "missing.crt")
    for args, reason in ((["--token-file", empty], f"token file {empty} is empty"),
                         (["--kv-capacity", "lots"], "argument --kv-capacity: invalid"),
                         (["--threads", "-1"], "--threads >= 0"),
                         (["--max-sequences", "0"], "--max-sequences >= 1"),
                         (["--listen", "256.1.1.1:99999"], "refusing to listen on 256.1.1.1:99999 without auth"),
                         (["--insecure", "--listen", "256.1.1.1:99999"], "cannot listen on 256.1.1.1:99999"),
                         (["--tls-client-ca", empty], "--tls-client-ca needs --tls-cert and --tls-key"),
                         (["--tls-cert", missing], "TLS needs both --tls-cert and --tls-key"),
                         (["--tls-cert", missing, "--tls-key", missing], f"No such file or directory: '{missing}'")):
        p = subprocess.run([sys.executable, "-m", "rworker", "--listen", "127.0.0.1:0", "--store", "numpy", *args],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, args
        assert "READY" not in p.stderr
        assert reason in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-2000:])
    (tmp_path / "tok").write_text("filetoken\n")
    with Spawned(["--token-file", str(tmp_path / "tok")], tmp_path / "w.log") as w:
        assert stats(w.address, "filetoken").sequences == 0
        with pytest.raises(grpc.RpcError) as e:
            stats(w.address, "not-the-file-token")
        assert (e.value.code(), e.value.details()) == (C.UNAUTHENTICATED, "wrong R-worker token")


def test_sigterm_drains_then_exits_zero(tmp_path):
    w = Spawned([], tmp_path / "w.log")
    try:
        client = RawClient(w.address)
        rng = np.random.default_rng(2)
        seqs = [Seq(rng, 2)]
        assert client.call(open=pb.Open(seq_ids=[1])).code == 0
        prefill(client, [1], seqs)
        w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not stats(w.address).draining and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.call(open=pb.Open(seq_ids=[2]))
        assert code(r) == C.UNAVAILABLE and "draining" in r.message                   # no new sequences
        with grpc.insecure_channel(w.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        decode_and_check(client, [1], seqs, rng)                                       # open ones served
        assert w.proc.poll() is None
        assert client.call(close=pb.Close(seq_ids=[1])).code == 0
        assert w.proc.wait(timeout=15) == 0
        client.close()
    finally:
        w.stop()


def test_garbage_bytes_and_random_requests(worker):
    """Undecodable bytes end only that stream; random well-formed requests always get an
    answer with a client-error code (never INTERNAL), and the worker keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rng = np.random.default_rng(3)
    bystander = RawClient(worker)
    seqs = [Seq(rng, 3)]
    assert bystander.call(open=pb.Open(seq_ids=[5])).code == 0
    prefill(bystander, [5], seqs)

    with grpc.insecure_channel(worker) as ch:
        raw = ch.stream_stream("/fastdecode.rworker.RWorker/Session")
        with pytest.raises(grpc.RpcError) as e:
            list(raw(iter([b"\xff\x01garbage" * 10]), timeout=10))
        assert e.value.code() in (C.INTERNAL, C.INVALID_ARGUMENT, C.UNKNOWN)

    fuzz = RawClient(worker)
    assert fuzz.call(open=pb.Open(seq_ids=[1, 2])).code == 0
    client_errors = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED, C.FAILED_PRECONDITION,
                     C.ALREADY_EXISTS, C.OK}
    tensors = st.builds(pb.Tensor, data=st.binary(max_size=2048),
                        shape=st.lists(st.integers(-3, 70), max_size=4),
                        dtype=st.sampled_from(["float16", "float32", "int8", "", "bfloat16", "float64"]))
    ids = st.lists(st.integers(-2, 4), max_size=4)
    requests = st.one_of(
        st.builds(lambda l, i, q, k, v: dict(decode=pb.Decode(layer=l, seq_ids=i, q=q, k=k, v=v)),
                  st.integers(-1, 3), ids, tensors, tensors, tensors),
        st.builds(lambda l, i, n, k, v: dict(prefill=pb.Prefill(layer=l, seq_ids=i, lens=n, k=k, v=v)),
                  st.integers(-1, 3), ids, st.lists(st.integers(-1, 40), max_size=4), tensors, tensors),
        st.builds(lambda i: dict(open=pb.Open(seq_ids=i)), ids),
        st.builds(lambda i: dict(close=pb.Close(seq_ids=i)), ids),
        st.builds(lambda a, b, c, f: dict(configure=pb.Configure(num_layers=a, num_kv_heads=b, head_dim=c,
                                                                 kv_format=f)),
                  st.integers(-1, 3), st.integers(-1, 3), st.integers(-1, 17), st.sampled_from(["fp16", "x"])))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests)
    def check(op):
        r = fuzz.call(**op)
        assert code(r) in client_errors, (op, r.message)

    check()
    fuzz.close()
    decode_and_check(bystander, [5], seqs, rng)
    bystander.close()


@pytest.mark.parametrize("tail", [True, False])
def test_int4_store_gets_the_fp16_tail_setting_and_fp16_does_not(tail):
    from rworker.__main__ import parse_args
    from rworker.connection import Connection
    from rworker.service import RWorkerService

    made = []

    def factory(**kwargs):
        made.append(kwargs)
        return type("Store", (), {"stats": lambda self: {"sequences": 0}, "close": lambda self: None})()

    assert parse_args([] if tail else ["--no-int4-fp16-tail"]).int4_fp16_tail is tail
    service = RWorkerService(1 << 20, store_factory=factory, int4_fp16_tail=tail)
    service._configure(Connection("test"), pb.Configure(num_layers=2, num_kv_heads=2, head_dim=64, kv_format="int4"))
    service._configure(Connection("test"), pb.Configure(num_layers=2, num_kv_heads=2, head_dim=64, kv_format="fp16"))
    assert made[0]["kv_format"] == "int4" and made[0]["fp16_tail"] is tail
    assert made[1]["kv_format"] == "fp16" and "fp16_tail" not in made[1]


def test_int4_groups_reach_the_int4_store_and_bad_ones_are_refused():
    from rworker.__main__ import parse_args
    from rworker.connection import Connection
    from rworker.service import RWorkerService

    args = parse_args(["--int4-k-group", "32", "--int4-v-group", "128"])
    assert (args.int4_k_group, args.int4_v_group) == (32, 128)
    assert (parse_args([]).int4_k_group, parse_args([]).int4_v_group) == (0, 0)
    for bad in (["--int4-v-group", "48"], ["--int4-k-group", "x"], ["--int4-k-group", "-16"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    service = RWorkerService(8 << 20, int4_k_group=32, int4_v_group=128)
    conn = Connection("test")
    service._configure(conn, pb.Configure(num_layers=1, num_kv_heads=2, head_dim=128, kv_format="int4"))
    assert service.store.groups == (32, 128)
    # a group that does not divide this model's head_dim: a clear error, and no stale store kept
    with pytest.raises(ValueError, match="dividing head_dim 64"):
        service._configure(Connection("other"), pb.Configure(num_layers=1, num_kv_heads=2, head_dim=64,
                                                             kv_format="int4"))
    assert service.store is None and service.store_config is None
    service._configure(conn, pb.Configure(num_layers=1, num_kv_heads=2, head_dim=64, kv_format="fp16"))
    assert service.store.groups == (0, 0)  # fp16 stores take no groups
