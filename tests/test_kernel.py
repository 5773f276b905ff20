"""The C++ KV store and decode-attention kernel against a float64 reference.

fp16: exact to fp32 rounding against the reference on the fp16-rounded K, V.
int4: exact to fp32 rounding against the reference on the dequantized cache
(KVStore.read), and its error against the unquantized cache is reported.
Every ISA path the CPU supports is forced in turn.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdecode.attention.base import KVCapacityError
from rpart.kernels import KVStore, cpu_supports


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q K^T / sqrt(D)) V in float64; q [H, D], k/v [T, Hkv, D]; GQA by repeating kv heads."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[1]
    kk = np.repeat(k, group, axis=1).transpose(1, 0, 2)
    vv = np.repeat(v, group, axis=1).transpose(1, 0, 2)
    s = np.einsum("hd,htd->ht", q, kk) / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(axis=-1, keepdims=True), vv)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_supports(isa), reason=f"CPU lacks {isa}"))
        for isa in ("scalar", "avx2", "avx512", "avx512vnni")]
FP16_TOL = 4 * 4.5e-6  # measured max 4.5e-6 over this file (scalar path; 3.0e-6 on the vector paths)
INT4_TOL = 2e-5  # fp32 rounding over sums of up to a few thousand terms
BS = 16


def make_store(hkv, d, fmt="fp16", isa="auto", layers=2, capacity=16 << 20, threads=2, block_size=BS):
    """populate=False: no thread but the pool's (tests/test_kernel_threads.py counts them)."""
    return KVStore(layers, hkv, d, capacity, block_size=block_size, kv_format=fmt, num_threads=threads, isa=isa,
                   populate=False)


def fill(store, rng, layer, ids, lens, scale=1.0):
    hkv, d = store.num_kv_heads, store.head_dim
    k = (rng.standard_normal((sum(lens), hkv, d)) * scale).astype(np.float32)
    v = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    store.append_span(layer, ids, lens, k, v)
    offs = np.cumsum([0] + list(lens))
    return [(k[offs[i]:offs[i + 1]], v[offs[i]:offs[i + 1]]) for i in range(len(ids))]


def check_against_reference(store, ids, q, o, originals=None, layer=0, int4_tol=INT4_TOL):
    """o[i] vs the reference on the cache as stored; returns int4-vs-unquantized errors."""
    errs = []
    for i, sid in enumerate(ids):
        kc, vc = store.read(sid, layer)
        tol = FP16_TOL if store.kv_format == "fp16" else int4_tol
        assert rel(o[i], reference(q[i], kc, vc)) <= tol, (store.isa, sid, kc.shape)
        if originals is not None:
            k, v = originals[i]
            if store.kv_format == "fp16":
                np.testing.assert_array_equal(kc, k.astype(np.float16).astype(np.float32))
                np.testing.assert_array_equal(vc, v.astype(np.float16).astype(np.float32))
            else:
                errs.append(rel(o[i], reference(q[i], k, v)))
    return errs


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("group,hkv,d", [(1, 2, 64), (3, 3, 64), (4, 2, 128), (8, 1, 128), (4, 3, 32)])
def test_matches_reference(isa, fmt, group, hkv, d):
    rng = np.random.default_rng(group * 1000 + d)
    store = make_store(hkv, d, fmt, isa)
    assert store.isa == isa
    ids = [11, 3, 7, 42, 5]
    lens = [1, BS - 1, BS, BS + 1, 3 * BS + 5]
    store.create(ids)
    originals = fill(store, rng, 1, ids, lens, scale=2.0)
    q = rng.standard_normal((len(ids), group * hkv, d)).astype(np.float32)
    o = store.attend(1, ids, q)
    assert o.dtype == np.float32 and o.shape == q.shape
    errs = check_against_reference(store, ids, q, o, originals, layer=1)
    if fmt == "int4":
        print(f"int4 vs unquantized rel L2 ({isa}, G={group}, D={d}): max {max(errs):.3g}")
        assert max(errs) < 0.25


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes(seed):
    """Random kv heads, group, head_dim, block size and lengths; every supported ISA on the same data."""
    rng = np.random.default_rng(100 + seed)
    hkv, group = int(rng.integers(1, 5)), int(rng.choice([1, 2, 3, 4, 5, 8, 12]))
    fmt = ["fp16", "int4"][seed % 2]
    d = int(rng.choice([16, 32, 48, 64, 80, 128] if fmt == "fp16" else [16, 32, 48, 64, 128]))
    bs = int(rng.choice([1, 3, 8, 16, 32]))
    lens = [int(x) for x in rng.integers(1, 3 * bs + 40, size=int(rng.integers(1, 5)))]
    ids = [int(x) for x in rng.choice(1000, size=len(lens), replace=False)]
    k = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    v = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    q = rng.standard_normal((len(ids), group * hkv, d)).astype(np.float32)
    outs = {}
    for isa in ("scalar", "avx2", "avx512", "avx512vnni"):
        if not cpu_supports(isa) or (isa != "scalar" and d % 16) or (isa.startswith("avx512") and fmt == "int4" and d % 32):
            continue
        store = make_store(hkv, d, fmt, isa, layers=1, block_size=bs)
        store.create(ids)
        store.append_span(0, ids, lens, k, v)
        outs[isa] = store.attend(0, ids, q)
        check_against_reference(store, ids, q, outs[isa])
    assert "scalar" in outs
    for o in outs.values():  # the paths agree with each other to fp32 rounding
        assert rel(o, outs["scalar"].astype(np.float64)) < 2e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_long_context_4097(isa, fmt):
    rng = np.random.default_rng(4097)
    store = make_store(2, 64, fmt, isa)
    store.create([1, 2])
    originals = fill(store, rng, 0, [1, 2], [4097, 100])
    q = rng.standard_normal((2, 8, 64)).astype(np.float32) * 3
    errs = check_against_reference(store, [1, 2], q, store.attend(0, [1, 2], q), originals)
    if fmt == "int4":
        print(f"int4 vs unquantized rel L2 at 4097 tokens ({isa}): {errs}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_decode_steps_cross_blocks(isa, fmt):
    """Prefill spans, then one-token decodes across block boundaries, each checked."""
    rng = np.random.default_rng(7)
    hkv, d, h = 2, 64, 8
    store = make_store(hkv, d, fmt, isa)
    ids = [0, 1, 2]
    store.create(ids)
    fill(store, rng, 0, ids, [BS - 2, 0, 2 * BS])
    for step in range(4):
        q = rng.standard_normal((3, h, d)).astype(np.float32)
        k = rng.standard_normal((3, hkv, d)).astype(np.float32)
        v = rng.standard_normal((3, hkv, d)).astype(np.float32)
        o = store.decode(0, ids, q, k, v)
        check_against_reference(store, ids, q, o)
    assert [store.length(i, 0) for i in ids] == [BS + 2, 4, 2 * BS + 4]
    assert store.length(0, 1) == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("pattern", ["creep", "steps", "fall", "spike"])
def test_running_max_moves_by_small_and_large_steps(isa, fmt, pattern):
    """The online softmax moves its running max only when a block's scores pass it by more than a
    slack (kMaxSlack, 8 in log2 units), so probabilities exceed 1 in between. Scores along one key
    direction: creeping up by less than the slack per block, stepping up by more than it, falling
    (the first block holds the max), and one spike amid low scores."""
    hkv, d, group, n = 2, 64, 4, 12 * BS + 5
    t = np.arange(n, dtype=np.float64)
    amp = {"creep": t * 0.2, "steps": (t // 40) * 30.0, "fall": (n - t) * 0.5,
           "spike": np.where(t == 7 * BS + 3, 80.0, 0.0)}[pattern]
    rng = np.random.default_rng(len(pattern))
    e = np.ones(d) / np.sqrt(d)  # scores s_t ~= amp_t * 3 / sqrt(d) (natural log units)
    k = (amp[:, None, None] * e + 0.1 * rng.standard_normal((n, hkv, d))).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    q = (3 * e + 0.1 * rng.standard_normal((1, hkv * group, d))).astype(np.float32)
    store = make_store(hkv, d, fmt, isa, layers=1)
    store.create([4])
    store.append_span(0, [4], [n], k, v)
    check_against_reference(store, [4], q, store.attend(0, [4], q))


def test_torch_inputs_and_dtypes():
    rng = np.random.default_rng(6)
    store = make_store(2, 64)
    store.create(torch.tensor([1, 2]))
    k = torch.randn(10, 2, 64)
    v = torch.randn(10, 2, 64)
    store.append_span(0, torch.tensor([1, 2]), torch.tensor([4, 6]), k.half(), v.bfloat16())
    kc, vc = store.read(2, 0)
    np.testing.assert_array_equal(kc, k[4:].half().float().numpy())
    np.testing.assert_array_equal(vc, v[4:].bfloat16().half().float().numpy())
    q = torch.from_numpy(rng.standard_normal((2, 4, 64)).astype(np.float32))
    o32 = store.attend(0, [1, 2], q)
    o16 = store.attend(0, [1, 2], q.half())
    check_against_reference(store, [1, 2], q.numpy(), o32)
    check_against_reference(store, [1, 2], q.half().float().numpy(), o16)
    o_nc = store.attend(0, [1, 2], q.transpose(0, 1).contiguous().transpose(0, 1))  # non-contiguous view
    np.testing.assert_array_equal(o_nc, o32)


def test_free_then_reuse_blocks():
    rng = np.random.default_rng(8)
    store = make_store(2, 64, capacity=40 * 2 * (16 * 64 * 2) * 2)  # 40 blocks: 2 kv heads x (K + V) x 16 x 64 fp16
    total = store.stats()["blocks_total"]
    assert total == 40
    store.create([1, 2])
    fill(store, rng, 0, [1, 2], [5 * BS, 3 * BS + 1])
    fill(store, rng, 1, [1], [BS])
    st = store.stats()
    assert (st["sequences"], st["kv_tokens"], st["blocks_used"]) == (2, 8 * BS + 1, 10)
    assert st["bytes_used"] == 10 * store.block_bytes
    store.free([1, 999])  # unknown ids are ignored
    assert store.stats()["blocks_used"] == 4 and not store.has(1) and store.has(2)
    with pytest.raises(KeyError):
        store.attend(0, [1], np.zeros((1, 2, 64), np.float32))
    store.create([1])  # the id is free again
    originals = fill(store, rng, 0, [1], [6 * BS])
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    check_against_reference(store, [1], q[:1], store.attend(0, [1], q[:1]), originals)
    assert store.stats()["blocks_used"] == 10 and store.stats()["blocks_total"] == total


@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_capacity_exhaustion_is_atomic(fmt):
    rng = np.random.default_rng(9)
    probe = make_store(2, 64, fmt, layers=1)
    store = make_store(2, 64, fmt, layers=1, capacity=6 * probe.block_bytes)
    assert store.stats()["blocks_total"] == 6
    store.create([1, 2, 3])
    fill(store, rng, 0, [1, 2, 3], [2 * BS, BS, 2 * BS])  # 5 of 6 blocks
    before = [store.read(i, 0) for i in (1, 2, 3)]
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    with pytest.raises(KVCapacityError):  # needs 3 new blocks, 1 free
        store.decode(0, [1, 2, 3], q, k, k)
    with pytest.raises(KVCapacityError):
        store.append_span(0, [2, 3], [1, 2 * BS], np.zeros((2 * BS + 1, 2, 64), np.float32),
                          np.zeros((2 * BS + 1, 2, 64), np.float32))
    for i, (kb, vb) in zip((1, 2, 3), before):
        kc, vc = store.read(i, 0)
        np.testing.assert_array_equal(kc, kb)
        np.testing.assert_array_equal(vc, vb)
    assert store.stats()["blocks_used"] == 5
    store.decode(0, [1], q[:1], k[:1], k[:1])  # one block: fits
    store.free([2])
    o = store.decode(0, [1, 3], q[[0, 2]], k[[0, 2]], k[[0, 2]])
    check_against_reference(store, [1, 3], q[[0, 2]], o)
