"""The fused CPU ops (fastdecode._spart_ops), bf16 and fp32, against the torch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdecode.model.fused import argmax, fuse_layers, load_ops
from fastdecode.model.layers import RMSNorm, apply_rope

ops = load_ops()
bf16 = torch.bfloat16


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.view(torch.int16) == b.view(torch.int16)).all())


def norm_of(weight: torch.Tensor, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight.data = weight
    return norm


@pytest.mark.parametrize("rows", [1, 3, 128, 300])
def test_rms_norm_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(bf16)
    w = (torch.rand(576, generator=g) + 0.5).to(bf16)
    got, ref = ops.rms_norm(x, w, 1e-5), norm_of(w)(x)
    # float32 sums in another order may move a value by one bf16 step, rarely
    assert (got.view(torch.int16) != ref.view(torch.int16)).float().mean() < 1e-3
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=0)


def test_add_rms_norm_updates_the_residual_in_place():
    g = torch.Generator().manual_seed(1)
    h, d = torch.randn(64, 576, generator=g).to(bf16), torch.randn(64, 576, generator=g).to(bf16)
    w = torch.rand(576, generator=g).to(bf16)
    expected_h = h + d
    got = ops.add_rms_norm(h, d, w, 1e-6)
    assert same_bits(h, expected_h)
    torch.testing.assert_close(got.float(), norm_of(w, 1e-6)(expected_h).float(), rtol=8e-3, atol=0)


def test_rope_matches_torch_and_leaves_other_heads_alone():
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(37, 15, 64, generator=g).to(bf16)
    angles = torch.rand(37, 32, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(bf16), torch.cat([angles.sin()] * 2, -1).to(bf16)
    ref = apply_rope(qkv[:, :12], cos[:, None], sin[:, None])
    got = qkv.clone()
    ops.rope_(got[:, :12], cos, sin)                  # a strided view: rows of the qkv buffer
    assert same_bits(got[:, :12], ref)
    assert same_bits(got[:, 12:], qkv[:, 12:])


def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(130, 2 * 1536, generator=g) * 6).to(bf16)
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's clamps and zero
    gate, up = gu.split(1536, dim=-1)
    assert same_bits(ops.silu_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40, 1536])
def test_silu_mul_each_path_matches_torch_at_every_tail(n, portable):
    """The AVX-512 path (where the CPU has it) and the portable one, over rows whose half is not a
    multiple of a vector, with exp's clamps, zeros and NaN in the vector body and in the tail."""
    g = torch.Generator().manual_seed(n)
    gu = (torch.randn(9, 2 * n, generator=g) * 6).to(bf16)
    gu[1, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])[:n]
    gu[2, n - 1] = gu[3, 2 * n - 1] = float("nan")
    gu[4, n // 2] = 88.0
    gate, up = gu.split(n, dim=-1)
    ours, ref = ops.silu_mul(gu, portable=portable), F.silu(gate) * up
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().sum() >= 2   # NaN's sign bit may differ
    assert same_bits(ours.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_argmax_takes_the_first_maximum_and_nan_as_torch_does():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 49152, generator=g).to(bf16)
    logits[1, 7] = logits[1, 40000] = 50.0            # ties: the first
    logits[2, 123] = float("nan")                     # NaN counts as the maximum
    logits[3] = float("-inf")
    logits[4, :] = -0.0
    logits[4, 9] = 0.0                                # -0 == +0: index 0
    logits[5, 49151] = 1e30                           # the tail after the vector body
    assert argmax(logits).tolist() == logits.max(dim=-1).indices.tolist()
    assert argmax(logits).tolist()[1:4] == [7, 123, 0]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 49155])
def test_argmax_rows_each_path_matches_torch_at_every_tail(n, portable):
    """The AVX-512 path (where the CPU has it) and the portable one, over rows whose length is not a
    multiple of a vector: maxima in the tail, ties, both NaNs, -inf rows, -0 against +0."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=g).to(bf16)
    x[1, -1] = 1e30                                   # the last element
    x[2, 0] = x[2, n // 2] = x[2, -1] = 60.0          # ties: the first
    x[3, n // 3] = float("nan")
    x[4] = float("-inf")
    x[5] = -0.0
    x[5, -1] = 0.0
    x.view(torch.int16)[6, n // 2] = -64              # 0xffc0: a NaN with the sign bit set is a maximum too
    x[7] = -1e30
    x[7, -1] = float("inf")
    x[8] = torch.randint(-3, 3, (n,), generator=g).to(bf16)   # many ties
    got = ops.argmax_rows(x, portable=portable)
    assert got.tolist() == x.max(dim=-1).indices.tolist()


def test_argmax_falls_back_to_torch_for_other_dtypes():
    x = torch.randn(3, 10, dtype=torch.float64)
    assert argmax(x).tolist() == x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("call", [
    lambda: ops.rms_norm(torch.randn(4, 8), torch.ones(8, dtype=bf16), 1e-5),              # float32 x
    lambda: ops.rms_norm(torch.randn(4, 8).to(bf16), torch.ones(7, dtype=bf16), 1e-5),     # weight size
    lambda: ops.rms_norm(torch.randn(4, 8).to(bf16).t(), torch.ones(4, dtype=bf16), 1e-5),  # strided rows
    lambda: ops.add_rms_norm(torch.randn(4, 8).to(bf16), torch.randn(3, 8).to(bf16), torch.ones(8, dtype=bf16), 1e-5),
    lambda: ops.rope_(torch.randn(4, 2, 7).to(bf16), torch.ones(4, 7, dtype=bf16), torch.ones(4, 7, dtype=bf16)),
    lambda: ops.rope_(torch.randn(4, 2, 8).to(bf16), torch.ones(3, 8, dtype=bf16), torch.ones(4, 8, dtype=bf16)),
    lambda: ops.silu_mul(torch.randn(4, 7).to(bf16)),
    lambda: ops.silu_mul(torch.randn(4, 8, dtype=torch.float64)),
    lambda: ops.argmax_rows(torch.randn(4, 8).half()),
    lambda: ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 8).to(bf16), torch.ones(8), 1e-5),     # mixed
    lambda: ops.rope_(torch.randn(4, 2, 8), torch.ones(4, 8, dtype=bf16), torch.ones(4, 8, dtype=bf16)),
    lambda: ops.sample_rows(torch.zeros(2, 8, dtype=torch.float64), torch.tensor([0]), torch.ones(1), torch.zeros(1)),
    lambda: ops.argmax_rows(torch.zeros(4, 0, dtype=bf16)),
    lambda: ops.rms_norm("x", torch.ones(8, dtype=bf16), 1e-5),
])
def test_bad_input_is_a_clear_error(call):
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        call()


@pytest.mark.parametrize("dtype, tol, agree", [("bfloat16", 0.05, 0.9), ("float32", 1e-4, 1.0)])
def test_fused_model_decodes_as_the_torch_model(tiny_model_dir, dtype, tol, agree):
    """A model with the fused ops gives the logits of the same model without them."""
    from fastdecode.model.loader import load_model

    loaded = load_model(tiny_model_dir, dtype=dtype)
    model = loaded.model
    assert model.ops is not None and all(layer.ops is not None for layer in model.layers)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, loaded.args.vocab_size, (21,), generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(12)])
    with torch.inference_mode():
        fused = model(tokens, positions, [9, 12])
        model.ops = None
        for layer in model.layers:
            layer.ops = None
        plain = model(tokens, positions, [9, 12])
    torch.testing.assert_close(fused, plain, rtol=tol, atol=tol)
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= agree


def test_fp16_models_keep_the_torch_path(tiny_model_dir):
    from fastdecode.model.loader import load_model

    model = load_model(tiny_model_dir, dtype="float16").model
    assert model.ops is None and not fuse_layers(model)


def test_sample_rows_follows_softmax_over_temperature():
    """bf16 logits sampled in C++: frequencies within a chi-square bound of softmax(x / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf")]).to(bf16)
    n, temperature = 60000, 0.8
    batch = logits.repeat(n, 1)
    g = torch.Generator().manual_seed(6)
    tokens = ops.sample_rows(batch, torch.arange(n), torch.full((n,), temperature), torch.rand(n, generator=g))
    freq = torch.bincount(tokens, minlength=7).double() / n
    expected = (logits.double() / temperature).softmax(-1)
    assert freq[6] == 0                                        # -inf: never
    chi2 = (((freq[:6] - expected[:6]) * n) ** 2 / (expected[:6] * n)).sum().item()
    assert chi2 < 20.5, (chi2, freq.tolist(), expected.tolist())


def test_sample_rows_inverts_the_cumulative_sum():
    """u just below a token's share boundary picks it, just above picks the next; long rows
    (many chunks) and rows picked out of a larger batch."""
    logits = torch.full((3, 1000), float("-inf"))
    logits[1, 10] = logits[1, 700] = logits[1, 999] = 0.0     # three equal shares
    logits = logits.to(bf16)
    rows = torch.tensor([1, 1, 1, 1])
    u = torch.tensor([0.0, 0.33, 0.34, 0.999])
    assert ops.sample_rows(logits, rows, torch.ones(4), u).tolist() == [10, 10, 700, 999]


@pytest.mark.parametrize("rows, temps, u", [
    (torch.tensor([5]), torch.ones(1), torch.zeros(1)),                 # row out of range
    (torch.tensor([-1]), torch.ones(1), torch.zeros(1)),
    (torch.tensor([0]), torch.zeros(1), torch.zeros(1)),                # temperature 0
    (torch.tensor([0]), torch.tensor([float("nan")]), torch.zeros(1)),
    (torch.tensor([0]), torch.ones(1), torch.ones(1)),                  # u outside [0, 1)
    (torch.tensor([0, 1]), torch.ones(1), torch.zeros(1)),              # lengths differ
    (torch.tensor([0.0]), torch.ones(1), torch.zeros(1)),               # float rows
])
def test_sample_rows_refuses_bad_arguments(rows, temps, u):
    with pytest.raises(RuntimeError):
        ops.sample_rows(torch.zeros(2, 8, dtype=bf16), rows, temps, u)


def test_engine_sampler_uses_the_same_draws_on_both_paths():
    """A seeded bf16 row gives the same tokens from the fused sampler as from the torch one
    (same uniform per step; the inversion differs only in float32 rounding)."""
    from fastdecode.engine.sampling import SamplingParams, sample

    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(1, 4000, generator=g) * 2).to(bf16)
    p = SamplingParams(temperature=0.9, seed=3)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    fused_tokens = [sample(logits, [p], [g1]).item() for _ in range(200)]
    torch_tokens = [sample(logits.double(), [p], [g2]).item() for _ in range(200)]   # float64: not fused
    assert sum(a == b for a, b in zip(fused_tokens, torch_tokens)) >= 195


# ---- float32: the same ops, no rounding between steps, against torch in float32

def test_fp32_norms_match_torch():
    g = torch.Generator().manual_seed(11)
    x, d = torch.randn(70, 576, generator=g) * 3, torch.randn(70, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), norm_of(w)(x), rtol=1e-5, atol=1e-6)
    h, expected_h = x.clone(), x + d
    got = ops.add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(got, norm_of(w, 1e-6)(expected_h), rtol=1e-5, atol=1e-6)


def test_fp32_rope_matches_torch_and_leaves_other_heads_alone():
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(37, 15, 64, generator=g)
    angles = torch.rand(37, 32, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref = apply_rope(qkv[:, :12], cos[:, None], sin[:, None])
    got = qkv.clone()
    ops.rope_(got[:, :12], cos, sin)
    torch.testing.assert_close(got[:, :12], ref, rtol=1e-5, atol=1e-6)   # a product and sum may fuse into an FMA
    assert torch.equal(got[:, 12:], qkv[:, 12:])


@pytest.mark.parametrize("n", [1, 17, 1536])
def test_fp32_silu_mul_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    gu = torch.randn(9, 2 * n, generator=g) * 6
    gu[1, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])[:n]
    gu[2, n - 1] = float("nan")
    gate, up = gu.split(n, dim=-1)
    ours, ref = ops.silu_mul(gu), F.silu(gate) * up
    assert torch.equal(ours.isnan(), ref.isnan())
    torch.testing.assert_close(ours.nan_to_num(0.0), ref.nan_to_num(0.0), rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 49155])
def test_fp32_argmax_matches_torch_at_every_tail(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(10, n, generator=g)
    x[1, -1] = 1e30
    x[2, 0] = x[2, n // 2] = x[2, -1] = 60.0          # ties: the first
    x[3, n // 3] = float("nan")
    x[4] = float("-inf")
    x[5] = -0.0
    x[5, -1] = 0.0                                    # -0 == +0: index 0
    x.view(torch.int32)[6, n // 2] = -4194304         # 0xffc00000: a NaN with the sign bit set
    x[7] = -3e38
    x[7, -1] = float("inf")
    assert argmax(x).tolist() == x.max(dim=-1).indices.tolist()
    assert ops.argmax_rows(x[:, : max(1, n // 2)]).tolist() == x[:, : max(1, n // 2)].max(dim=-1).indices.tolist()


def test_fp32_sample_rows_follows_softmax_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf")])
    n, temperature = 60000, 0.8
    g = torch.Generator().manual_seed(13)
    tokens = ops.sample_rows(logits.repeat(n, 1), torch.arange(n), torch.full((n,), temperature),
                             torch.rand(n, generator=g))
    freq = torch.bincount(tokens, minlength=7).double() / n
    expected = (logits.double() / temperature).softmax(-1)
    assert freq[6] == 0
    chi2 = (((freq[:6] - expected[:6]) * n) ** 2 / (expected[:6] * n)).sum().item()
    assert chi2 < 20.5, (chi2, freq.tolist(), expected.tolist())
