"""RemoteAttention.stats()["kv_bytes"]: the bytes the R-workers' stores hold, fp16 and int4."""
from __future__ import annotations

import grpc
import pytest
import torch

from fastdecode.attention.base import KVSpec
from fastdecode.attention.remote.backend import RemoteAttention, kv_bytes_per_token_head
from fastdecode.config import EngineConfig
from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from fastdecode.ops.testing import local_fleet


@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("kv_format", ["fp16", "int4"])
def test_bytes_per_token_head_match_the_store_layout(kv_format, head_dim):
    from rpart.kernels import KVStore

    store = KVStore(1, 1, head_dim, 8 << 20, block_size=16, kv_format=kv_format, num_threads=1)
    assert kv_bytes_per_token_head(kv_format, head_dim) * 16 == store.block_bytes


def test_int4_token_of_one_kv_head_at_head_dim_128_takes_152_bytes():
    assert kv_bytes_per_token_head("int4", 128) == 152
    assert kv_bytes_per_token_head("fp16", 128) == 512


@pytest.mark.parametrize("kv_format", ["fp16", "int4"])
def test_stats_kv_bytes_match_the_workers(tmp_path, kv_format):
    spec = KVSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128)
    lens = [32, 48]                       # whole blocks of 16 tokens: the store holds no padding
    with local_fleet(2, tmp_path, kv_capacity="16M") as fleet:
        backend = RemoteAttention(spec, EngineConfig(attention="remote", rworkers=tuple(fleet.addresses),
                                                     kv_format=kv_format))
        try:
            backend.open([1, 2])
            for layer in range(spec.num_layers):
                k = torch.randn(sum(lens), spec.num_kv_heads, spec.head_dim)
                backend.prefill(layer, [1, 2], lens, k, k)
            used = 0
            for address in fleet.addresses:
                with grpc.insecure_channel(address) as ch:
                    used += pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10).bytes_used
            st = backend.stats()
            assert st["kv_tokens"] == sum(lens)
            assert st["kv_bytes"] == used > 0
        finally:
            backend.shutdown()
