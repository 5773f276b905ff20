"""The KV pool committed ahead of use (csrc/page_populator.cpp): all of it, in the background,
without touching what the store has written meanwhile."""
import os
import time

import numpy as np
import pytest

from rpart.kernels import KVStore

SUPPORTED = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) >= (5, 14)
HKV, D, BS = 2, 64, 16


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def populated(store: KVStore, want: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := store.stats()["populated_bytes"]) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.mark.skipif(not SUPPORTED, reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_the_whole_pool_is_committed_and_its_pages_are_resident():
    store = KVStore(2, HKV, D, 96 << 20)
    st = store.stats()
    pool = st["blocks_total"] * (BS * HKV * D * 2 * 2)
    assert populated(store, pool) >= pool
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    assert rss_kb * 1024 >= pool      # resident, not only promised
    store.close()


def test_without_populate_nothing_is_committed():
    store = KVStore(2, HKV, D, 96 << 20, populate=False)
    time.sleep(0.2)
    assert store.stats()["populated_bytes"] == 0
    store.close()


def test_data_written_while_the_pool_is_populated_is_kept():
    """Appends and attention race the populating thread over the same pages: every result equals
    a store that populates nothing (a populator that wrote to the pages would change them)."""
    rng = np.random.default_rng(0)
    stores = [KVStore(2, HKV, D, 256 << 20, populate=p) for p in (True, False)]
    ids = np.arange(64, dtype=np.int64)
    for s in stores:
        s.create(ids)
    for step in range(40):
        k = rng.standard_normal((len(ids), HKV, D), dtype=np.float32)
        v = rng.standard_normal((len(ids), HKV, D), dtype=np.float32)
        q = rng.standard_normal((len(ids), 2 * HKV, D), dtype=np.float32)
        for layer in range(2):
            a, b = (s.decode(layer, ids, q, k, v) for s in stores)
            np.testing.assert_array_equal(a, b)
    for s in stores:
        s.close()


def test_close_while_populating_returns_promptly():
    t = time.monotonic()
    store = KVStore(1, HKV, D, 4 << 30)       # 4 GiB: far more than is populated before close()
    store.close()
    assert time.monotonic() - t < 5.0
    assert store.stats()["blocks_total"] == store.stats()["populated_bytes"] == 0


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_populate_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="populate"):
        KVStore(1, HKV, D, 1 << 20, populate=bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1", True])
def test_wait_populated_refuses_a_bad_timeout(bad):
    store = KVStore(1, HKV, D, 1 << 20)
    with pytest.raises(ValueError, match="timeout_s"):
        store.wait_populated(bad)
    assert store.wait_populated(60.0)
    store.close()


def test_wait_populated_waits_for_the_whole_pool_and_times_out_meanwhile():
    store = KVStore(1, HKV, D, 1 << 30)
    assert store.wait_populated(600.0)
    if SUPPORTED:
        assert store.stats()["populated_bytes"] >= store.stats()["blocks_total"] * BS * HKV * D * 4
    store.close()
    assert KVStore(1, HKV, D, 1 << 20, populate=False).wait_populated(0.0)   # nothing to wait for
    if SUPPORTED and mem_available() > 8 << 30:
        big = KVStore(1, HKV, D, 4 << 30)
        assert not big.wait_populated(0.0)      # 4 GiB are not committed in no time
        big.close()


def test_engine_setting_reaches_the_store():
    from fastdecode.config import EngineConfig
    from fastdecode.attention.base import KVSpec
    from fastdecode.attention.local import LocalAttention

    spec = KVSpec(2, 4, HKV, D)
    on = LocalAttention(spec, EngineConfig(kv_capacity_bytes=64 << 20))
    off = LocalAttention(spec, EngineConfig(kv_capacity_bytes=64 << 20, kv_populate=False))
    try:
        if SUPPORTED:
            assert populated(on.store, 1) > 0
        assert off.store.stats()["populated_bytes"] == 0
    finally:
        on.shutdown()
        off.shutdown()
    for bad in ("true", 1):
        with pytest.raises(ValueError, match="kv_populate"):
            EngineConfig(kv_populate=bad)


@pytest.mark.slow
@pytest.mark.skipif(not SUPPORTED, reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_pool_larger_than_the_memory_is_populated_only_up_to_a_reserve():
    """Populating a pool larger than the machine's memory would end in the OOM killer: it stops 1 GiB
    short of what is available, and the rest is taken on first use."""
    avail = mem_available()
    store = KVStore(1, HKV, D, avail + (2 << 30))
    assert store.wait_populated(600.0)
    last = store.stats()["populated_bytes"]
    assert 0 < last <= avail          # MemAvailable is an estimate: what is left is checked after
    assert mem_available() >= 512 << 20
    store.close()
