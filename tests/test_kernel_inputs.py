"""What the KV store reads: float32, float16 and bfloat16 (torch; numpy has no bfloat16, so the
extension takes its bits as uint16), and views whose rows lie apart in a wider buffer (q, k and v
of one projection), read in place. Each gives exactly what the same values contiguous in float32
give; bad values and bad layouts are refused with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_kernel import ISAS, check_against_reference, fill, make_store

H, HKV, D = 6, 2, 64


def projection(n, seed=0, dtype=torch.bfloat16):
    """q, k, v as views of one [n, H + 2 HKV, D] buffer, as the S-Part's qkv projection gives them."""
    qkv = torch.randn(n, H + 2 * HKV, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return qkv, (qkv[:, :H], qkv[:, H:H + HKV], qkv[:, H + HKV:])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_views_and_bfloat16_give_what_contiguous_float32_gives(isa, fmt, dtype):
    ids = [3, 4, 5, 6, 7]
    stores = [make_store(HKV, D, fmt=fmt, isa=isa, threads=2) for _ in range(2)]
    for st in stores:
        st.create(ids + [9])
        fill(st, np.random.default_rng(2), 0, ids, [1, 15, 16, 17, 40])
    prompt, (_, pk, pv) = projection(7, seed=9, dtype=dtype)
    for st, (k, v) in zip(stores, [(pk, pv), (pk.float().contiguous(), pv.float().contiguous())]):
        st.append_span(1, [9], [7], k, v)                   # prefill from views too
    for step in range(20):                                    # through a block boundary
        _, (q, k, v) = projection(len(ids), seed=step, dtype=dtype)
        assert not q.is_contiguous() and not k.is_contiguous()
        got = stores[0].decode(0, ids, q, k, v)
        want = stores[1].decode(0, ids, q.float().contiguous(), k.float().contiguous(), v.float().contiguous())
        np.testing.assert_array_equal(got, want)
    for sid in ids:
        for a, b in zip(stores[0].read(sid, 0), stores[1].read(sid, 0)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(stores[0].read(9, 1), stores[1].read(9, 1)):
        np.testing.assert_array_equal(a, b)
    q = projection(len(ids), seed=99, dtype=dtype)[1][0]
    check_against_reference(stores[0], ids, q.float().numpy(), stores[0].attend(0, ids, q))


def test_bad_bfloat16_values_are_refused_and_change_nothing():
    st = make_store(HKV, D)
    st.create([1, 2])
    fill(st, np.random.default_rng(0), 0, [1, 2], [5, 5])
    _, (q, k, v) = projection(2)
    for bad_q, bad_k, what in ((q * float("nan"), k, "q"), (q * float("inf"), k, "q"),
                               (q, k * float("nan"), "k"), (q, k * 1e5, "k"),        # beyond fp16's range
                               (q, k.clone().fill_(65536.0), "k")):
        with pytest.raises(ValueError, match=what):
            st.decode(0, [1, 2], bad_q, bad_k, v)
    assert [st.length(i, 0) for i in (1, 2)] == [5, 5]
    st.decode(0, [1, 2], q, k.clone().fill_(65280.0), v)    # the largest bfloat16 below 65520: stored
    np.testing.assert_array_equal(st.read(1, 0)[0][-1], np.full((HKV, D), 65280.0, np.float32))


def test_layouts_the_extension_refuses():
    """The extension itself (rpart.kernels copies what it cannot read in place)."""
    st = make_store(HKV, D)
    st.create([1, 2])
    fill(st, np.random.default_rng(0), 0, [1, 2], [5, 5])
    raw = st._s
    ids = np.array([1, 2], dtype=np.int64)
    q = np.zeros((2, H, D), np.float32)
    k = np.zeros((2, HKV, D), np.float32)
    overlapping = np.broadcast_to(k[:1], (2, HKV, D))           # both rows at one address
    with pytest.raises(ValueError, match="overlap"):
        raw.decode(0, ids, q, overlapping, k, None)
    transposed = np.zeros((2, D, HKV), np.float32).transpose(0, 2, 1)
    with pytest.raises(ValueError, match="C-contiguous within each row"):
        raw.decode(0, ids, q, transposed, k, None)
    with pytest.raises(ValueError, match="bfloat16"):
        raw.decode(0, ids, q, k.astype(np.int16), k, None)
    assert [st.length(i, 0) for i in (1, 2)] == [5, 5]
    # Through rpart.kernels the same layouts are copied and read; uint16 arrays are not taken for bfloat16.
    st.decode(0, [1, 2], q, overlapping, transposed)
    with pytest.raises(ValueError, match="float32 or float16"):
        st.decode(0, [1, 2], q, k.view(np.uint16), k)
    assert [st.length(i, 0) for i in (1, 2)] == [6, 6]


@pytest.mark.parametrize("fmt", ["fp16", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_output_is_torchs_rounding_of_the_float32_one(fmt, threads):
    ids = list(range(40))
    stores = [make_store(HKV, D, fmt=fmt, threads=threads) for _ in range(2)]
    for st in stores:
        st.create(ids)
        fill(st, np.random.default_rng(4), 0, ids, [1 + (i * 7) % 50 for i in ids])
    for step in range(3):
        _, (q, k, v) = projection(len(ids), seed=step)
        bits = stores[0].decode(0, ids, q, k, v, bf16_out=True)
        full = stores[1].decode(0, ids, q, k, v)
        assert bits.dtype == np.uint16 and bits.shape == full.shape
        want = torch.from_numpy(full).to(torch.bfloat16)
        assert torch.equal(torch.from_numpy(bits).view(torch.bfloat16), want)
        att = stores[0].attend(0, ids, q, bf16_out=True)
        assert torch.equal(torch.from_numpy(att).view(torch.bfloat16), torch.from_numpy(stores[1].attend(0, ids, q)).to(torch.bfloat16))
    for bad in (1, "yes", None, 0.0):
        with pytest.raises(ValueError, match="bf16_out"):
            stores[0].attend(0, ids, q, bf16_out=bad)
