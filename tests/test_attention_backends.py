"""One suite for every AttentionBackend, against the plain-torch reference.

Other backends reuse it: subclass AttentionBackendSuite and override the
`make_backend` fixture (a callable spec -> backend) and, if needed, `atol`:

    from test_attention_backends import AttentionBackendSuite
    class TestRemoteBackend(AttentionBackendSuite):
        @pytest.fixture
        def make_backend(self, rworker_addresses):
            return lambda spec: RemoteAttention(spec, EngineConfig(attention="remote", rworkers=...))
"""
from __future__ import annotations

import pytest
import torch

from fastdecode.attention.base import KVSpec
from fastdecode.attention.torch_ref import TorchAttention, reference_decode_attention
from fastdecode.config import EngineConfig

SPEC = KVSpec(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=32)


def local_backend(spec: KVSpec):
    from fastdecode.attention.local import LocalAttention
    return LocalAttention(spec, EngineConfig(attention="local", kv_capacity_bytes=64 << 20, kernel_threads=2))


BACKENDS = [
    pytest.param((lambda spec: TorchAttention(spec), 1e-5), id="torch"),
    pytest.param((local_backend, 3e-3), id="local"),         # fp16 KV storage
]


class Reference:
    """What the cache should hold: every k, v ever stored, per (sequence, layer)."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self.k: dict[tuple[int, int], torch.Tensor] = {}
        self.v: dict[tuple[int, int], torch.Tensor] = {}

    def append(self, layer, sid, k, v):
        empty = torch.empty(0, self.spec.num_kv_heads, self.spec.head_dim)
        self.k[sid, layer] = torch.cat([self.k.get((sid, layer), empty), k.float()])
        self.v[sid, layer] = torch.cat([self.v.get((sid, layer), empty), v.float()])

    def attend(self, layer, sid, q):
        return reference_decode_attention(q.float(), self.k[sid, layer], self.v[sid, layer], self.spec.scale)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


class AttentionBackendSuite:
    @pytest.fixture(params=BACKENDS)
    def backend_case(self, request):
        return request.param

    @pytest.fixture
    def backend(self, backend_case):
        b = backend_case[0](SPEC)
        yield b
        b.shutdown()

    @pytest.fixture
    def atol(self, backend_case):
        return backend_case[1]

    def _prefill(self, backend, ref, ids, lens, dtype=torch.float32):
        for layer in range(SPEC.num_layers):
            k = rand(sum(lens), SPEC.num_kv_heads, SPEC.head_dim, dtype=dtype)
            v = rand(sum(lens), SPEC.num_kv_heads, SPEC.head_dim, dtype=dtype)
            backend.prefill(layer, ids, lens, k, v)
            start = 0
            for sid, n in zip(ids, lens):
                ref.append(layer, sid, k[start:start + n], v[start:start + n])
                start += n

    def _decode_step(self, backend, ref, ids, atol, dtype=torch.float32):
        for layer in range(SPEC.num_layers):
            q = rand(len(ids), SPEC.num_heads, SPEC.head_dim, dtype=dtype)
            k = rand(len(ids), SPEC.num_kv_heads, SPEC.head_dim, dtype=dtype)
            v = rand(len(ids), SPEC.num_kv_heads, SPEC.head_dim, dtype=dtype)
            o = backend.submit_decode(layer, ids, q, k, v).result()
            # float32, or bfloat16 where q is (a backend may round its result as torch would)
            assert o.dtype in {torch.float32, q.dtype if q.dtype == torch.bfloat16 else torch.float32}
            assert o.shape == q.shape
            for i, sid in enumerate(ids):
                ref.append(layer, sid, k[i:i + 1], v[i:i + 1])
                torch.testing.assert_close(o[i].float(), ref.attend(layer, sid, q[i]), atol=atol, rtol=atol)

    def test_prefill_then_decode_matches_reference(self, backend, atol):
        torch.manual_seed(0)
        ref = Reference(SPEC)
        ids, lens = [11, 5, 42], [1, 17, 40]
        backend.open(ids)
        self._prefill(backend, ref, ids, lens)
        for _ in range(5):
            self._decode_step(backend, ref, ids, atol)
        self._decode_step(backend, ref, [42, 11], atol)           # a subset, another order
        st = backend.stats()
        assert st["sequences"] == 3
        assert st["kv_tokens"] == sum(lens) + 3 * 5 + 2      # tokens per sequence (layer 0), summed
        backend.close(ids)
        assert backend.stats()["sequences"] == 0 and backend.stats()["kv_tokens"] == 0

    def test_decode_from_empty_cache(self, backend, atol):
        torch.manual_seed(1)
        ref = Reference(SPEC)
        backend.open([1, 2])
        for _ in range(3):
            self._decode_step(backend, ref, [1, 2], atol)
        backend.close([1, 2])

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_low_precision_inputs(self, backend, atol, dtype):
        torch.manual_seed(2)
        ref = Reference(SPEC)
        backend.open([3])
        self._prefill(backend, ref, [3], [9], dtype=dtype)
        self._decode_step(backend, ref, [3], max(atol, 3e-3), dtype=dtype)
        backend.close([3])

    def test_close_frees_and_is_idempotent(self, backend):
        backend.open([1, 2, 3])
        self._prefill(backend, Reference(SPEC), [1, 2, 3], [4, 4, 4])
        backend.close([2])
        backend.close([2, 999])                   # unknown ids are ignored
        assert backend.stats()["sequences"] == 2
        backend.close([1, 3])
        assert backend.stats()["sequences"] == 0 and backend.stats()["kv_tokens"] == 0

    def test_unknown_sequence_is_key_error(self, backend):
        q = rand(1, SPEC.num_heads, SPEC.head_dim)
        k = rand(1, SPEC.num_kv_heads, SPEC.head_dim)
        with pytest.raises(KeyError):
            backend.submit_decode(0, [77], q, k, k).result()
        with pytest.raises(KeyError):
            backend.prefill(0, [77], [1], k, k)

    def test_duplicate_open_rejected(self, backend):
        backend.open([5])
        with pytest.raises(ValueError):
            backend.open([5])
        backend.close([5])

    @pytest.mark.parametrize("shape", [(1, SPEC.num_heads, SPEC.head_dim + 1), (2, SPEC.num_heads, SPEC.head_dim),
                                       (1, SPEC.num_heads - 1, SPEC.head_dim)])
    def test_bad_q_shape_is_value_error(self, backend, shape):
        backend.open([6])
        k = rand(1, SPEC.num_kv_heads, SPEC.head_dim)
        with pytest.raises(ValueError):
            backend.submit_decode(0, [6], rand(*shape), k, k).result()
        backend.close([6])

    def test_prefill_lens_mismatch_is_value_error(self, backend):
        backend.open([8])
        k = rand(5, SPEC.num_kv_heads, SPEC.head_dim)
        with pytest.raises(ValueError):
            backend.prefill(0, [8], [4], k, k)
        backend.close([8])


class TestAttentionBackends(AttentionBackendSuite):
    pass
