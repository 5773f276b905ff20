"""The bf16 matrix product on a packed weight (csrc/spart/gemm_bf16.cpp) against F.linear, its
reference: the same pairwise bf16 products summed in float32, so within one bf16 rounding of it;
a row's result independent of the call's row count; the product PackedLinear takes where the CPU
has AVX512-BF16 and no AMX (cpu_gemm); garbage refused with a clear error."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.config import EngineConfig
from fastdecode.model import packed as packed_module
from fastdecode.model.packed import PackedLinear, own_gemm_wanted
from tests.test_gemv_bf16 import within_one_rounding

ops = pytest.importorskip("fastdecode._spart_ops")
bf16_cpu = pytest.mark.skipif(not ops.gemm_bf16_available(), reason="this CPU has no AVX512-BF16")

# (out_features, in_features): SmolLM2's qkv, o, gate_up, down, an LM head slice, the smallest shapes
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576), (64, 2), (128, 34)]


def bf16_pair(n: int, k: int, rows: int, seed: int):
    torch.manual_seed(seed)
    return (torch.randn(rows, k) * 2).to(torch.bfloat16), (torch.randn(n, k) * 0.05).to(torch.bfloat16)


def check(got, x, w):
    within_one_rounding(got, F.linear(x, w), x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t())


@bf16_cpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 64, 130])
def test_gemm_equals_f_linear_within_one_rounding(n, k, rows):
    x, w = bf16_pair(n, k, rows, n + k + rows)
    got = ops.gemm_bf16(x, ops.pack_gemm_bf16(w))
    check(got, x, w)
    assert (got == F.linear(x, w)).float().mean() > 0.99         # summation order alone parts them


@bf16_cpu
def test_gemm_of_a_weight_past_the_cache_bound():
    """49152 x 576 (SmolLM2's LM head, 56 MB) is walked panel by panel, not row chunk by chunk."""
    x, w = bf16_pair(49152, 576, 70, 3)
    check(ops.gemm_bf16(x, ops.pack_gemm_bf16(w)), x, w)


@bf16_cpu
def test_a_rows_result_does_not_depend_on_the_calls_row_count_or_place():
    x, w = bf16_pair(960, 576, 300, 4)
    packed = ops.pack_gemm_bf16(w)
    full = ops.gemm_bf16(x, packed)
    for a, b in ((0, 1), (0, 5), (3, 9), (7, 71), (64, 65), (100, 300), (299, 300)):
        assert torch.equal(ops.gemm_bf16(x[a:b], packed), full[a:b]), (a, b)


@bf16_cpu
@pytest.mark.parametrize("n,rows", [(960, 300), (49152, 70), (64, 1), (192, 7)])
def test_every_item_is_computed_once_whatever_the_thread_count(n, rows):
    """Threads take runs of items from a shared counter: every output is written (out starts as
    NaN), and the result is the same on 1 to 5 threads."""
    x, w = bf16_pair(n, 576, rows, 6)
    packed = ops.pack_gemm_bf16(w)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3, 5):
            torch.set_num_threads(t)
            out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
            ops.gemm_bf16(x, packed, out=out)
            assert not out.isnan().any(), t
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    check(results[0], x, w)


@bf16_cpu
def test_gemm_reads_strided_rows_writes_into_out_and_handles_no_rows():
    x, w = bf16_pair(128, 40, 10, 5)
    packed = ops.pack_gemm_bf16(w)
    want = ops.gemm_bf16(x, packed)
    wide = torch.zeros(10, 3 * 40, dtype=torch.bfloat16)
    wide[:, 40:80] = x
    assert torch.equal(ops.gemm_bf16(wide[:, 40:80], packed), want)      # rows of a wider buffer, in place
    buf = torch.full((16, 200), float("nan"), dtype=torch.bfloat16)
    got = ops.gemm_bf16(x, packed, buf[:10, :128])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:10, :128], want)
    assert torch.isnan(buf[10:].float()).all() and torch.isnan(buf[:, 128:].float()).all()   # the rest untouched
    assert ops.gemm_bf16(torch.empty(0, 40, dtype=torch.bfloat16), packed).shape == (0, 128)


@bf16_cpu
def test_gemm_of_special_values():
    w = torch.zeros(64, 2, dtype=torch.bfloat16)
    w[0], w[1], w[2], w[3] = torch.tensor([1.0, 2.0]), torch.tensor([float("inf"), 1.0]), \
        torch.tensor([float("nan"), 0.0]), torch.tensor([3e38, 3e38])
    w[4] = torch.tensor([1.0, 1.0 / 256])                 # 1 + 2^-8 * 3 rounds to even: 1 + 2^-7 ... 1.0078125
    x = torch.tensor([[1.0, 1.0], [1.0, 3.0]], dtype=torch.bfloat16)
    got = ops.gemm_bf16(x, ops.pack_gemm_bf16(w)).float()
    assert got[0, 0] == 3.0 and got[0, 1] == float("inf") and got[0, 2].isnan() and got[0, 3] == float("inf")
    assert torch.equal(got[:, 4], F.linear(x, w)[:, 4].float())      # 1 + 3/256: round to nearest even
    assert (got[:, 5:] == 0).all()


@pytest.mark.parametrize("weight,match", [
    (torch.randn(64, 8), "bfloat16"),
    (torch.randn(64, 8).half(), "bfloat16"),
    (torch.randn(60, 8).bfloat16(), "multiple of 64"),
    (torch.randn(64, 7).bfloat16(), "K even"),
    (torch.randn(0, 8).bfloat16(), "multiple of 64"),
    (torch.randn(64, 8, 1).bfloat16(), r"\[N, K\]"),
])
def test_pack_refuses_garbage(weight, match):
    with pytest.raises(RuntimeError, match=match):
        ops.pack_gemm_bf16(weight)


@bf16_cpu
def test_gemm_refuses_garbage():
    packed = ops.pack_gemm_bf16(torch.randn(64, 8).bfloat16())
    x = torch.randn(3, 8).bfloat16()
    for args, match in [
        ((x.float(), packed), "bfloat16"),
        ((x, packed.float()), "bfloat16"),
        ((torch.randn(3, 10).bfloat16(), packed), r"\[M, 8\]"),
        ((torch.randn(8).bfloat16(), packed), r"\[M, 8\]"),
        ((torch.randn(3, 16).bfloat16()[:, ::2], packed), "contiguous rows"),
        ((x, torch.randn(64, 8).bfloat16()), "pack_gemm_bf16"),
        ((x, packed.view(1, 4, 32, 4)), "pack_gemm_bf16"),
        ((x, packed, torch.empty(3, 64)), "bfloat16"),
        ((x, packed, torch.empty(2, 64, dtype=torch.bfloat16)), r"\[3, 64\]"),
        ((x, packed, torch.empty(64, 3, dtype=torch.bfloat16).t()), "contiguous rows"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.gemm_bf16(*args)
    with pytest.raises(TypeError):
        ops.gemm_bf16("x", packed)


def test_cpu_gemm_setting_is_checked():
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(cpu_gemm="mkl")
    with pytest.raises(ValueError, match="cpu_gemm"):
        own_gemm_wanted(ops, 64, 8, "fast")
    assert not own_gemm_wanted(ops, 64, 8, "onednn") and not own_gemm_wanted(ops, 60, 8, "avx512bf16")
    assert own_gemm_wanted(ops, 64, 8, "avx512bf16") == ops.gemm_bf16_available()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn", "avx512bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_takes_the_gemm_where_chosen(monkeypatch, cpu_gemm, bias):
    torch.manual_seed(2)
    ref = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    for amx in (False, True):
        monkeypatch.setattr(packed_module, "_cpu_has_amx", lambda: amx)
        layer = PackedLinear(ref, cpu_gemm=cpu_gemm)
        chosen = ops.gemm_bf16_available() and not bias and (cpu_gemm == "avx512bf16" or
                                                             (cpu_gemm == "auto" and not amx))
        assert (layer._gemm is not None) == chosen, (cpu_gemm, bias, amx)
        x = torch.randn(2, 5, 576).to(torch.bfloat16)
        want = F.linear(x, ref.weight, ref.bias)
        exact = x.double() @ ref.weight.double().t() + (ref.bias.double() if bias else 0)
        terms = x.double().abs() @ ref.weight.double().abs().t() + (ref.bias.double().abs() if bias else 0)
        within_one_rounding(layer(x), want, exact, terms)                       # batched input
        within_one_rounding(layer(x[0]), want[0], exact[0], terms[0])           # rows
        out = torch.empty(5, 960, dtype=torch.bfloat16)
        assert layer(x[0], out=out).data_ptr() == out.data_ptr()
        within_one_rounding(out, want[0], exact[0], terms[0])
        assert torch.equal(layer.weight, ref.weight)                            # the plain weight is kept


@bf16_cpu
@pytest.mark.parametrize("rows,inter,k", [(1, 1536, 576), (13, 1536, 576), (130, 64, 34), (7, 32, 2)])
def test_glu_packing_gives_the_same_product_and_fuses_silu_mul_bit_for_bit(rows, inter, k):
    """A gate-up weight packed with glu: the same [M, 2I] product, and silu_mul's bits in one pass."""
    x, w = bf16_pair(2 * inter, k, rows, rows + inter)
    plain = ops.gemm_bf16(x, ops.pack_gemm_bf16(w))
    glu = ops.pack_gemm_bf16(w, True)
    assert torch.equal(ops.gemm_bf16(x, glu, glu=True), plain)
    fused = ops.gemm_bf16_silu_mul(x, glu)
    assert fused.shape == (rows, inter) and torch.equal(fused, ops.silu_mul(plain))
    out = torch.full((rows + 2, inter), float("nan"), dtype=torch.bfloat16)
    assert ops.gemm_bf16_silu_mul(x, glu, out[1:-1]).data_ptr() == out[1:].data_ptr()
    assert torch.equal(out[1:-1], fused) and torch.isnan(out[0].float()).all() and torch.isnan(out[-1].float()).all()


@bf16_cpu
def test_fused_silu_mul_of_special_sums():
    """The fused epilogue rounds by the hardware: the fused op's bits wherever they are a normal
    number, zero or inf, a NaN for a NaN, and zero where they are under float32's normal range."""
    inter = 32
    w = torch.zeros(2 * inter, 2, dtype=torch.bfloat16)
    gates = [1.0, -2.5, 0.0, float("inf"), float("nan"), 3e38, 1e-30, 1e-20, -100.0, 1e-38]
    ups = [2.0, 3.0, 5.0, 1.0, 1.0, 3e38, 4.0, 1e-20, 1.0, 1.0]
    for c, (g, u) in enumerate(zip(gates, ups)):
        w[c, 0], w[inter + c, 0] = g, u
    x = torch.tensor([[1.0, 0.0], [1e-20, 0.0], [-3.0, 0.0]], dtype=torch.bfloat16)
    fused = ops.gemm_bf16_silu_mul(x, ops.pack_gemm_bf16(w, True)).float()
    want = ops.silu_mul(ops.gemm_bf16(x, ops.pack_gemm_bf16(w))).float()
    nan, tiny = want.isnan(), (want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)
    assert nan.any() and tiny.any() and (~nan & ~tiny & (want != 0)).sum() > 10
    assert fused[nan].isnan().all() and (fused[tiny] == 0).all()
    assert torch.equal(fused[~nan & ~tiny], want[~nan & ~tiny])


@bf16_cpu
def test_gemm_silu_mul_refuses_garbage():
    glu = ops.pack_gemm_bf16(torch.randn(128, 8).bfloat16(), True)
    x = torch.randn(3, 8).bfloat16()
    for args, match in [
        ((x.float(), glu), "bfloat16"),
        ((torch.randn(3, 6).bfloat16(), glu), r"\[M, 8\]"),
        ((x, glu, torch.empty(3, 128, dtype=torch.bfloat16)), r"\[3, 64\]"),
        ((x, glu, torch.empty(3, 64)), "bfloat16"),
        ((x, torch.randn(128, 8).bfloat16()), "pack_gemm_bf16"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.gemm_bf16_silu_mul(*args)
    with pytest.raises(TypeError):
        ops.gemm_bf16_silu_mul(x, glu, "out")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn"])
def test_a_swiglu_gate_up_layer_fuses_silu_mul_where_it_runs_on_gemm_bf16(cpu_gemm):
    from fastdecode.model.layers import SwiGLU
    from fastdecode.model.packed import pack_linears

    torch.manual_seed(3)
    mlp = SwiGLU(576, 1536, bias=False).to(torch.bfloat16).requires_grad_(False)
    gate_up = mlp.gate_up_proj.weight.clone()
    pack_linears(mlp, cpu_gemm)
    layer = mlp.gate_up_proj
    assert isinstance(layer, PackedLinear) and layer.glu == (layer._gemm is not None)
    assert layer._gemm is None or cpu_gemm == "auto"
    assert isinstance(mlp.down_proj, PackedLinear) and not mlp.down_proj.glu
    x = torch.randn(9, 576).to(torch.bfloat16)
    y = layer(x)
    within_one_rounding(y, F.linear(x, gate_up), x.double() @ gate_up.double().t(),
                        x.double().abs() @ gate_up.double().abs().t())
    assert torch.equal(layer.silu_mul(x), ops.silu_mul(y))
    assert torch.equal(layer.silu_mul(x[:, :].t().contiguous().t()), ops.silu_mul(y))   # column-major rows
    assert torch.equal(layer.weight, gate_up)
