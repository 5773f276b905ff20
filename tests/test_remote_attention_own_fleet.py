"""RemoteAttention against R-worker fleets of its own (not test_remote_attention.py's shared one),
for what changes a fleet: a small KV pool, a worker that is unreachable then returns, token and
TLS, a draining worker, sequence limits that make an open fail all or nothing."""
from __future__ import annotations

import time

import pytest
import torch

from fastdecode.attention.base import AttentionError, KVCapacityError, KVSpec, SequencesLost
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.ops.testing import local_fleet, self_signed_cert

from test_remote_attention import remote, run_both, worker_stats, wait_for, prefill_all_layers


def test_over_capacity_raises_kv_capacity_error(tmp_path):
    spec = KVSpec(2, 4, 2, 16)
    with local_fleet(1, tmp_path, kv_capacity="1M") as small:
        backend = remote(spec, small.addresses)
        try:
            backend.open([1, 2])
            big = torch.zeros(10000, 2, 16)       # 1 MiB holds < 10000 tokens of one layer of this shape
            with pytest.raises(KVCapacityError):
                backend.prefill(0, [1], [10000], big, big)
            backend.prefill(0, [2], [10], big[:10], big[:10])
            backend.decode(0, [2], torch.zeros(1, 4, 16), big[:1], big[:1])
        finally:
            backend.shutdown()


def test_unreachable_worker_is_skipped_then_used_when_it_returns(tmp_path):
    """One address is dead at start: the backend runs on the other; when the worker comes
    up on that address, it is reconnected and new sequences go there (least load)."""
    from fastdecode.ops.procs import free_port

    spec = KVSpec(2, 4, 2, 16)
    port = free_port("127.0.0.1")
    with local_fleet(1, tmp_path / "a") as a:
        backend = remote(spec, (a.addresses[0], f"127.0.0.1:{port}"), rworker_timeout_s=2.0)
        try:
            backend.open([1, 2])
            st = backend.stats()["workers"]
            assert [w["up"] for w in st] == [True, False] and st[0]["sequences"] == 2
            with local_fleet(1, tmp_path / "b", base_port=port) as b:
                assert b.addresses[0] == f"127.0.0.1:{port}"
                deadline = time.monotonic() + 10
                while not backend.stats()["workers"][1]["up"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert backend.stats()["workers"][1]["up"]
                backend.open([3, 4])
                st = backend.stats()["workers"]
                assert st[1]["sequences"] == 2
                gen = torch.Generator().manual_seed(0)
                ref = TorchAttention(spec)
                worst = run_both(spec, backend, ref, [5, 6], [3, 3], steps=1, gen=gen)
                assert worst < 1e-5
        finally:
            backend.shutdown()


def test_token_and_tls(tmp_path):
    pytest.importorskip("cryptography", reason="needs the cryptography package to make a test certificate")
    spec = KVSpec(2, 4, 2, 16)
    ca, ca_key = self_signed_cert(tmp_path, "ca")
    server, server_key = self_signed_cert(tmp_path, "server", ca=(ca, ca_key))
    client, client_key = self_signed_cert(tmp_path, "client", ca=(ca, ca_key))
    args = ("--token", "tok", "--tls-cert", str(server), "--tls-key", str(server_key), "--tls-client-ca", str(ca))
    with local_fleet(1, tmp_path / "w", extra_args=args) as f:
        good = dict(rworker_token="tok", rworker_tls_ca=str(ca), rworker_tls_cert=str(client),
                    rworker_tls_key=str(client_key), rworker_timeout_s=3.0)
        backend = remote(spec, f.addresses, **good)
        try:
            gen = torch.Generator().manual_seed(0)
            assert run_both(spec, backend, TorchAttention(spec), [1], [4], steps=1, gen=gen) < 1e-5
        finally:
            backend.shutdown()
        bad = [(dict(good, rworker_token="nope"), "UNAUTHENTICATED: wrong R-worker token"),
               (dict(good, rworker_token=""), "UNAUTHENTICATED: missing R-worker token"),
               (dict(good, rworker_tls_cert="", rworker_tls_key=""),     # no client cert (mTLS)
                "if it wants mutual TLS, set rworker_tls_cert and rworker_tls_key"),
               (dict(rworker_token="tok", rworker_timeout_s=3.0),        # plaintext to a TLS port
                "if the R-worker serves TLS, set rworker_tls_ca")]
        for kw, reason in bad:
            with pytest.raises(AttentionError, match="no R-worker group reachable") as e:
                remote(spec, f.addresses, **kw)
            assert reason in str(e.value), str(e.value)


def test_draining_worker_keeps_its_sequences_but_gets_no_new_ones(tmp_path):
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    spec = KVSpec(2, 4, 2, 16)
    with local_fleet(2, tmp_path) as f:
        backend = remote(spec, f.addresses)
        try:
            gen = torch.Generator().manual_seed(0)
            ref = TorchAttention(spec)
            assert run_both(spec, backend, ref, [1, 2, 3, 4], [2, 3, 4, 5], steps=1, gen=gen) < 1e-5
            held = backend.stats()["workers"][0]["sequences"]
            assert held > 0
            with grpc.insecure_channel(f.addresses[0]) as ch:
                assert pb_grpc.RWorkerStub(ch).Drain(pb.DrainRequest(), timeout=5).sequences == held
            backend.open([10, 11, 12, 13])          # refused by the draining worker: all land on worker 1
            st = backend.stats()["workers"]
            assert st[0]["sequences"] == held and st[0]["up"] and st[0]["draining"]
            assert st[1]["sequences"] == 8 - held
            assert run_both(spec, backend, ref, [20, 21], [3, 3], steps=2, gen=gen) < 1e-5
            assert backend.stats()["workers"][0]["sequences"] == held    # old ones still served there
        finally:
            backend.shutdown()


def test_open_is_all_or_nothing_and_uses_groups_with_room(tmp_path):
    """A worker at its --max-sequences refuses (RESOURCE_EXHAUSTED): its share of an open goes
    to a worker with room; when none has room the open raises KVCapacityError and leaves
    nothing open, on the workers or in the client, so the same ids can be opened later."""
    spec = KVSpec(2, 4, 2, 16)
    with local_fleet(1, tmp_path / "a", kv_capacity="8M", extra_args=("--max-sequences", "2")) as a, \
            local_fleet(1, tmp_path / "b", kv_capacity="8M", extra_args=("--max-sequences", "6")) as b:
        addresses = (a.addresses[0], b.addresses[0])
        backend = remote(spec, addresses)

        def on_workers():
            return [worker_stats(x).sequences for x in addresses]

        try:
            backend.open([1, 2])                                  # one each
            assert [backend.placement[s].index for s in (1, 2)] == [0, 1]
            backend.open([3, 4, 5, 6])    # a refuses 3, 5 (one slot left): offered one, 5 goes to b
            assert [backend.placement[s].index for s in (3, 4, 5, 6)] == [0, 1, 1, 1]
            assert on_workers() == [2, 4]
            backend.open([7])                                     # placed on a (full): goes to b
            assert backend.placement[7].index == 1 and on_workers() == [2, 5]

            # a: 2 x 8 tokens, b: 5 x 3 tokens: of [8, 9], b (one slot left) gets 8, a (full) 9;
            # 9 retried on b is refused too: 8 must not stay open on b.
            prefill_all_layers(backend, spec, [1, 3], [8, 8])
            prefill_all_layers(backend, spec, [2, 4, 5, 6, 7], [3] * 5)
            assert {g.index: ids for g, ids in backend._place([8, 9], backend.groups).items()} == {1: [8], 0: [9]}
            st = backend.stats()
            for _ in range(2):                                    # a retry gets the same answer
                with pytest.raises(KVCapacityError, match="at most 6 [(]--max-sequences[)]"):
                    backend.open([8, 9])
                assert wait_for(lambda: on_workers() == [2, 5]), on_workers()
                assert backend.stats()["sequences"] == st["sequences"] == 7
                assert [w["sequences"] for w in backend.stats()["workers"]] == [2, 5]
                assert 8 not in backend.placement and 9 not in backend.placement
            with pytest.raises(KVCapacityError):
                backend.open([10, 11, 12])
            assert wait_for(lambda: on_workers() == [2, 5]), on_workers()

            backend.close([1])            # a slot on each: a (lighter) refuses [8, 9], then takes one
            backend.open([8, 9])
            assert wait_for(lambda: on_workers() == [2, 6]), on_workers()
            assert backend.stats()["sequences"] == 8
            gen = torch.Generator().manual_seed(5)
            backend.close([8, 9])          # the reopened ids work
            assert run_both(spec, backend, TorchAttention(spec), [8, 9], [2, 3], steps=1, gen=gen) < 1e-5
        finally:
            backend.shutdown()


def test_failed_open_leaves_lost_sequences_lost(tmp_path):
    """A lost sequence whose re-open fails stays lost (SequencesLost), not unknown (KeyError)."""
    spec = KVSpec(2, 4, 2, 16)
    with local_fleet(1, tmp_path, kv_capacity="8M", extra_args=("--max-sequences", "1")) as f:
        backend = remote(spec, f.addresses)
        try:
            backend.open([1])
            with backend.lock:                                   # as _worker_down leaves it
                backend.placement[2], backend.lost_reason[2] = None, "R-worker gone"
            with pytest.raises(KVCapacityError):
                backend.open([2])
            with pytest.raises(SequencesLost, match="R-worker gone"):
                backend.prefill(0, [2], [1], torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
        finally:
            backend.shutdown()
