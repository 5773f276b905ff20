"""The C++ KV store and decode-attention kernel against a float64 reference.

fp16: exact to fp32 rounding against the reference on the fp16-rounded K, V.
int4: exact to fp32 rounding against the reference on the dequantized cache
(KVStore.read), and its error against the unquantized cache is reported.
Every ISA path the CPU supports is forced in turn.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

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
    return KVStore(layers, hkv, d, capacity, block_size=block_size, kv_format=fmt, num_threads=threads, isa=isa)


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




@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("openmp", [False, True])
def test_decode_many_sequences_threads_match_one_thread(fmt, openmp):
    """Decode at a batch large enough for its appends to be shared among the threads (and its
    attention items to prefetch across sequences): every step stores exactly what one thread
    stores (fp16 tails included) and gives the same output, which matches the reference. Lengths
    cover empty, partial and just-full blocks, so blocks are taken and tails returned mid-batch."""
    rng = np.random.default_rng(11)
    hkv, d, h, n = 3, 64, 9, 48
    ids = list(range(100, 100 + n))
    lens = [(i * 7) % (3 * BS) for i in range(n)]
    stores = [KVStore(2, hkv, d, 16 << 20, block_size=BS, kv_format=fmt, num_threads=t, openmp=openmp)
              for t in (1, 2)]
    k0 = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    v0 = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    for store in stores:
        store.create(ids)
        store.append_span(1, ids, lens, k0, v0)
    for step in range(BS + 2):
        q = rng.standard_normal((n, h, d)).astype(np.float32)
        k = rng.standard_normal((n, hkv, d)).astype(np.float32)
        v = rng.standard_normal((n, hkv, d)).astype(np.float32)
        one, two = (store.decode(1, ids, q, k, v) for store in stores)
        np.testing.assert_array_equal(two, one)
        for sid in ids[::5]:
            for a, b in zip(stores[0].read(sid, 1), stores[1].read(sid, 1)):
                np.testing.assert_array_equal(b, a)
        assert stores[0].stats() == stores[1].stats()
        if step % 6 == 0:
            check_against_reference(stores[1], ids, q, two, layer=1)
    assert [stores[1].length(i, 1) for i in ids] == [x + BS + 2 for x in lens]

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


def test_int4_quantization_error_bound():
    """Each stored value is within half a quantization step (plus fp16 rounding of the params)."""
    rng = np.random.default_rng(3)
    store = make_store(2, 64, "int4")
    store.create([9])
    k = (rng.standard_normal((40, 2, 64)) * np.linspace(0.1, 10, 64)).astype(np.float32)
    v = rng.standard_normal((40, 2, 64)).astype(np.float32) + 5
    store.append_span(0, [9], [40], k, v)
    kc, vc = store.read(9, 0)
    assert store.groups == (32, 64)  # the defaults at head_dim 64: 32 key channels, all 64 value channels
    for x, xc, group in ((k, kc, store.groups[0]), (v, vc, store.groups[1])):
        g = x.reshape(40, 2, 64 // group, group)
        step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / 15
        err = np.abs(xc.reshape(g.shape) - g)
        assert np.all(err <= step * 0.51 + 1e-3 * np.abs(g).max(-1, keepdims=True))


@pytest.mark.parametrize("isa", ISAS)
def test_int4_fp16_tail(isa):
    """The newest, unfinished block of each sequence is read from its fp16 copy; complete blocks
    (and everything of a store without tails) from int4. Tails go back to the area when a block fills."""
    rng = np.random.default_rng(21)
    hkv, d, lens = 2, 64, [1, 15, 16, 17, 40]
    ids = list(range(len(lens)))
    tail = KVStore(1, hkv, d, 16 << 20, kv_format="int4", isa=isa, fp16_tail=True)
    plain = KVStore(1, hkv, d, 16 << 20, kv_format="int4", isa=isa, fp16_tail=False)
    assert plain.stats()["tail_blocks_total"] == 0 and tail.stats()["tail_blocks_total"] > len(ids)
    k = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    v = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    offs = np.cumsum([0] + lens)
    for st in (tail, plain):
        st.create(ids)
        st.append_span(0, ids, lens, k, v)
    assert tail.stats()["tail_blocks_used"] == sum(n % BS != 0 for n in lens)
    assert tail.stats()["blocks_used"] == plain.stats()["blocks_used"]
    for i, n in zip(ids, lens):
        kt, vt = tail.read(i, 0)
        kp, vp = plain.read(i, 0)
        cut = n - n % BS  # tokens before the unfinished block
        np.testing.assert_array_equal(kt[:cut], kp[:cut])
        np.testing.assert_array_equal(vt[:cut], vp[:cut])
        ko, vo = k[offs[i]:offs[i + 1]], v[offs[i]:offs[i + 1]]
        np.testing.assert_array_equal(kt[cut:], ko[cut:].astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(vt[cut:], vo[cut:].astype(np.float16).astype(np.float32))
    q = rng.standard_normal((len(ids), 2 * hkv, d)).astype(np.float32)
    o = tail.attend(0, ids, q)
    check_against_reference(tail, ids, q, o)
    # a sequence shorter than a block is all fp16: its error is fp16's, far below int4's
    err_tail = rel(o[1], reference(q[1], k[offs[1]:offs[2]], v[offs[1]:offs[2]]))
    err_plain = rel(plain.attend(0, ids, q)[1], reference(q[1], k[offs[1]:offs[2]], v[offs[1]:offs[2]]))
    assert err_tail < 1e-3 < err_plain
    # the 16th token completes sequence 1's block: its tail is returned, the block is int4 from now on
    k1 = rng.standard_normal((1, hkv, d)).astype(np.float32)
    for st in (tail, plain):
        st.append(0, [1], k1, k1)
    assert tail.stats()["tail_blocks_used"] == sum(n % BS != 0 for n in lens) - 1
    np.testing.assert_array_equal(tail.read(1, 0)[0], plain.read(1, 0)[0])
    tail.free(ids)
    assert tail.stats()["tail_blocks_used"] == 0
    for st in (tail, plain):
        st.close()


def test_int4_fp16_tail_area_full_falls_back_to_int4():
    rng = np.random.default_rng(22)
    hkv, d = 2, 64
    fp16_block = make_store(hkv, d, "fp16", layers=1).block_bytes
    store = KVStore(1, hkv, d, 8 * 2 * fp16_block, kv_format="int4", fp16_tail=True)  # room for 2 tails
    plain = KVStore(1, hkv, d, 8 * 2 * fp16_block, kv_format="int4", fp16_tail=False)
    assert store.stats()["tail_blocks_total"] == 2
    k = rng.standard_normal((3 * 5, hkv, d)).astype(np.float32)
    for st in (store, plain):
        st.create([1, 2, 3])
        st.append_span(0, [1, 2, 3], [5, 5, 5], k, k)
    assert store.stats()["tail_blocks_used"] == 2
    np.testing.assert_array_equal(store.read(3, 0)[0], plain.read(3, 0)[0])  # the third got none: int4
    assert not np.array_equal(store.read(1, 0)[0], plain.read(1, 0)[0])
    q = rng.standard_normal((3, 4, d)).astype(np.float32)
    check_against_reference(store, [1, 2, 3], q, store.attend(0, [1, 2, 3], q))
    store.free([1])
    assert store.stats()["tail_blocks_used"] == 1
    store.append_span(0, [3], [BS - 5 + 2], np.zeros((BS - 3, hkv, d), np.float32),
                      np.zeros((BS - 3, hkv, d), np.float32))  # sequence 3 starts a block: it gets a tail
    assert store.stats()["tail_blocks_used"] == 2
    check_against_reference(store, [2, 3], q[1:], store.attend(0, [2, 3], q[1:]))


@pytest.mark.parametrize("bad", ["yes", None, 1, 0.0])
def test_fp16_tail_must_be_a_bool(bad):
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, kv_format="int4", fp16_tail=bad)


def test_threads_give_identical_results():
    rng = np.random.default_rng(5)
    store = make_store(4, 64, threads=2)
    ids = list(range(6))
    store.create(ids)
    fill(store, rng, 0, ids, [300, 1, 17, 600, 33, 250])
    q = rng.standard_normal((6, 8, 64)).astype(np.float32)
    o2 = store.attend(0, ids, q)
    store.set_threads(1)
    assert store.num_threads == 1
    np.testing.assert_array_equal(store.attend(0, ids, q), o2)
    check_against_reference(store, ids, q, o2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pool_workers_keep_off_the_callers_cpu():
    """The scheduler may wake a worker on the CPU of the thread that woke it, where it waits for the
    caller's share: the pool bars its workers from the caller's CPU (ThreadPool::keep_off), unless
    the caller may run on one CPU only."""
    allowed = os.sched_getaffinity(0)
    before = set(os.listdir("/proc/self/task"))
    store = make_store(2, 64, threads=len(allowed))
    workers = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
    assert len(workers) == len(allowed) - 1
    rng = np.random.default_rng(31)
    ids = list(range(4))
    store.create(ids)
    fill(store, rng, 0, ids, [600] * 4)  # 4 x 616 x 2 (token, kv head) work: the pool runs
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    check_against_reference(store, ids, q, store.attend(0, ids, q))
    masks = [os.sched_getaffinity(t) for t in workers]
    assert all(m == masks[0] for m in masks) and len(masks[0]) == len(allowed) - 1 and masks[0] < allowed

    one = {min(allowed)}
    fresh = make_store(2, 64, threads=len(allowed))
    fresh_workers = [int(t) for t in set(os.listdir("/proc/self/task")) - before - {str(w) for w in workers}]
    fresh.create(ids)
    fill(fresh, rng, 0, ids, [600] * 4)
    os.sched_setaffinity(0, one)
    try:
        check_against_reference(fresh, ids, q, fresh.attend(0, ids, q))
    finally:
        os.sched_setaffinity(0, allowed)
    assert [os.sched_getaffinity(t) for t in fresh_workers] == [allowed] * len(fresh_workers)
    store.close()
    fresh.close()


# Keeps one CPU busy; ends by itself after 30 s or when the test process is gone.
HOG = """import os, time
os.sched_setaffinity(0, {{{cpu}}})
print("spinning", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end and os.getppid() == {parent}:
    pass
"""


def median_call_s(store, ids, q, n=30):
    times = []
    for _ in range(n):
        time.sleep(0.001)  # the workers go to sleep between calls, as between decode steps
        t0 = time.perf_counter()
        store.attend(0, ids, q)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


@pytest.mark.cpu_hog
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pool_call_does_not_wait_for_a_worker_that_cannot_start():
    """A worker whose CPU is busy elsewhere (the S-Part may share the R-worker's cores) sits out a
    call it has not started by the time the caller's share is done: the call takes about one
    thread's time, where waiting for the worker took some 10 ms (28x) on the 2-core dev VM."""
    allowed = sorted(os.sched_getaffinity(0))
    before = set(os.listdir("/proc/self/task"))
    pooled = make_store(3, 64, layers=1, threads=2)
    (worker,) = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
    alone = make_store(3, 64, layers=1, threads=1)
    rng = np.random.default_rng(37)
    ids = list(range(16))
    for store in (pooled, alone):
        store.create(ids)
        fill(store, np.random.default_rng(5), 0, ids, [1024] * 16)
    q = rng.standard_normal((16, 9, 64)).astype(np.float32)
    hog = None
    os.sched_setaffinity(0, {allowed[0]})
    try:
        pooled.attend(0, ids, q)  # warm-up
        one_thread_s = median_call_s(alone, ids, q)
        os.sched_setaffinity(worker, {allowed[1]})
        os.sched_setscheduler(worker, os.SCHED_IDLE, os.sched_param(0))
        hog = subprocess.Popen([sys.executable, "-c", HOG.format(cpu=allowed[1], parent=os.getpid())],
                               stdout=subprocess.PIPE, text=True)
        assert hog.stdout.readline() == "spinning\n"
        starved_s = median_call_s(pooled, ids, q)
        check_against_reference(pooled, ids, q, pooled.attend(0, ids, q))
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
            hog.stdout.close()
        os.sched_setaffinity(0, set(allowed))
    assert starved_s < 10 * one_thread_s, (starved_s, one_thread_s)   # ~1x; waiting for the worker was 28x
    pooled.close()
    alone.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp16_tail", [False, True])
def test_int4_chunks_of_2_and_4_blocks(isa, fp16_tail):
    """int4 MHA scores 2 blocks per softmax update on several threads and 4 on one (chunk_blocks):
    both against the reference, on sequences whose blocks fill neither evenly, with and without
    the fp16 copy of the newest block. The two differ only by fp32 rounding."""
    rng = np.random.default_rng(24)
    hkv, d, lens = 4, 128, [5 * BS + 3, 7 * BS, 300, 1, BS + 1, 2 * BS - 1, 600]
    ids = list(range(len(lens)))
    store = KVStore(1, hkv, d, 64 << 20, kv_format="int4", isa=isa, fp16_tail=fp16_tail, num_threads=2)
    store.create(ids)
    fill(store, rng, 0, ids, lens)
    q = rng.standard_normal((len(ids), hkv, d)).astype(np.float32)
    o2 = store.attend(0, ids, q)  # (sum(lens) + 16 * 7) * hkv token-heads: enough for both threads
    check_against_reference(store, ids, q, o2)
    store.set_threads(1)
    o1 = store.attend(0, ids, q)
    check_against_reference(store, ids, q, o1)
    assert rel(o1, o2.astype(np.float64)) <= INT4_TOL


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("batch", [1, 4, 9])
def test_head_spans_of_every_shape(isa, fmt, batch):
    """Work items walk a span of kv heads block by block; the span shrinks (unevenly: 5 heads
    as 3 + 2, or 1 each) when a small batch leaves too few items for the threads. Every
    split gives the same bits as one thread (one item per sequence) and matches the reference."""
    rng = np.random.default_rng(batch)
    store = make_store(5, 64, fmt, isa, threads=3, capacity=32 << 20)
    ids = list(range(batch))
    store.create(ids)
    fill(store, rng, 0, ids, [900 // batch + 37 * i for i in range(batch)])   # >= 4096 work: threads used
    q = rng.standard_normal((batch, 10, 64)).astype(np.float32)
    outs = []
    for threads in (3, 2, 1):
        store.set_threads(threads)
        outs.append(store.attend(0, ids, q))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    # the scalar path sums 900 terms one by one: fp32 rounding reaches ~2.4e-5 there
    check_against_reference(store, ids, q, outs[0], int4_tol=5e-5)


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


@pytest.mark.parametrize("isa", ISAS)
def test_int4_interleaved_blocks_read_as_alone(isa):
    """Sequences whose blocks interleave in the pool, reuse freed blocks and fill it to the last block
    read and attend exactly as each one does alone in a store of its own."""
    rng = np.random.default_rng(21)
    hkv, d = 3, 64
    probe = KVStore(1, hkv, d, 1 << 20, kv_format="int4", fp16_tail=False)
    store = KVStore(1, hkv, d, 11 * probe.block_bytes, kv_format="int4", isa=isa, num_threads=1, fp16_tail=False)
    assert store.stats()["blocks_total"] == 11
    data: dict[int, list] = {}

    def grow(sid, n):
        k = rng.standard_normal((n, hkv, d)).astype(np.float32)
        v = rng.standard_normal((n, hkv, d)).astype(np.float32)
        store.append_span(0, [sid], [n], k, v)
        data.setdefault(sid, []).append((k, v))

    store.create([5, 6, 7])
    for sid, n in [(5, 7), (6, 20), (7, 16), (5, 30), (6, 13), (7, 33), (5, 9), (6, 3)]:
        grow(sid, n)  # blocks: 5 -> 3, 6 -> 3, 7 -> 4, handed out in turn
    store.free([6])
    store.create([8])
    grow(8, 56)  # 4 blocks: the 3 of sequence 6 and the last of the pool
    assert store.stats()["blocks_used"] == 11
    ids = [5, 7, 8]
    q = rng.standard_normal((3, 6, d)).astype(np.float32)
    out = store.attend(0, ids, q)
    for i, sid in enumerate(ids):
        k = np.concatenate([a for a, _ in data[sid]])
        v = np.concatenate([b for _, b in data[sid]])
        alone = KVStore(1, hkv, d, 8 << 20, kv_format="int4", isa=isa, num_threads=1, fp16_tail=False)
        alone.create([0])
        alone.append_span(0, [0], [len(k)], k, v)
        for got, want in zip(store.read(sid, 0), alone.read(0, 0)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(out[i], alone.attend(0, [0], q[i:i + 1])[0])


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


def test_garbage_input_is_rejected_and_harmless():
    rng = np.random.default_rng(10)
    store = make_store(2, 64, layers=2)
    store.create([1, 2])
    fill(store, rng, 0, [1, 2], [20, 5])
    snapshot = [store.read(i, 0) for i in (1, 2)]
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    good = store.attend(0, [1, 2], q)
    kv = rng.standard_normal((2, 2, 64)).astype(np.float32)

    def nan_at(a, idx, val=np.nan):
        a = a.copy()
        a[idx] = val
        return a

    bad_calls = [
        (KeyError, lambda: store.attend(0, [1, 77], q)),
        (KeyError, lambda: store.decode(0, [77, 1], q, kv, kv)),
        (KeyError, lambda: store.length(77)),
        (KeyError, lambda: store.read(77, 0)),
        (ValueError, lambda: store.create([2])),
        (ValueError, lambda: store.create([5, 5])),
        (ValueError, lambda: store.attend(0, [1, 1], q)),
        (ValueError, lambda: store.decode(0, [1, 1], q, kv, kv)),
        (ValueError, lambda: store.attend(0, [1, 2], q[:, :3])),        # q heads not a multiple of Hkv
        (ValueError, lambda: store.attend(0, [1, 2], q[:, :, :32])),    # head_dim
        (ValueError, lambda: store.attend(0, [1], q)),                  # batch mismatch
        (ValueError, lambda: store.attend(0, [1, 2], q[0])),            # rank
        (ValueError, lambda: store.decode(0, [1, 2], q, kv[:, :1], kv[:, :1])),  # k heads != Hkv
        (ValueError, lambda: store.decode(0, [1, 2], q, kv, kv[:, :, :63])),
        (ValueError, lambda: store.attend(0, [1, 2], q.astype(np.float64))),
        (ValueError, lambda: store.attend(0, [1, 2], q.astype(np.int32))),
        (ValueError, lambda: store.append(0, [1, 2], kv.astype(np.int8), kv)),
        (ValueError, lambda: store.attend(0, [1, 2], nan_at(q, (1, 2, 3)))),
        (ValueError, lambda: store.attend(0, [1, 2], nan_at(q, (0, 0, 0), np.inf))),
        (ValueError, lambda: store.decode(0, [1, 2], q, nan_at(kv, (1, 1, 1)), kv)),
        (ValueError, lambda: store.decode(0, [1, 2], q, kv, nan_at(kv, (0, 1, 5), -np.inf))),
        (ValueError, lambda: store.append(0, [1, 2], kv, nan_at(kv, (0, 0, 0), 1e6))),  # beyond fp16
        (ValueError, lambda: store.append(0, [1, 2], nan_at(kv, (0, 0, 0)).astype(np.float16), kv)),
        (ValueError, lambda: store.attend(2, [1, 2], q)),
        (ValueError, lambda: store.attend(-1, [1, 2], q)),
        (ValueError, lambda: store.append(5, [1, 2], kv, kv)),
        (ValueError, lambda: store.length(1, 9)),
        (ValueError, lambda: store.attend(1, [1], q[:1])),              # empty cache at layer 1
        (ValueError, lambda: store.append_span(0, [1, 2], [1], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [3, -1], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [1, 2], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [1, 1], kv, nan_at(kv, (1, 0, 0)))),
        (ValueError, lambda: store.attend(0, [[1, 2]], q)),
        (ValueError, lambda: store.attend(0, [1.5, 2], q)),
        (ValueError, lambda: store.attend(0, [1, 2], q, scale=-1.0)),
        (ValueError, lambda: store.attend(0, [1, 2], "not an array")),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
        for i, (kb, vb) in zip((1, 2), snapshot):
            kc, vc = store.read(i, 0)
            assert kc.shape == kb.shape and np.array_equal(kc, kb) and np.array_equal(vc, vb)
    np.testing.assert_array_equal(store.attend(0, [1, 2], q), good)
    assert store.stats()["sequences"] == 2 and store.length(1, 1) == 0


@pytest.mark.parametrize("ids", [
    [np.uint64(2**63)], np.array([2**63], dtype=np.uint64), [2**63], [2**64 + 1], [-(2**63) - 1],
    torch.tensor([2**63], dtype=torch.uint64), [True], [1, True], np.array([True]), [np.True_],
    [1.0], [1.5], np.array([1.0]), ["1"], "12", [None], [[1]], 5,
], ids=repr)
def test_garbage_ids_are_refused_not_wrapped(ids):
    """A uint64 id >= 2**63 used to wrap to a negative int64 (another sequence's id); bools,
    floats and strings must not pass as integers either."""
    store = make_store(2, 64, layers=1)
    wrapped = -(2**63)                       # what np.uint64(2**63) wraps to
    store.create([wrapped, 1])
    kv = np.zeros((1, 2, 64), np.float32)
    for call in (lambda: store.create(ids), lambda: store.free(ids),
                 lambda: store.append(0, ids, kv, kv), lambda: store.attend(0, ids, np.zeros((1, 4, 64), np.float32))):
        with pytest.raises(ValueError, match="seq_ids"):
            call()
    assert store.has(wrapped) and store.has(1) and store.stats()["sequences"] == 2 and store.length(wrapped) == 0
    with pytest.raises(ValueError, match="lens"):
        store.append_span(0, [1], [True], kv, kv)


@pytest.mark.parametrize("lens", [[1 << 62] * 3 + [(1 << 62) + 1], [(1 << 63) - 1] * 2 + [3], [1 << 31, 0, 0, 0]],
                         ids=["sum wraps to 1", "sum wraps to 1 again", "one span too long"])
def test_lengths_whose_sum_wraps_are_refused(lens):
    """int64 lengths whose sum wraps around to the rows sent passed the size and capacity checks and
    overran the pool (a segfault in the R-worker); the checks now add with overflow detection."""
    store = make_store(2, 64, layers=1)
    store.create([1, 2, 3, 4])
    kv = np.zeros((1, 2, 64), np.float32)
    before = store.stats()
    with pytest.raises(ValueError, match="lens"):
        store.append_span(0, [1, 2, 3, 4], lens, kv, kv)
    assert store.stats() == before
    store.append_span(0, [1, 2, 3, 4], [1, 0, 0, 0], kv, kv)        # the store still works
    assert store.length(1) == 1


@pytest.mark.parametrize("bad", [2**63, True, 1.0, "1", None])
def test_garbage_scalar_id_or_layer_refused(bad):
    store = make_store(2, 64, layers=2)
    store.create([1])
    for call in (lambda: store.has(bad), lambda: store.length(bad), lambda: store.read(bad, 0),
                 lambda: store.length(1, bad), lambda: store.attend(bad, [1], np.zeros((1, 4, 64), np.float32))):
        with pytest.raises(ValueError):
            call()
    assert store.has(np.int64(1)) and store.length(1, np.int32(1)) == 0 and store.has(-(2**63)) is False


def test_int64_edge_ids_are_kept_apart():
    store = make_store(2, 64, layers=1)
    edges = [(1 << 63) - 1, -(1 << 63), 0]
    store.create(np.array(edges, dtype=np.int64))
    store.append_span(0, edges, [1, 2, 3], np.ones((6, 2, 64), np.float32), np.ones((6, 2, 64), np.float32))
    assert [store.length(i) for i in edges] == [1, 2, 3]
    store.free(np.array([(1 << 63) - 1], dtype=np.uint64))   # uint64 within int64's range is fine
    assert not store.has((1 << 63) - 1) and store.has(-(1 << 63))


def test_bad_construction():
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, isa="sse9")
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, kv_format="int8")
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 100)  # less than one block
    with pytest.raises(ValueError):
        KVStore(0, 2, 64, 1 << 20)
    with pytest.raises(ValueError):
        KVStore(1, 2, 24, 1 << 20, kv_format="int4")  # int4 groups need head_dim % 16 == 0
    for isa in ("avx2", "avx512", "avx512vnni"):
        with pytest.raises(ValueError):
            KVStore(1, 2, 24, 1 << 20, isa=isa)  # vector paths need head_dim % 16 == 0
    odd = KVStore(1, 2, 24, 1 << 20, num_threads=1)  # odd head_dim: scalar path, still correct
    assert odd.isa == "scalar"
    rng = np.random.default_rng(11)
    odd.create([0])
    fill(odd, rng, 0, [0], [21])
    q = rng.standard_normal((1, 6, 24)).astype(np.float32)
    check_against_reference(odd, [0], q, odd.attend(0, [0], q))
    odd.close()
    with pytest.raises(ValueError):
        odd.attend(0, [0], q)


@pytest.mark.skipif(cpu_supports("avx512"), reason="only meaningful on a CPU without AVX-512")
def test_unsupported_isa_raises():
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, isa="avx512")


def test_concurrent_calls_are_safe():
    """attend in one thread while another appends to and frees other sequences."""
    rng = np.random.default_rng(12)
    store = make_store(2, 64)
    store.create([1])
    originals = fill(store, rng, 0, [1], [500])
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    want = store.attend(0, [1], q)
    errors = []

    def churn():
        try:
            r = np.random.default_rng(13)
            for i in range(50):
                store.create([100 + i])
                fill(store, r, 0, [100 + i], [int(r.integers(1, 40))])
                store.free([100 + i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    for _ in range(50):
        np.testing.assert_array_equal(store.attend(0, [1], q), want)
    t.join()
    assert not errors
    check_against_reference(store, [1], q, want, originals)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_int4_values_peaked_and_faded(isa, group):
    """The integer P V puts each chunk's coefficients p_t * scale_t in fixed point against the
    chunk's largest (24 bits). Weights over many orders of magnitude: one token holding nearly all
    of them, chunks after the running max whose weights all faded, value scales from 0.01 to 100.
    (At 16 bits, test_matches_reference fails on the integer path; this one does not: a chunk's
    error is bounded by its own largest weight.)"""
    rng = np.random.default_rng(40 + group)
    hkv, d, n = 2, 128, 10 * BS + 3
    store = make_store(hkv, d, "int4", isa, layers=1)
    ids = [1, 2]
    store.create(ids)
    k = rng.standard_normal((2 * n, hkv, d)).astype(np.float32)
    v = (rng.standard_normal((2 * n, hkv, d)) * np.linspace(0.01, 100, d)).astype(np.float32)
    q = np.repeat(k[[5, n + 2]], group, axis=1) * 3  # sequence 1: token 5 dominates; 2: the first block
    k[n: n + BS] += k[n + 2] * 0.5  # sequence 2: its first block scores high, the later ones fade
    store.append_span(0, ids, [n, n], k, v)
    o = store.attend(0, ids, q)
    check_against_reference(store, ids, q, o)


@pytest.mark.parametrize("isa", ["scalar", pytest.param("avx2", marks=pytest.mark.skipif(
    not cpu_supports("avx2"), reason="CPU lacks avx2"))])
@pytest.mark.parametrize("d", [16, 48, 80])
def test_int4_head_dim_padded_to_32(isa, d):
    """int4 value nibbles are stored in lines of 32 channels; head_dim 16 mod 32 pads the last line."""
    rng = np.random.default_rng(d)
    store = KVStore(1, 2, d, 8 << 20, kv_format="int4", isa=isa, k_group=16, v_group=16)
    ids = [3, 4]
    store.create(ids)
    originals = fill(store, rng, 0, ids, [BS + 5, 3 * BS], scale=2.0)
    for (k, v), i in zip(originals, ids):
        _, vc = store.read(i, 0)
        g = v.reshape(len(v), 2, d // 16, 16)
        step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / 15
        assert np.all(np.abs(vc.reshape(g.shape) - g) <= step * 0.51 + 1e-3 * np.abs(g).max(-1, keepdims=True))
    q = rng.standard_normal((2, 4, d)).astype(np.float32)
    check_against_reference(store, ids, q, store.attend(0, ids, q), originals)


# ---- no silent fallback: without the kernel, tests fail

def without_kernel(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which rpart._kernels does not import."""
    from fastdecode.config import REPO_ROOT

    return subprocess.run([sys.executable, "-c", "import sys\nsys.modules['rpart._kernels'] = None\n" + code],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_test_rworkers_without_the_kernel_are_an_error():
    broken = without_kernel("from fastdecode.ops.testing import store_kind\nstore_kind()")
    assert broken.returncode != 0 and "ImportError" in broken.stderr and "make build" in broken.stderr, broken.stderr
    asked = without_kernel("from fastdecode.ops.testing import store_kind\nprint(store_kind('numpy'))")
    assert asked.returncode == 0 and asked.stdout.strip() == "numpy", asked.stderr


def test_the_suite_fails_without_the_kernel():
    run = without_kernel("import pytest\n"
                         "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_local_attention.py']))")
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "rpart._kernels" in run.stdout + run.stderr and "skipped" not in run.stdout, run.stdout
