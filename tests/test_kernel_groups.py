"""int4 key and value groups chosen per store (k_group, v_group): every path, every shape it
allows, against the float64 reference on the dequantized cache; sizes; refusals."""
from __future__ import annotations

import numpy as np
import pytest

from rpart.kernels import KVStore, cpu_supports
from tests.test_kernel import BS, ISAS, check_against_reference, fill

GROUPS = [(16, 16), (16, 32), (32, 16), (32, 32), (32, 64), (64, 32), (64, 64), (128, 128), (64, 128)]


def allowed(isa: str, d: int, kg: int, vg: int) -> bool:
    if d % kg or d % vg:
        return False
    return not (isa in ("avx512", "avx512vnni") and vg < 32)  # 16 value lanes per nibble load


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kg,vg", GROUPS)
@pytest.mark.parametrize("g,hkv,d", [(1, 3, 128), (4, 2, 128), (3, 2, 64), (1, 2, 64)])
def test_groups_match_reference(isa, kg, vg, g, hkv, d):
    if not allowed(isa, d, kg, vg):
        with pytest.raises(ValueError):
            KVStore(1, hkv, d, 8 << 20, kv_format="int4", isa=isa, k_group=kg, v_group=vg)
        return
    rng = np.random.default_rng(kg * 7 + vg + d)
    store = KVStore(1, hkv, d, 8 << 20, kv_format="int4", isa=isa, num_threads=2, k_group=kg, v_group=vg)
    assert store.isa == isa and store.groups == (kg, vg)
    ids = [4, 8, 15]
    lens = [1, BS + 1, 4 * BS + 7]  # a chunk of 4 blocks and a short one after it
    store.create(ids)
    originals = fill(store, rng, 0, ids, lens, scale=2.0)
    q = rng.standard_normal((len(ids), g * hkv, d)).astype(np.float32)
    errs = check_against_reference(store, ids, q, store.attend(0, ids, q), originals)
    assert max(errs) < 0.5  # against the unquantized cache: larger groups, coarser steps


@pytest.mark.parametrize("kg,vg", [(32, 32), (32, 64), (64, 64), (128, 128)])
def test_groups_quantize_within_half_a_step(kg, vg):
    """Each stored value is within half a step of its own group (plus fp16 rounding of the params)."""
    rng = np.random.default_rng(5)
    store = KVStore(1, 2, 128, 4 << 20, kv_format="int4", k_group=kg, v_group=vg)
    store.create([1])
    k = (rng.standard_normal((20, 2, 128)) * np.linspace(0.1, 10, 128)).astype(np.float32)
    v = rng.standard_normal((20, 2, 128)).astype(np.float32) + 3
    store.append_span(0, [1], [20], k, v)
    kc, vc = store.read(1, 0)
    for x, xc, group in ((k, kc, kg), (v, vc, vg)):
        g = x.reshape(20, 2, 128 // group, group)
        step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / 15
        err = np.abs(xc.reshape(g.shape) - g)
        assert np.all(err <= step * 0.51 + 1e-3 * np.abs(g).max(-1, keepdims=True))


def test_larger_groups_take_fewer_bytes():
    """Per token and kv head at D = 128: 128 nibble bytes plus 4 bytes (fp16 scale and zero) per group."""
    def per_token(kg, vg):
        return KVStore(1, 1, 128, 1 << 20, kv_format="int4", block_size=16, k_group=kg, v_group=vg).block_bytes / 16

    assert per_token(32, 32) == 128 + 4 * (4 + 4) == 160
    assert per_token(32, 64) == 152 and per_token(64, 64) == 144 and per_token(128, 128) == 136
    default = KVStore(1, 1, 128, 1 << 20, kv_format="int4")
    assert default.groups == (32, 64) and default.block_bytes == 152 * 16
    assert KVStore(1, 1, 96, 1 << 20, kv_format="int4").groups == (32, 32)  # 64 does not divide 96
    assert KVStore(1, 1, 48, 1 << 20, kv_format="int4").groups == (16, 16)  # nor 32 48
    assert KVStore(1, 1, 64, 1 << 20).groups == (0, 0)  # fp16


@pytest.mark.parametrize("bad", [8, 24, 48, 256, -32, 1])
def test_bad_group_sizes_are_refused(bad):
    for kw in ({"k_group": bad}, {"v_group": bad}):
        with pytest.raises(ValueError, match="_group"):
            KVStore(1, 2, 128, 1 << 20, kv_format="int4", **kw)


def test_groups_must_divide_head_dim_and_need_int4():
    with pytest.raises(ValueError, match="dividing head_dim 64"):
        KVStore(1, 2, 64, 1 << 20, kv_format="int4", k_group=128)
    with pytest.raises(ValueError, match="int4 KV only"):
        KVStore(1, 2, 64, 1 << 20, kv_format="fp16", v_group=32)


@pytest.mark.parametrize("bad", ["32", 32.0, None, True, [32]])
def test_group_of_the_wrong_type_is_refused(bad):
    with pytest.raises(ValueError, match="k_group must be an int"):
        KVStore(1, 2, 64, 1 << 20, kv_format="int4", k_group=bad)


@pytest.mark.skipif(not cpu_supports("avx2"), reason="CPU lacks avx2")
def test_auto_isa_follows_the_value_group():
    """16-channel value groups are not on the 16-lane paths: auto picks avx2 for them, and still
    the best path when only the key group is 16."""
    small = KVStore(1, 2, 64, 1 << 20, kv_format="int4", v_group=16)
    assert small.isa == "avx2"
    if cpu_supports("avx512"):
        assert KVStore(1, 2, 64, 1 << 20, kv_format="int4", k_group=16).isa.startswith("avx512")
