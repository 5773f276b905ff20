"""The bf16 matrix-vector product (csrc/spart/gemv_bf16.cpp) against F.linear, its reference:
the same pairwise bf16 products summed in float32, so within one bf16 rounding of it; the one-row
product PackedLinear takes where the CPU has AVX512-BF16; garbage refused with a clear error."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.model.packed import PackedLinear

ops = pytest.importorskip("fastdecode._spart_ops")
bf16_cpu = pytest.mark.skipif(not ops.gemv_bf16_available(), reason="this CPU has no AVX512-BF16")

# (out_features, in_features): SmolLM2's qkv, o, gate_up, down and LM head, odd sizes (masked tails)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 13), (5, 33), (1, 1), (3, 64)]


def within_one_rounding(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> None:
    """got and want are each exact (float64) summed in float32 in some order, then rounded to bf16:
    they may differ by one bf16 step of the value, plus what float32 sums of `terms` (the sum of
    the products' magnitudes) can lose where they cancel, nowhere more."""
    step = torch.where(exact == 0, torch.ones_like(exact), exact.abs()).log2().floor().sub(7).exp2()
    slack = step + terms * 2.0 ** -17
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want.double()).abs() <= slack).all()
    assert ((got.double() - exact).abs() <= 2 * slack).all()


@bf16_cpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_equals_f_linear_within_one_rounding(n, k):
    torch.manual_seed(n * 7 + k)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    got = ops.gemv_bf16(x, w)
    within_one_rounding(got, F.linear(x, w), x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t())
    assert (got == F.linear(x, w)).float().mean() > 0.99         # summation order alone parts them


@bf16_cpu
def test_gemv_of_special_values_and_empty_shapes():
    w = torch.tensor([[1.0, 2.0], [float("inf"), 1.0], [float("nan"), 0.0], [3e38, 3e38]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    got = ops.gemv_bf16(x, w).float()[0]
    assert got[0] == 3.0 and got[1] == float("inf") and got[2].isnan() and got[3] == float("inf")
    assert ops.gemv_bf16(x, torch.empty(0, 2, dtype=torch.bfloat16)).shape == (1, 0)
    assert torch.equal(ops.gemv_bf16(torch.empty(1, 0, dtype=torch.bfloat16), torch.empty(3, 0, dtype=torch.bfloat16)),
                       torch.zeros(1, 3, dtype=torch.bfloat16))


@bf16_cpu
@pytest.mark.parametrize("x,w,match", [
    (torch.randn(1, 8), torch.randn(4, 8).bfloat16(), "bfloat16"),
    (torch.randn(1, 8).bfloat16(), torch.randn(4, 8).half(), "bfloat16"),
    (torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), r"\[1, 8\]"),
    (torch.randn(1, 9).bfloat16(), torch.randn(4, 8).bfloat16(), r"\[1, 8\]"),
    (torch.randn(8).bfloat16(), torch.randn(4, 8).bfloat16(), r"\[1, 8\]"),
    (torch.randn(1, 16).bfloat16()[:, ::2], torch.randn(4, 8).bfloat16(), "contiguous channels"),
    (torch.randn(1, 8).bfloat16(), torch.randn(8, 4).bfloat16().t(), "contiguous"),
    (torch.randn(1, 8).bfloat16(), torch.randn(4, 8, 1).bfloat16(), "contiguous"),
])
def test_gemv_refuses_garbage(x, w, match):
    with pytest.raises(RuntimeError, match=match):
        ops.gemv_bf16(x, w)
    with pytest.raises(TypeError):
        ops.gemv_bf16("x", w)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_takes_the_gemv_for_one_row(bias):
    torch.manual_seed(1)
    ref = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    layer = PackedLinear(ref)
    assert (layer._gemv is not None) == ops.gemv_bf16_available()
    calls = []
    if layer._gemv is not None:
        gemv = layer._gemv
        layer._gemv = lambda x, w: calls.append(x.shape) or gemv(x, w)
    x = torch.randn(3, 576).to(torch.bfloat16)
    exact = x.double() @ ref.weight.double().t() + (ref.bias.double() if bias else 0)
    terms = x.double().abs() @ ref.weight.double().abs().t() + (ref.bias.double().abs() if bias else 0)
    for rows in (1, 3):
        within_one_rounding(layer(x[:rows]), F.linear(x[:rows], ref.weight, ref.bias), exact[:rows], terms[:rows])
    within_one_rounding(layer(x[0].view(1, 576)), F.linear(x[:1], ref.weight, ref.bias), exact[:1], terms[:1])
    # the GEMV: one row, no bias, a kept weight; anything else stays on oneDNN
    assert calls == ([(1, 576), (1, 576)] if ops.gemv_bf16_available() and not bias else [])
