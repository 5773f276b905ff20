"""Fuzzing the C++ KV store directly (issue #17), over store shapes and call sequences.

Hypothesis draws a store (layers, kv heads, any head_dim for fp16 and multiples of 16 for int4, any
block size, every kernel path this CPU has, fp16 tails, int4 groups, threads, a pool of a few blocks to
a few MiB) and a sequence of creates, spans, decodes, attends and frees, some of them faulty. A client-
side model predicts each call's outcome: the error class (unknown or repeated ids, wrong shapes,
pool exhausted) or success; after success the cache read back must be what was appended (fp16: exact;
int4: within one quantization step of its group), attention must match the float64 reference over the
cache as stored, and the block count must match the model's. Under `make test-asan` this is the
sanitizers' main diet: odd shapes walk the layout's edges.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.attention.base import KVCapacityError
from rpart.kernels import KVStore, cpu_supports, reference_attention

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PATHS = ["auto"] + [isa for isa in ("scalar", "avx2", "avx512", "avx512vnni") if cpu_supports(isa)]


@st.composite
def store_shapes(draw):
    fmt = draw(st.sampled_from(["fp16", "int4"]))
    if fmt == "fp16":
        head_dim = draw(st.sampled_from([1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 48, 64, 80, 128, 130, 256]))
        groups = (0, 0)
    else:
        head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 96, 128, 144, 256]))
        valid = [0] + [g for g in (16, 32, 64, 128) if head_dim % g == 0]
        groups = (draw(st.sampled_from(valid)), draw(st.sampled_from(valid)))
    return dict(num_layers=draw(st.integers(1, 3)), num_kv_heads=draw(st.sampled_from([1, 2, 3, 5])),
                head_dim=head_dim, kv_format=fmt,
                block_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 64])),
                isa=draw(st.sampled_from(PATHS)), fp16_tail=draw(st.booleans()),
                k_group=groups[0], v_group=groups[1], num_threads=draw(st.integers(1, 3)),
                capacity_bytes=draw(st.sampled_from([1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 4 << 20])))


class Model:
    """What the store should hold: per sequence, per layer, the float32 rows appended (as sent)."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.rows: dict[int, list[list[np.ndarray]]] = {}

    def blocks(self) -> int:
        bs = self.store.block_size
        return sum(-(-len(layer) // bs) for layers in self.rows.values() for layer in layers)

    def blocks_needed(self, layer: int, ids, lens) -> int:
        bs = self.store.block_size
        return sum(-(-(len(self.rows[s][layer]) + n) // bs) - -(-len(self.rows[s][layer]) // bs)
                   for s, n in zip(ids, lens))

    def check_cache(self) -> None:
        st_ = self.store.stats()
        assert st_["sequences"] == len(self.rows)
        assert st_["blocks_used"] == self.blocks(), (st_, self.blocks())
        for s, layers in self.rows.items():
            for layer, rows in enumerate(layers):
                k, v = self.store.read(s, layer)
                if not rows:
                    assert k.shape[0] == v.shape[0] == 0
                    continue
                want = np.array(rows)                            # [T, 2 (k, v), Hkv, D]
                for got, sent in ((k, want[:, 0]), (v, want[:, 1])):
                    if self.store.kv_format == "fp16":
                        np.testing.assert_array_equal(got, sent.astype(np.float16).astype(np.float32))
                    else:
                        self.check_int4(got, sent, "k" if got is k else "v")

    def check_int4(self, got: np.ndarray, sent: np.ndarray, which: str) -> None:
        """Each value within one quantization step (range / 15 of its group) of what was sent."""
        group = self.store.groups[0 if which == "k" else 1]
        t, h, d = sent.shape
        g = sent.reshape(t, h, d // group, group)
        step = (g.max(-1) - g.min(-1)) / 15
        err = np.abs(got - sent).reshape(t, h, d // group, group).max(-1)
        assert (err <= step * 1.01 + 2e-3 * np.abs(g).max(-1) + 1e-6).all(), (which, err.max(), step.min())


def attend_reference(store: KVStore, layer: int, ids, q: np.ndarray) -> np.ndarray:
    """Over the cache as stored (int4: dequantized)."""
    out = [reference_attention(q[i], *store.read(s, layer)) for i, s in enumerate(ids)]
    return np.stack(out) if out else np.zeros((0, *q.shape[1:]))


@FUZZ
@given(shape=store_shapes(), data=st.data())
def test_random_shapes_and_call_sequences(shape, data):
    try:
        store = KVStore(**shape)
    except ValueError as e:   # refusals the kernel documents: a pool under one block, or no such path here
        assert "less than one block" in str(e) or "isa not supported" in str(e), (shape, e)
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    model = Model(store)
    hkv, d, layers = store.num_kv_heads, store.head_dim, store.num_layers
    try:
        for _ in range(data.draw(st.integers(1, 12))):
            op = data.draw(st.sampled_from(["create", "span", "span", "decode", "decode", "attend", "free"]))
            held = sorted(model.rows)
            some = st.lists(st.sampled_from(held), unique=True, min_size=1, max_size=4) if held else st.just([])
            ids = data.draw(st.one_of(some, some, some, some.map(lambda x: x + x[:1]),     # a repeated id
                                      some.map(lambda x: x + [10_000])))                  # an unknown one
            layer = data.draw(st.integers(0, layers - 1))
            fault = (KeyError if 10_000 in ids else ValueError if len(set(ids)) != len(ids) else None)
            if op == "create":
                new = data.draw(st.lists(st.integers(0, 40) | st.sampled_from([-(1 << 63), (1 << 63) - 1]),
                                         unique=True, max_size=4))
                if set(new) & set(model.rows):
                    with pytest.raises(ValueError, match="already exists"):
                        store.create(new)
                else:
                    store.create(new)
                    for s in new:
                        model.rows[s] = [[] for _ in range(layers)]
            elif op == "free":
                store.free(ids)            # unknown and repeated ids are ignored
                for s in ids:
                    model.rows.pop(s, None)
            elif op == "span":
                lens = data.draw(st.lists(st.integers(0, 40), min_size=len(ids), max_size=len(ids)))
                k_dtype = data.draw(st.sampled_from([np.float32, np.float16]))
                k = rng.standard_normal((sum(lens), hkv, d)).astype(k_dtype)
                v = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32) * 3
                free = store.stats()["blocks_total"] - model.blocks()
                if fault is None and model.blocks_needed(layer, ids, lens) > free:
                    fault = KVCapacityError
                if fault is not None:
                    with pytest.raises(fault):
                        store.append_span(layer, ids, lens, k, v)
                else:
                    store.append_span(layer, ids, lens, k, v)
                    at = 0
                    for s, n in zip(ids, lens):
                        model.rows[s][layer].extend(np.stack([k[at:at + n], v[at:at + n]], axis=1).astype(np.float32))
                        at += n
            else:
                group = data.draw(st.sampled_from([1, 2, 3, 8]))
                q = rng.standard_normal((len(ids), hkv * group, d)).astype(np.float32)
                empty = any(s in model.rows and not model.rows[s][layer] for s in ids)
                if op == "attend":
                    if fault is None and empty:
                        fault = ValueError                          # nothing cached at this layer
                    if fault is not None:
                        with pytest.raises(fault):
                            store.attend(layer, ids, q)
                    else:
                        np.testing.assert_allclose(store.attend(layer, ids, q), attend_reference(store, layer, ids, q),
                                                   rtol=2e-4, atol=2e-4)
                else:
                    kv = rng.standard_normal((2, len(ids), hkv, d)).astype(np.float32)
                    if fault is None and model.blocks_needed(layer, ids, [1] * len(ids)) > \
                            store.stats()["blocks_total"] - model.blocks():
                        fault = KVCapacityError
                    if fault is not None:
                        with pytest.raises(fault):
                            store.decode(layer, ids, q, kv[0], kv[1])
                    else:
                        o = store.decode(layer, ids, q, kv[0], kv[1])
                        for i, s in enumerate(ids):
                            model.rows[s][layer].append(np.stack([kv[0][i], kv[1][i]]))
                        np.testing.assert_allclose(o, attend_reference(store, layer, ids, q), rtol=2e-4, atol=2e-4)
            model.check_cache()
    finally:
        store.close()


@FUZZ
@given(layers=st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([0, 1, 4096, 4097]),
       heads=st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([0, 1, 4096, 4097]),
       head_dim=st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([0, 1, 16, 48, 4096, 4097]),
       block_size=st.integers(-(1 << 31), (1 << 31) - 1) | st.sampled_from([0, 1, 16, 4096, 4097]),
       # up to a few GiB: the pool is reserved, not touched, but its free list is built (4 bytes a block)
       capacity=st.sampled_from([-(1 << 63), -1, 0, 1, 100, 1 << 20, 1 << 31, 3 << 30])
       | st.integers(-(1 << 63), 1 << 24),
       fmt=st.sampled_from(["fp16", "int4"]))
def test_construction_over_int32_is_a_store_or_a_value_error(layers, heads, head_dim, block_size, capacity, fmt):
    """A store whose blocks fit its capacity, or ValueError / KVCapacityError saying why; never a
    crash. block_bytes of a layout beyond 2 GiB must not wrap."""
    try:
        store = KVStore(layers, heads, head_dim, capacity, block_size=block_size, kv_format=fmt, num_threads=1)
    except (ValueError, KVCapacityError) as e:
        assert str(e)
        return
    except TypeError as e:    # pybind11: an argument beyond the C++ int's range
        assert "incompatible function arguments" in str(e)
        assert not all(-(1 << 31) <= x < 1 << 31 for x in (layers, heads, head_dim, block_size))
        return
    try:
        s = store.stats()
        # the store caps heads, head_dim and block size; layers only the R-worker's Configure caps
        assert layers >= 1 and 1 <= heads <= 4096 and 1 <= head_dim <= 4096 and 1 <= block_size <= 4096
        assert store.block_bytes > 0 and s["blocks_total"] >= 1
        assert s["blocks_total"] * store.block_bytes <= capacity
    finally:
        store.close()


def test_block_bytes_of_a_layout_beyond_2_gib_does_not_wrap():
    """One block of 4096 kv heads x 48 channels x 4096 tokens is 3 GiB (fp16: K and V, 2 bytes each);
    block_bytes came back through a C++ int, negative."""
    store = KVStore(1, 4096, 48, 3 << 30, block_size=4096, num_threads=1)
    try:
        assert store.block_bytes == 4096 * 48 * 4096 * 2 * 2
        assert store.stats()["blocks_total"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("kv_format", ["fp16", "int4"])
def test_a_block_size_beyond_the_limit_is_refused_before_any_layout_arithmetic(kv_format):
    """Found by the construction fuzzing under UBSan (make test-asan): with isa="auto" the binding laid
    out a block of 2**31 - 1 tokens to choose the kernel path, overflowing int (block_size + 15), before
    the store refused it."""
    with pytest.raises(ValueError, match="<= 4096"):
        KVStore(1, 2, 64, 1 << 20, block_size=(1 << 31) - 1, kv_format=kv_format, num_threads=1)
