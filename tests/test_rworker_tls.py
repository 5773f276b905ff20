"""R-worker TLS: server-only TLS and mutual TLS serve the clients they should and refuse the
others, each refusal with its reason (status code and a message naming the cause); the remote
backend, built from EngineConfig as the engine builds it, generates over TLS with the right CA
and fails naming the cause with a wrong one."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from test_remote_engine import generate
from test_rworker_limits import in_process

from fastdecode.attention import AttentionError, KVSpec, create_backend
from fastdecode.config import EngineConfig
from fastdecode.engine import Engine
from rpart.auth import bearer, channel_credentials
from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from fastdecode.ops.testing import local_fleet, self_signed_cert

C = grpc.StatusCode
SHAPE = pb.Configure(num_layers=2, num_kv_heads=2, head_dim=16, kv_format="fp16")
# What grpc reports (1.85, BoringSSL). A client that does not trust the server's certificate fails
# its own handshake and says why. A server that refuses its client (plaintext to a TLS port, no
# client certificate or one its --tls-client-ca did not sign) closes the connection: under TLS 1.3
# the client's handshake is over before the server checks its certificate, so all the client reads
# is the closed socket; the remote backend adds the likely cause from its settings.
UNTRUSTED_SERVER = "Tls handshake failed"
SERVER_CLOSED = "Socket closed"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SimpleNamespace:
    pytest.importorskip("cryptography", reason="needs the cryptography package to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    ca, other_ca = self_signed_cert(d, "ca"), self_signed_cert(d, "other-ca")
    return SimpleNamespace(ca=ca, other_ca=other_ca, server=self_signed_cert(d, "server", ca=ca),
                           client=self_signed_cert(d, "client", ca=ca),
                           stranger=self_signed_cert(d, "stranger", ca=other_ca))


def credentials(ca, client=None) -> grpc.ChannelCredentials:
    """A client trusting `ca` (cert, key), presenting `client` (cert, key) when given."""
    return channel_credentials(str(ca[0]), *(map(str, client) if client else ()))


def stats(address: str, creds: grpc.ChannelCredentials | None, token: str = "") -> pb.StatsReply:
    channel = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
    with channel:
        return pb_grpc.RWorkerStub(channel).Stats(pb.StatsRequest(), timeout=10, metadata=bearer(token))


def refusal(address: str, creds: grpc.ChannelCredentials | None, token: str = "") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stats(address, creds, token)
    return e.value


def session(address: str, creds: grpc.ChannelCredentials) -> list[pb.Reply]:
    """One Session stream: Configure, Open, Close; the replies."""
    requests = [pb.Request(call_id=1, configure=SHAPE), pb.Request(call_id=2, open=pb.Open(seq_ids=[1, 2])),
                pb.Request(call_id=3, close=pb.Close(seq_ids=[1, 2]))]
    with grpc.secure_channel(address, creds) as channel:
        return list(pb_grpc.RWorkerStub(channel).Session(iter(requests), timeout=10))


@pytest.fixture(scope="module")
def tls_server(certs):
    """An R-worker with a certificate and no client check (server-only TLS)."""
    with in_process(tls_cert=str(certs.server[0]), tls_key=str(certs.server[1])) as server:
        yield server.address


@pytest.fixture(scope="module")
def mtls_server(certs):
    """An R-worker that also wants a client certificate signed by certs.ca (mutual TLS)."""
    with in_process(tls_cert=str(certs.server[0]), tls_key=str(certs.server[1]),
                    tls_client_ca=str(certs.ca[0])) as server:
        yield server.address


def assert_served(address: str, creds: grpc.ChannelCredentials) -> None:
    assert stats(address, creds).capacity_bytes == 4 << 20
    assert [(r.call_id, r.code, r.message) for r in session(address, creds)] == [(1, 0, ""), (2, 0, ""), (3, 0, "")]


def test_server_tls_serves_a_client_that_trusts_its_ca(tls_server, certs):
    assert_served(tls_server, credentials(certs.ca))
    assert_served(tls_server, credentials(certs.ca, certs.client))   # a client cert nobody asked for: ignored


def test_server_tls_refuses_a_client_that_trusts_another_ca(tls_server, certs):
    e = refusal(tls_server, credentials(certs.other_ca))
    assert e.code() == C.UNAVAILABLE, e
    assert UNTRUSTED_SERVER in e.details() and "certificate" in e.details(), e.details()
    with pytest.raises(grpc.RpcError) as stream:
        session(tls_server, credentials(certs.other_ca))
    assert stream.value.code() == C.UNAVAILABLE and UNTRUSTED_SERVER in stream.value.details()
    assert_served(tls_server, credentials(certs.ca))                  # and it serves the next client


def test_tls_servers_refuse_a_plaintext_client(tls_server, mtls_server, certs):
    for address in (tls_server, mtls_server):
        e = refusal(address, None)
        assert e.code() == C.UNAVAILABLE and SERVER_CLOSED in e.details(), e.details()
    assert_served(tls_server, credentials(certs.ca))


def test_a_tls_client_is_refused_by_a_plaintext_server(certs):
    with in_process() as server:
        e = refusal(server.address, credentials(certs.ca))
        assert e.code() == C.UNAVAILABLE, e
        assert UNTRUSTED_SERVER in e.details() and "WRONG_VERSION_NUMBER" in e.details(), e.details()
        assert stats(server.address, None).capacity_bytes == 4 << 20


def test_mutual_tls_wants_a_client_cert_signed_by_its_client_ca(mtls_server, certs):
    assert_served(mtls_server, credentials(certs.ca, certs.client))
    for client in (None, certs.stranger):          # no client cert; one signed by another CA
        e = refusal(mtls_server, credentials(certs.ca, client))
        assert e.code() == C.UNAVAILABLE and SERVER_CLOSED in e.details(), (client, e.details())
        with pytest.raises(grpc.RpcError) as stream:
            session(mtls_server, credentials(certs.ca, client))
        assert stream.value.code() == C.UNAVAILABLE and SERVER_CLOSED in stream.value.details()
    e = refusal(mtls_server, credentials(certs.other_ca, certs.client))   # its own check of the server
    assert e.code() == C.UNAVAILABLE and UNTRUSTED_SERVER in e.details(), e.details()
    assert_served(mtls_server, credentials(certs.ca, certs.client))


def test_token_over_tls_refusals_name_the_token(certs):
    with in_process(token="tok", tls_cert=str(certs.server[0]), tls_key=str(certs.server[1])) as server:
        assert stats(server.address, credentials(certs.ca), token="tok").sequences == 0
        for token, reason in (("", "missing R-worker token"), ("nope", "wrong R-worker token")):
            e = refusal(server.address, credentials(certs.ca), token)
            assert (e.code(), e.details()) == (C.UNAUTHENTICATED, reason)


def test_engine_generates_over_tls_and_names_the_cause_of_a_refusal(tiny_model_dir, certs, tmp_path):
    """The remote backend as the engine builds it, from settings given as strings (the CLI's,
    the Triton model's, FASTDECODE_* variables): TLS with the server's CA generates what the local
    backend does; a wrong CA, a wrong token and plaintext each fail naming the cause."""
    expected = generate(EngineConfig(model=tiny_model_dir, attention="local", kernel_threads=1))
    args = ("--token", "tok", "--tls-cert", str(certs.server[0]), "--tls-key", str(certs.server[1]))
    with local_fleet(1, tmp_path, extra_args=args) as fleet:
        address = fleet.addresses[0]
        settings = {"model": tiny_model_dir, "attention": "remote", "rworkers": address,
                    "rworker_token": "tok", "rworker_tls_ca": str(certs.ca[0]), "rworker_timeout_s": "10"}
        assert generate(EngineConfig.from_dict(settings)) == expected
        for change, reasons in (({"rworker_tls_ca": str(certs.other_ca[0])}, (UNTRUSTED_SERVER, "certificate")),
                                ({"rworker_token": "nope"}, ("UNAUTHENTICATED: wrong R-worker token",)),
                                ({"rworker_tls_ca": ""}, (f"{SERVER_CLOSED} (closed before any reply: "
                                                          "if the R-worker serves TLS, set rworker_tls_ca)",))):
            with pytest.raises(AttentionError) as e:
                Engine(EngineConfig.from_dict({**settings, **change}))
            assert f"no R-worker group reachable ({address}: " in str(e.value), str(e.value)
            assert all(r in str(e.value) for r in reasons), (change, str(e.value))
        assert generate(EngineConfig.from_dict(settings)) == expected     # the refusals cost the worker nothing


def test_remote_backend_names_what_a_mutual_tls_worker_wants(mtls_server, certs):
    """A refusal the client can read only as a closed socket gets the likely cause from the settings."""
    def connect(**tls):
        config = EngineConfig(attention="remote", rworkers=(mtls_server,), rworker_timeout_s=10.0, **tls)
        return create_backend(config, KVSpec(2, 4, 2, 16))

    good = dict(rworker_tls_ca=str(certs.ca[0]), rworker_tls_cert=str(certs.client[0]),
                rworker_tls_key=str(certs.client[1]))
    connect(**good).shutdown()
    for tls, hint in ((dict(good, rworker_tls_cert="", rworker_tls_key=""),
                       "if it wants mutual TLS, set rworker_tls_cert and rworker_tls_key"),
                      (dict(good, rworker_tls_cert=str(certs.stranger[0]), rworker_tls_key=str(certs.stranger[1])),
                       "if it wants mutual TLS, its --tls-client-ca must have signed rworker_tls_cert"),
                      ({}, "if the R-worker serves TLS, set rworker_tls_ca")):
        with pytest.raises(AttentionError) as e:
            connect(**tls)
        message = str(e.value)
        assert f"{mtls_server}: UNAVAILABLE: " in message, message
        assert f"{SERVER_CLOSED} (closed before any reply: {hint})" in message, message
