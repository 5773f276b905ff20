"""The C++ KV store's int4 format: quantization error, the fp16 copy of the newest block
(fp16_tail), chunked scoring, interleaved blocks, extreme weights and padded head_dim.
The reference, tolerances and helpers are test_kernel.py's."""
from __future__ import annotations

import numpy as np
import pytest

from rpart.kernels import KVStore, cpu_supports

from test_kernel import BS, ISAS, INT4_TOL, reference, rel, make_store, fill, check_against_reference


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
