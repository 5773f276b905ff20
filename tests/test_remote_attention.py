"""RemoteAttention against real R-worker processes, compared with the plain-torch reference."""
from __future__ import annotations

import time

import pytest
import torch

from fastdecode.attention.base import AttentionError, KVSpec, SequencesLost
from fastdecode.attention.remote.backend import RemoteAttention
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.config import EngineConfig
from fastdecode.ops.testing import local_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with local_fleet(3, tmp_path_factory.mktemp("fleet"), kv_capacity="8M") as f:
        yield f


def remote(spec: KVSpec, addresses, **kw) -> RemoteAttention:
    return RemoteAttention(spec, EngineConfig(attention="remote", rworkers=tuple(addresses), **kw))


def fp16(x: torch.Tensor) -> torch.Tensor:
    """The KV store keeps fp16: give the reference the same values."""
    return x.half().float()


def run_both(spec, backend, ref, seq_ids, prompt_lens, steps, gen, dtype=torch.float32):
    backend.open(seq_ids)
    ref.open(seq_ids)
    for layer in range(spec.num_layers):
        n = sum(prompt_lens)
        k = fp16(torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen))
        v = fp16(torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen))
        backend.prefill(layer, seq_ids, prompt_lens, k.to(dtype), v.to(dtype))
        ref.prefill(layer, seq_ids, prompt_lens, k.to(dtype).float(), v.to(dtype).float())
    worst = 0.0
    b = len(seq_ids)
    for _ in range(steps):
        futures = []
        for layer in range(spec.num_layers):
            q = torch.randn(b, spec.num_heads, spec.head_dim, generator=gen).to(dtype)
            k = fp16(torch.randn(b, spec.num_kv_heads, spec.head_dim, generator=gen))
            v = fp16(torch.randn(b, spec.num_kv_heads, spec.head_dim, generator=gen))
            futures.append((backend.submit_decode(layer, seq_ids, q, k.to(dtype), v.to(dtype)),
                            ref.decode(layer, seq_ids, q.float(), k.to(dtype).float(), v.to(dtype).float())))
        for fut, want in futures:
            got = fut.result(timeout=30)
            assert got.dtype == torch.float32 and got.shape == want.shape
            worst = max(worst, (got - want).abs().max().item())
    return worst


@pytest.mark.parametrize("workers,shards,spec", [
    (1, 1, KVSpec(2, 4, 2, 16)),
    (2, 1, KVSpec(2, 4, 2, 16)),
    (3, 1, KVSpec(3, 8, 2, 32)),       # GQA 4:1
    (2, 2, KVSpec(2, 4, 2, 16)),       # head shards: one kv head each
    (3, 3, KVSpec(2, 6, 3, 16)),
    (2, 2, KVSpec(2, 6, 3, 16)),       # uneven shards: 1 + 2 kv heads
], ids=["1w", "2w", "3w-gqa", "2w-shard2", "3w-shard3", "2w-shard-uneven"])
def test_matches_reference(fleet, workers, shards, spec):
    gen = torch.Generator().manual_seed(workers * 10 + shards)
    backend = remote(spec, fleet.addresses[:workers], head_shards=shards)
    try:
        seq_ids = [3, 10, 11, 40, 41, 42, 1 << 30]
        lens = [1, 5, 17, 2, 9, 33, 4]
        worst = run_both(spec, backend, TorchAttention(spec), seq_ids, lens, steps=3, gen=gen)
        assert worst < 1e-5
        st = backend.stats()
        assert st["sequences"] == len(seq_ids)
        assert st["kv_tokens"] == sum(lens) + 3 * len(seq_ids)
        assert len(st["workers"]) == workers and all(w["up"] for w in st["workers"])
        if shards == 1 and workers > 1:   # placement spread the batch over every worker
            assert all(w["sequences"] > 0 for w in st["workers"])
        assert sum(w["sequences"] for w in st["workers"]) == len(seq_ids) * shards
        assert st["decode_calls"] == 3 * spec.num_layers and st["decode_kernel_s"] > 0
    finally:
        backend.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shards", [1, 2])
def test_bit_identical_to_local_backend(fleet, dtype, shards):
    """In the engine's dtype, o from the R-workers equals the in-process kernel's o exactly."""
    from fastdecode.attention.local import LocalAttention

    spec = KVSpec(2, 6, 2, 32)
    config = EngineConfig(attention="remote", rworkers=tuple(fleet.addresses[:2]), head_shards=shards,
                          kv_capacity_bytes=16 << 20, kernel_threads=1)
    backend, local = RemoteAttention(spec, config), LocalAttention(spec, config)
    gen = torch.Generator().manual_seed(11)
    try:
        ids, lens = [4, 8, 15, 16, 23], [3, 1, 9, 2, 5]
        backend.open(ids)
        local.open(ids)
        for layer in range(spec.num_layers):
            k = torch.randn(sum(lens), 2, 32, generator=gen).to(dtype)
            v = torch.randn(sum(lens), 2, 32, generator=gen).to(dtype)
            backend.prefill(layer, ids, lens, k, v)
            local.prefill(layer, ids, lens, k, v)
        for _ in range(3):
            for layer in range(spec.num_layers):
                q = torch.randn(5, 6, 32, generator=gen).to(dtype)
                k = torch.randn(5, 2, 32, generator=gen).to(dtype)
                v = torch.randn(5, 2, 32, generator=gen).to(dtype)
                got = backend.submit_decode(layer, ids, q, k, v).result(timeout=30)
                want = local.decode(layer, ids, q, k, v)
                assert got.dtype == torch.float32
                assert torch.equal(got.to(dtype), want.to(dtype))
    finally:
        backend.shutdown()
        local.shutdown()


def test_errors_and_close_frees(fleet):
    spec = KVSpec(2, 4, 2, 16)
    backend = remote(spec, fleet.addresses[:2])
    try:
        backend.open([1, 2])
        with pytest.raises(ValueError, match="already open"):
            backend.open([2])
        q, kv = torch.zeros(1, 4, 16), torch.zeros(1, 2, 16)
        with pytest.raises(KeyError):
            backend.submit_decode(0, [99], q, kv, kv)
        with pytest.raises(ValueError):
            backend.submit_decode(0, [1], torch.zeros(1, 5, 16), kv, kv)
        with pytest.raises(ValueError):
            backend.submit_decode(2, [1], q, kv, kv)
        with pytest.raises(ValueError):
            backend.prefill(0, [1], [3], torch.zeros(2, 2, 16), torch.zeros(2, 2, 16))
        with pytest.raises(ValueError):       # checked by the worker: the future raises
            backend.submit_decode(0, [1], q, torch.full((1, 2, 16), float("nan")), kv).result(timeout=30)
        with pytest.raises(ValueError):
            backend.prefill(0, [1], [1], torch.full((1, 2, 16), float("inf")), kv)
        backend.decode(0, [1], q, kv, kv)       # still fine afterwards
        backend.close([1, 2, 77])               # unknown ids ignored
        assert backend.stats()["sequences"] == 0
        with pytest.raises(KeyError):
            backend.decode(0, [1], q, kv, kv)
        backend.open([1])                       # a closed id can be opened again
    finally:
        backend.shutdown()


def test_large_prefill_is_split_into_messages(fleet, monkeypatch):
    import fastdecode.attention.remote.messages as remote_mod

    monkeypatch.setattr(remote_mod, "MAX_MESSAGE_BYTES", 4096)   # ~32 tokens per message here
    spec = KVSpec(2, 4, 2, 16)
    gen = torch.Generator().manual_seed(3)
    backend = remote(spec, fleet.addresses[:2])
    try:
        worst = run_both(spec, backend, TorchAttention(spec), [1, 2, 3], [100, 3, 70], steps=2, gen=gen)
        assert worst < 1e-5
    finally:
        backend.shutdown()


def test_connection_end_frees_server_side(fleet):
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    def server_sequences():
        total = 0
        for a in fleet.addresses[:2]:
            with grpc.insecure_channel(a) as ch:
                total += pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5).sequences
        return total

    spec = KVSpec(2, 4, 2, 16)
    before = server_sequences()
    backend = remote(spec, fleet.addresses[:2])
    backend.open(list(range(10)))
    assert server_sequences() == before + 10
    backend.shutdown()        # without closing: the streams end and the workers free them
    deadline = time.monotonic() + 5
    while server_sequences() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_sequences() == before


def test_config_errors(fleet):
    spec = KVSpec(2, 4, 2, 16)
    with pytest.raises(ValueError, match="head_shards"):
        remote(spec, fleet.addresses[:3], head_shards=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        remote(KVSpec(2, 4, 1, 16), fleet.addresses[:2], head_shards=2)
    with pytest.raises(AttentionError, match="no R-worker"):
        remote(spec, ("127.0.0.1:1",), rworker_timeout_s=1.0)


def worker_stats(address: str):
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)


def wait_for(predicate, timeout: float = 5.0) -> bool:
    """Closes travel on the stream without a reply: poll the workers' Stats until they show."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def prefill_all_layers(backend, spec, seq_ids, lens) -> None:
    kv = torch.zeros(sum(lens), spec.num_kv_heads, spec.head_dim)
    for layer in range(spec.num_layers):
        backend.prefill(layer, seq_ids, lens, kv, kv)


def test_new_sequences_go_to_the_least_kv_load(fleet):
    """Placement counts KV tokens (a new, empty sequence as the mean length), not sequences."""
    spec = KVSpec(2, 4, 2, 16)
    addresses = fleet.addresses[:2]
    backend = remote(spec, addresses)
    try:
        before = [worker_stats(a) for a in addresses]
        backend.open([1, 2])
        heavy, light = backend.placement[1].index, backend.placement[2].index
        assert heavy != light
        prefill_all_layers(backend, spec, [1, 2], [50, 5])
        backend.open([3])                    # light holds 5 tokens, heavy 50
        assert backend.placement[3].index == light
        backend.open([4])                    # light: 5 + one empty sequence (the mean, 55 / 3) < 50
        assert backend.placement[4].index == light     # though it holds more sequences
        prefill_all_layers(backend, spec, [3, 4], [30, 30])
        backend.open([5])                    # light: 65 tokens, heavy 50
        assert backend.placement[5].index == heavy
        st = backend.stats()["workers"]
        assert [st[heavy]["sequences"], st[light]["sequences"]] == [2, 3]
        assert [st[heavy]["kv_tokens"], st[light]["kv_tokens"]] == [50, 65]
        after = [worker_stats(a) for a in addresses]     # the workers agree
        assert after[heavy].sequences - before[heavy].sequences == 2
        assert after[light].sequences - before[light].sequences == 3
        assert after[heavy].kv_tokens - before[heavy].kv_tokens == 50
        assert after[light].kv_tokens - before[light].kv_tokens == 65
    finally:
        backend.shutdown()


def test_worker_is_up_only_once_configured(fleet, monkeypatch):
    """A reconnecting worker takes no other call before its Configure is answered: one sent
    ahead of Configure on the new stream was refused ("Configure must be the first call")."""
    from fastdecode.attention.remote import connection as remote_mod

    spec = KVSpec(2, 4, 2, 16)
    backend = remote(spec, fleet.addresses[:1])
    try:
        w = backend.workers[0]
        w.fail(w.generation, "test: stream broken")
        seen = []
        send = remote_mod.WorkerConnection.send

        def spy(self, request, *args, **kw):
            if request.WhichOneof("op") == "configure":
                seen.append(self.up)
                # What another thread's open() would do now: it must not reach this stream.
                assert isinstance(self.send(pb_open([1])).exception(timeout=0), remote_mod.WorkerLost)
            return send(self, request, *args, **kw)

        monkeypatch.setattr(remote_mod.WorkerConnection, "send", spy)
        assert backend._try_connect(w)
        assert seen == [False] and w.up
        backend.open([1])
        assert backend.stats()["sequences"] == 1
    finally:
        backend.shutdown()


def pb_open(ids):
    from rpart.proto import rworker_pb2 as pb

    return pb.Request(open=pb.Open(seq_ids=ids))


def test_a_prefill_error_beside_a_lost_worker_is_not_dropped(fleet, monkeypatch):
    """One worker of a prefill call is lost while another answers with an error: the call fails
    with that error (it used to raise only SequencesLost, and the other sequences went on
    without their KV)."""
    from concurrent.futures import Future

    import grpc

    from fastdecode.attention.remote import connection as remote_mod
    from rpart.proto import rworker_pb2 as pb

    spec = KVSpec(2, 4, 2, 16)
    backend = remote(spec, fleet.addresses[:2])
    try:
        backend.open([1, 2])
        assert backend.placement[1] is not backend.placement[2]                # one sequence each
        send = remote_mod.WorkerConnection.send

        def faulty(self, request, *args, **kw):
            if request.WhichOneof("op") != "prefill":
                return send(self, request, *args, **kw)
            fut: Future = Future()
            if self.index == 0:
                fut.set_exception(remote_mod.WorkerLost("test: worker 0 gone"))
            else:
                fut.set_result(pb.Reply(call_id=request.call_id, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                        message="test: bad k"))
            return fut

        monkeypatch.setattr(remote_mod.WorkerConnection, "send", faulty)
        with pytest.raises(ValueError, match="test: bad k"):
            backend.prefill(0, [1, 2], [1, 1], torch.zeros(2, 2, 16), torch.zeros(2, 2, 16))
    finally:
        backend.shutdown()


def test_prefill_beside_a_lost_sequence_still_stores_the_others(fleet):
    """A batch prefill with one sequence lost (its worker died between layers) raises
    SequencesLost for it alone and still stores every layer of the others' KV. It used to raise
    before sending anything, so the survivors decoded on with a layer of their prompt missing."""
    spec = KVSpec(2, 4, 2, 16)
    backend = remote(spec, fleet.addresses[:2])
    ref = TorchAttention(spec)
    gen = torch.Generator().manual_seed(3)
    try:
        backend.open([1, 2])
        ref.open([1])
        g2 = backend.placement[2]
        assert backend.placement[1] is not g2
        for layer in range(spec.num_layers):
            k = fp16(torch.randn(6, spec.num_kv_heads, spec.head_dim, generator=gen))
            v = fp16(torch.randn(6, spec.num_kv_heads, spec.head_dim, generator=gen))
            if layer == 1:                                   # as a stream break leaves it
                backend._worker_down(g2.workers[0], "test: worker gone")
            if layer == 0:
                backend.prefill(layer, [1, 2], [3, 3], k, v)
            else:
                with pytest.raises(SequencesLost) as e:
                    backend.prefill(layer, [1, 2], [3, 3], k, v)
                assert e.value.seq_ids == [2]
            ref.prefill(layer, [1], [3], k[:3], v[:3])
        assert backend.stats()["kv_tokens"] == 3
        for layer in range(spec.num_layers):
            q = torch.randn(1, spec.num_heads, spec.head_dim, generator=gen)
            k = fp16(torch.randn(1, spec.num_kv_heads, spec.head_dim, generator=gen))
            v = fp16(torch.randn(1, spec.num_kv_heads, spec.head_dim, generator=gen))
            got = backend.submit_decode(layer, [1], q, k, v).result(timeout=30)
            assert (got - ref.decode(layer, [1], q, k, v)).abs().max().item() < 1e-5, layer
    finally:
        backend.shutdown()
