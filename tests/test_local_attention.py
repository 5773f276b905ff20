"""LocalAttention (the C++ kernel behind AttentionBackend) against the plain-torch backend."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from fastdecode.attention import create_backend
from fastdecode.attention.base import KVCapacityError, KVSpec
from fastdecode.attention.local import LocalAttention
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.config import EngineConfig

SPEC = KVSpec(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)


def backends(kv_format="fp16", capacity=8 << 20, spec=SPEC):
    cfg = EngineConfig(kv_format=kv_format, kv_capacity_bytes=capacity, kv_block_size=16, kernel_threads=2)
    return LocalAttention(spec, cfg), TorchAttention(spec)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def attention_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(D)) V in float64 for one sequence: q [H, D], k/v [T, Hkv, D]."""
    q, k, v = q.double(), torch.as_tensor(k).double(), torch.as_tensor(v).double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q, k) / q.shape[1] ** 0.5, dim=-1)
    return torch.einsum("ht,thd->hd", p, v)


# Max rel L2 of the output against attention over the cache the kernel holds (fp32 rounding),
# measured over these steps, dtypes and every ISA path (worst: scalar): fp16 3.2e-7, int4 1.9e-6.
OUT_TOL = {"fp16": 4 * 3.2e-7, "int4": 4 * 1.9e-6}
# The int4 cache against the K, V fed in (the quantization): measured 0.11 max rel L2 per token.
INT4_KV_TOL = 4 * 0.11


@pytest.mark.parametrize("kv_format", ["fp16", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_attention_over_its_cache(kv_format, dtype):
    """Through prefill and 20 decode steps (crossing block boundaries), every output is attention
    over the cache the kernel holds, and that cache is what was fed: fp16 exactly, int4 within
    its quantization error, every token in order."""
    torch.manual_seed(0)
    local, _ = backends(kv_format)
    ids, lens = [4, 9, 2], [5, 16, 33]
    local.open(ids)
    k = torch.randn(sum(lens), 2, 64, dtype=dtype)
    v = torch.randn(sum(lens), 2, 64, dtype=dtype)
    starts = [sum(lens[:i]) for i in range(len(ids))]
    fed = {(sid, layer): ([k[s:s + n]], [v[s:s + n]]) for layer in range(2)
           for sid, s, n in zip(ids, starts, lens)}
    for layer in range(2):
        local.prefill(layer, ids, lens, k, v)
    worst = 0.0
    for step in range(20):
        q = torch.randn(3, 8, 64, dtype=dtype)
        kn = torch.randn(3, 2, 64, dtype=dtype)
        vn = torch.randn(3, 2, 64, dtype=dtype)
        for layer in range(2):
            fut = local.submit_decode(layer, ids, q, kn, vn)
            assert isinstance(fut, Future)
            got = fut.result(timeout=30)
            # bfloat16 in, bfloat16 out (the kernel rounds its float32 result), else float32
            assert got.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            assert got.shape == (3, 8, 64)
            got = got.float()
            for i, sid in enumerate(ids):
                fed[sid, layer][0].append(kn[i:i + 1])
                fed[sid, layer][1].append(vn[i:i + 1])
                kc, vc = local.store.read(sid, layer)
                worst = max(worst, rel(got[i], attention_over(q[i], kc, vc)))
    worst_kv = 0.0
    for (sid, layer), (ks, vs) in fed.items():
        kc, vc = (torch.as_tensor(x) for x in local.store.read(sid, layer))
        kf, vf = torch.cat(ks).float(), torch.cat(vs).float()
        assert kc.shape == kf.shape == (lens[ids.index(sid)] + 20, 2, 64)
        if kv_format == "fp16":
            assert torch.equal(kc, kf.half().float()) and torch.equal(vc, vf.half().float())
        else:
            for a, b in ((kc, kf), (vc, vf)):     # per token
                worst_kv = max(worst_kv, float(((a - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2))).max()))
    print(f"LocalAttention {kv_format} {dtype} ({local.store.isa}): max rel L2 vs attention over its cache "
          f"{worst:.3g}; int4 cache vs fed K, V {worst_kv:.3g}")
    assert worst <= OUT_TOL[kv_format] + (2.0 ** -8 if dtype == torch.bfloat16 else 0.0)
    assert worst_kv <= INT4_KV_TOL
    st = local.stats()
    assert st["sequences"] == 3 and st["kv_tokens"] == sum(lens) + 3 * 20
    assert 0 < st["kv_bytes"] <= st["capacity_bytes"] == 8 << 20
    local.close([4])
    local.close([4, 12345])  # idempotent
    assert local.stats()["sequences"] == 2
    local.shutdown()


def test_create_backend_picks_local():
    be = create_backend(EngineConfig(attention="local", kv_capacity_bytes=1 << 20), SPEC)
    assert isinstance(be, LocalAttention)
    be.shutdown()


def test_errors_map_to_base_exceptions():
    local, _ = backends(capacity=4 * 2 * (16 * 64 * 2) * 2)  # 4 blocks: 2 kv heads x (K + V) x 16 tokens x 64 fp16
    local.open([1, 2])
    k = torch.randn(40, 2, 64)
    local.prefill(0, [1, 2], [20, 20], k, k)  # 4 blocks
    q, kv = torch.randn(2, 8, 64), torch.randn(2, 2, 64)
    with pytest.raises(KVCapacityError):
        local.decode(1, [1, 2], q, kv, kv)
    with pytest.raises(KVCapacityError):
        local.prefill(1, [1], [1], kv[:1], kv[:1])
    with pytest.raises(KeyError):
        local.submit_decode(0, [1, 3], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [1, 2], q[:, :5], kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [1, 2], q, kv[:, :1], kv[:, :1])
    with pytest.raises(ValueError):
        local.submit_decode(2, [1, 2], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [1, 1], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [1.5, 2], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [1, 2], q, kv, kv.to("meta"))
    with pytest.raises(ValueError):
        local.submit_decode(0, [1, 2], q.double(), kv, kv)
    with pytest.raises(ValueError):
        local.decode(0, [1, 2], q * float("nan"), kv, kv)
    with pytest.raises(ValueError):
        local.prefill(0, [1], [3], kv, kv)
    with pytest.raises(ValueError):
        local.open([1])
    assert local.store.length(1, 0) == 20 and local.store.length(1, 1) == 0
    local.close([2])
    out = local.decode(0, [1], q[:1], kv[:1], kv[:1])  # capacity freed by close
    assert torch.isfinite(out).all() and local.store.length(1, 0) == 21
    local.shutdown()


def test_decode_runs_off_the_callers_thread_without_the_gil():
    """With the S-Part on a GPU (here: a config that says so), the kernel overlaps with it."""
    spec = KVSpec(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128)
    local = LocalAttention(spec, EngineConfig(kv_capacity_bytes=256 << 20, kernel_threads=2, device="cuda"))
    assert local.overlaps and not local.store.openmp
    ids = list(range(16))
    local.open(ids)
    k = torch.randn(16 * 1024, 8, 128, dtype=torch.float16)
    local.prefill(0, ids, [1024] * 16, k, k)
    q, kv = torch.randn(16, 32, 128), torch.randn(16, 8, 128)
    local.decode(0, ids, q, kv, kv)  # warm up
    t0 = time.perf_counter()
    fut = local.submit_decode(0, ids, q, kv, kv)
    submit_s = time.perf_counter() - t0
    spins = 0
    while not fut.done():
        spins += 1  # the Python thread keeps running while the kernel works
    total_s = time.perf_counter() - t0
    assert fut.result().shape == (16, 32, 128)
    assert threading.current_thread() is threading.main_thread()
    assert submit_s < total_s / 2 and spins > 100, (submit_s, total_s, spins)
    local.shutdown()


def test_decode_runs_inline_on_torchs_threads_with_a_cpu_s_part():
    """With the S-Part on the CPU the kernel would only take its cores: the call runs in the
    caller's thread, on the OpenMP team torch's ops use (one libgomp in the process), and the
    engine gives it the whole batch at once (overlaps False)."""
    local = LocalAttention(SPEC, EngineConfig(kv_capacity_bytes=8 << 20))
    assert not local.overlaps and local.store.openmp and local.store.num_threads == torch.get_num_threads()
    ids = list(range(4))
    local.open(ids)
    q, kv = torch.randn(4, SPEC.num_heads, SPEC.head_dim), torch.randn(4, SPEC.num_kv_heads, SPEC.head_dim)
    caller = threading.get_ident()
    seen = []
    fut = local.submit_decode(0, ids, q, kv, kv)
    fut.add_done_callback(lambda _f: seen.append(threading.get_ident()))   # runs at once: already done
    assert fut.done() and seen == [caller] and fut.result().shape == (4, SPEC.num_heads, SPEC.head_dim)
    bad = kv.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError):               # the kernel's refusal raises in the caller's thread
        local.submit_decode(0, ids, q, bad, kv)
    with pytest.raises(KeyError):                 # so do the ids the store checks (not checked twice)
        local.submit_decode(0, [0, 1, 2, 9], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [0, 1, 2, 2], q, kv, kv)
    with pytest.raises(ValueError):
        local.submit_decode(0, [0, 1, 2, True], q, kv, kv)
    assert [local.store.length(i, 0) for i in ids] == [1] * 4   # the refused calls appended nothing
    gomp = {line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith("/libgomp.so.1")}
    assert len(gomp) == 1, gomp                   # torch and the kernel share one OpenMP runtime
    local.shutdown()


def test_int4_groups_follow_the_config():
    def store(**kw):
        return LocalAttention(SPEC, EngineConfig(kv_capacity_bytes=8 << 20, kernel_threads=1, **kw)).store

    assert store(kv_format="int4").groups == (32, 64)  # the kernel's defaults at head_dim 64
    assert store(kv_format="int4", kv_int4_k_group=16, kv_int4_v_group=32).groups == (16, 32)
    assert store(kv_format="fp16", kv_int4_v_group=32).groups == (0, 0)  # fp16: the int4 settings are unused
    with pytest.raises(ValueError, match="dividing head_dim 64"):
        store(kv_format="int4", kv_int4_v_group=128)
    for bad in (48, 8, -32, "32", 32.0, True, None):
        with pytest.raises(ValueError, match="kv_int4_k_group"):
            EngineConfig(kv_int4_k_group=bad)
        with pytest.raises(ValueError, match="kv_int4_v_group"):
            EngineConfig(kv_int4_v_group=bad)


def test_int4_fp16_tail_follows_the_config():
    on = LocalAttention(SPEC, EngineConfig(kv_format="int4", kv_capacity_bytes=8 << 20, kernel_threads=1))
    off = LocalAttention(SPEC, EngineConfig(kv_format="int4", kv_capacity_bytes=8 << 20, kernel_threads=1,
                                            kv_int4_fp16_tail=False))
    assert on.store.stats()["tail_blocks_total"] > 0 and off.store.stats()["tail_blocks_total"] == 0
    fp16 = LocalAttention(SPEC, EngineConfig(kv_format="fp16", kv_capacity_bytes=8 << 20, kernel_threads=1))
    assert fp16.store.stats()["tail_blocks_total"] == 0          # fp16 KV needs no tail
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="kv_int4_fp16_tail"):
            EngineConfig(kv_int4_fp16_tail=bad)
