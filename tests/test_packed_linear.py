"""Linear layers on packed weights (fastdecode/model/packed.py, csrc/spart/packed_gemm.cpp)
against F.linear, their reference: the same products, a row's result independent of the call's
row count, and garbage refused with a clear error."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.model.packed import PackedLinear, pack_linears, packing_supported

ops = pytest.importorskip("fastdecode._spart_ops")
mkl = pytest.mark.skipif(not ops.mkl_packing_available(), reason="this torch has no MKL packed sgemm")

# (out_features, in_features): SmolLM2's qkv, o, gate_up, down and an LM head slice, and odd sizes
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576), (37, 13), (1, 1)]


def linear(n: int, k: int, bias: bool = False, dtype=torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias, dtype=dtype).requires_grad_(False)
    layer.weight.normal_(0, 0.05)
    if bias:
        layer.bias.normal_(0, 0.5)
    return layer


@mkl
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 128, 1000])
def test_fp32_packed_equals_f_linear(n, k, rows):
    ref = linear(n, k)
    x = torch.randn(rows, k)
    got = PackedLinear(ref)(x)
    want = F.linear(x, ref.weight)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@mkl
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (8192, 576)])
def test_fp32_a_rows_result_does_not_depend_on_the_calls_row_count(n, k):
    """Bit for bit from 12 rows on and at multiples of 4 (MKL's blocked kernels); calls of fewer
    rows take other kernels on some CPUs (a Zen 4's MKL: 1-11 rows, the multiples of 4 aside)."""
    layer = PackedLinear(linear(n, k))
    x = torch.randn(512, k)
    full = layer(x)
    for rows in (4, 8, 12, 31, 64, 129, 300, 511):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[-rows:]), full[-rows:]), rows
    for rows in (1, 2, 3, 5, 9, 11):
        torch.testing.assert_close(layer(x[:rows]), full[:rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x[-rows:]), full[-rows:], rtol=1e-5, atol=1e-5)


@mkl
def test_fp32_bias_strided_rows_batched_input_and_out():
    ref = linear(96, 40, bias=True)
    layer = PackedLinear(ref)
    wide = torch.randn(10, 3 * 40)
    x = wide[:, 40:80]                                  # rows of a wider buffer, read in place
    want = F.linear(x, ref.weight, ref.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.t().contiguous().t()), want, rtol=1e-5, atol=1e-5)  # column-major
    x3 = torch.randn(2, 5, 40)
    torch.testing.assert_close(layer(x3), F.linear(x3, ref.weight, ref.bias), rtol=1e-5, atol=1e-5)
    buf = torch.full((16, 96), float("nan"))
    got = layer(x, out=buf[:10])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:10], want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(buf[10:]).all()                  # rows past the call's are left alone
    assert layer(torch.empty(0, 40)).shape == (0, 96)


@mkl
def test_fp32_pack_linears_replaces_the_layers_and_keeps_the_state_dict():
    model = nn.Sequential(linear(64, 32), nn.ReLU(), linear(16, 64, bias=True))
    keys = set(model.state_dict())
    x = torch.randn(5, 32)
    want = model(x)
    assert pack_linears(model) == 2
    assert all(isinstance(model[i], PackedLinear) for i in (0, 2))
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


PACKABLE = [pytest.param(torch.float32, marks=mkl, id="fp32"),
            pytest.param(torch.bfloat16, id="bf16",
                         marks=pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16"))]


@pytest.mark.parametrize("dtype", PACKABLE)
def test_pack_linears_holds_a_weight_once_and_gives_it_back_exactly(dtype):
    """fp32: pack_linears drops the plain weight. bf16 layers keep it (pack_linears); unpacking
    still gives it back exactly."""
    model = nn.Sequential(linear(64, 32, dtype=dtype), linear(16, 64, bias=True, dtype=dtype))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [weakref.ref(model[i].weight) for i in (0, 1)]
    x = torch.randn(5, 32).to(dtype)
    want = model(x)
    if dtype == torch.float32:
        assert pack_linears(model) == 2
    else:
        model = nn.Sequential(*(PackedLinear(model[i], keep_weight=False) for i in (0, 1)))
    gc.collect()
    assert all(ref() is None for ref in originals)            # the unpacked weights are gone
    assert all("weight" not in model[i]._parameters for i in (0, 1))
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model[1].weight, before["1.weight"])
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 7, 32, 5000):                              # unpacked a few input channels at a time
        assert torch.equal(model[1].unpacked_weight(rows), before["1.weight"])
    model[0].weight = before["0.weight"]                      # assigning keeps it again
    assert "weight" in model[0]._parameters and model[0].weight.data_ptr() == before["0.weight"].data_ptr()
    with pytest.raises(TypeError):
        model[0].weight = "not a tensor"


@pytest.mark.parametrize("dtype", PACKABLE)
def test_a_tied_weight_stays_shared_and_bf16_keeps_its_weights(dtype):
    embed = nn.Embedding(40, 16, dtype=dtype).requires_grad_(False)
    head = linear(40, 16, dtype=dtype)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    assert pack_linears(model) == 1
    assert model["head"]._parameters["weight"] is model["embed"].weight
    x = torch.randn(3, 16).to(dtype)
    torch.testing.assert_close(model["head"](x), F.linear(x, embed.weight), rtol=1e-5, atol=1e-5)
    alone = nn.Sequential(linear(8, 4, dtype=dtype))
    pack_linears(alone)
    assert ("weight" in alone[0]._parameters) == (dtype == torch.bfloat16)


def test_packing_is_only_for_cpu_bf16_and_fp32():
    assert not packing_supported(torch.float16, "cpu")
    assert not packing_supported(torch.float32, "cuda")
    assert packing_supported(torch.float32, "cpu") == ops.mkl_packing_available()
    model = nn.Sequential(linear(8, 4, dtype=torch.float64))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_bf16_packed_is_bit_identical_to_f_linear_and_fills_out():
    """oneDNN's packed product; gemm_bf16's (where chosen) is tests/test_gemm_bf16.py's."""
    ref = linear(960, 576, dtype=torch.bfloat16)
    layer = PackedLinear(ref, cpu_gemm="onednn")
    x = torch.randn(33, 576).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, ref.weight))
    out = torch.empty(33, 960, dtype=torch.bfloat16)
    assert layer(x, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, ref.weight).float().to(torch.bfloat16), rtol=0.02, atol=0.02)


@mkl
def test_another_dtype_is_refused_as_nn_linear_refuses_it():
    ref = linear(24, 12)
    layer = PackedLinear(ref)
    x = torch.randn(3, 12, dtype=torch.float64)
    with pytest.raises(RuntimeError) as want:
        ref(x)
    with pytest.raises(RuntimeError) as got:
        layer(x)
    assert str(got.value) == str(want.value)


# -- garbage ---------------------------------------------------------------------------------

@mkl
@pytest.mark.parametrize("weight,match", [
    (torch.randn(8, 4, dtype=torch.float64), "float32"),
    (torch.randn(8), "float32 CPU tensor"),
    (torch.randn(2, 3, 4), "float32 CPU tensor"),
    (torch.randn(0, 4), "dimensions"),
    (torch.randn(4, 0), "dimensions"),
])
def test_pack_refuses_garbage_weights(weight, match):
    with pytest.raises(RuntimeError, match=match):
        ops.pack_linear_weight(weight)


@mkl
def test_packed_linear_refuses_garbage():
    w = torch.randn(16, 8)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(3, 8)
    cases = [
        (lambda: ops.packed_linear(x.double(), packed), "float32"),
        (lambda: ops.packed_linear(torch.randn(3, 9), packed), "9 features, the weight takes 8"),
        (lambda: ops.packed_linear(torch.randn(8), packed), "float32 CPU tensor"),
        (lambda: ops.packed_linear(x, packed.clone()), "another address"),
        (lambda: ops.packed_linear(x, torch.zeros(4096, dtype=torch.uint8)), "pack_linear_weight"),
        (lambda: ops.packed_linear(x, torch.zeros(8, dtype=torch.uint8)), "pack_linear_weight"),
        (lambda: ops.packed_linear(x, w), "pack_linear_weight"),
        (lambda: ops.packed_linear(x, packed[:100]), "truncated"),
        (lambda: ops.packed_linear(x, packed, torch.randn(15)), "bias"),
        (lambda: ops.packed_linear(x, packed, torch.randn(16).double()), "bias"),
        (lambda: ops.packed_linear(x, packed, None, torch.empty(3, 15)), "out"),
        (lambda: ops.packed_linear(x, packed, None, torch.empty(4, 16)), "out"),
        (lambda: ops.packed_linear(x, packed, None, torch.empty(16, 3).t()), "out"),
        (lambda: ops.packed_linear(x, packed, None, torch.empty(3, 16, dtype=torch.float64)), "out"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    torch.testing.assert_close(ops.packed_linear(x, packed), x @ w.t())   # still serves
