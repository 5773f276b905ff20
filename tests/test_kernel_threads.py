"""The C++ KV store's thread pool: several threads give the same bits as one, workers keep off
the caller's CPU and do not hold up a call, and calls from several Python threads are safe.
The reference and helpers are test_kernel.py's."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rpart.kernels import KVStore

from test_kernel import BS, ISAS, make_store, fill, check_against_reference


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
    stores = [KVStore(2, hkv, d, 16 << 20, block_size=BS, kv_format=fmt, num_threads=t, openmp=openmp,
                      populate=False)
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


def test_decode_writes_never_land_in_blocks_freed_meanwhile():
    """decode takes each new token's place under the store's lock and its attention threads write
    the token just before they read that sequence. A sequence freed by another thread in between
    must not hand its blocks to a new sequence before those writes are done: the sequences freed
    come last in the call (their writes come last), another thread frees them halfway through it
    and fills new sequences at once (they take the freed blocks first); afterwards the new
    sequences and the ones decoded hold exactly what was written to them, and every block comes
    back."""
    rng = np.random.default_rng(21)
    hkv, d, h = 3, 64, 9
    store = KVStore(1, hkv, d, 256 << 20, block_size=BS, kv_format="fp16", num_threads=2, populate=False)
    kept = list(range(256))
    shadow = {}

    def rows(r, n):
        return r.standard_normal((n, hkv, d)).astype(np.float16).astype(np.float32)

    def put(ids, lens, r=rng):
        store.create(ids)
        k, v = rows(r, sum(lens)), rows(r, sum(lens))
        store.append_span(0, ids, lens, k, v)
        at = 0
        for i, n in zip(ids, lens):
            shadow[i] = [k[at:at + n], v[at:at + n]]
            at += n

    put(kept, [int(x) for x in rng.integers(200, 400, len(kept))])
    q = rng.standard_normal((len(kept), h, d)).astype(np.float32)
    t0 = time.perf_counter()
    store.attend(0, kept, q)
    call_s = time.perf_counter() - t0
    errors, refilled, decoded = [], [], 0
    for rnd in range(10):
        victims = list(range(1000 + 100 * rnd, 1016 + 100 * rnd))
        put(victims, [BS - 1] * len(victims))   # the token decoded ends a block: slot BS - 1
        live = kept + victims
        go = threading.Event()

        def churn(victims=victims, rnd=rnd):
            try:
                go.wait(5)
                time.sleep(call_s / 2)
                r = np.random.default_rng(rnd)
                for j, victim in enumerate(victims):
                    store.free([victim])
                    shadow.pop(victim)
                    new = 50_000 + 100 * rnd + j
                    put([new], [BS], r)          # the victim's block, every slot written
                    refilled.append(new)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=churn)
        q = rng.standard_normal((len(live), h, d)).astype(np.float32)
        k, v = rows(rng, len(live)), rows(rng, len(live))
        t.start()
        go.set()
        try:
            store.decode(0, live, q, k, v)
            decoded += 1
            for i, sid in enumerate(kept):
                shadow[sid] = [np.concatenate([shadow[sid][0], k[i:i + 1]]),
                               np.concatenate([shadow[sid][1], v[i:i + 1]])]
        except KeyError:          # the victims went before the call: nothing was appended
            pass
        t.join()
        assert not errors
    assert refilled and decoded
    for sid in kept + refilled:
        got_k, got_v = store.read(sid, 0)
        np.testing.assert_array_equal(got_k, shadow[sid][0].reshape(got_k.shape))
        np.testing.assert_array_equal(got_v, shadow[sid][1].reshape(got_v.shape))
    store.free(kept + refilled)
    assert store.stats()["blocks_used"] == 0
