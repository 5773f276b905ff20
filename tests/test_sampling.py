"""Sampling: parameters validated, seeds reproducible, distribution right, filters strict."""
from __future__ import annotations

import pytest
import torch

from fastdecode.engine import InvalidRequestError, SamplingParams
from fastdecode.engine.sampling import filter_logits, sample, seeded_uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draw(params: SamplingParams, n: int, seed: int | None = None, logits=LOGITS) -> torch.Tensor:
    """n tokens from one row; seeded rows draw from their own generator."""
    batch = logits.repeat(n, 1)
    if seed is None:
        torch.manual_seed(1234)
        return sample(batch, [params] * n, [None] * n)
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([sample(logits[None], [params], [g]).item() for _ in range(n)])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_over_temperature(temperature):
    n = 60000
    tokens = draw(SamplingParams(temperature=temperature), n)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    expected = (LOGITS.double() / temperature).softmax(-1)
    # chi-square against the expected counts, 5 degrees of freedom: p = 0.001 at 20.5
    chi2 = (((freq - expected) * n) ** 2 / (expected * n)).sum().item()
    assert chi2 < 20.5, (chi2, freq.tolist(), expected.tolist())
    assert (freq - expected).abs().max() < 0.01


def test_greedy_is_argmax():
    logits = torch.randn(16, 50)
    tokens = sample(logits, [SamplingParams(temperature=0)] * 16, [None] * 16)
    assert torch.equal(tokens, logits.argmax(-1))


def test_seed_reproducible_and_independent_of_batch():
    p = SamplingParams(temperature=1.0, seed=7)
    a = draw(p, 200, seed=7)
    b = draw(p, 200, seed=7)
    c = draw(p, 200, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # the seeded row gives the same tokens whatever rides along in the batch
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    alone = [sample(LOGITS[None], [p], [g1]).item() for _ in range(50)]
    other = SamplingParams(temperature=0.7, top_k=2)
    mixed = [sample(torch.stack([torch.randn(6), LOGITS, torch.randn(6)]), [other, p, other], [None, g2, None])[1].item()
             for _ in range(50)]
    assert alone == mixed


def test_seeded_row_on_another_device_uses_its_cpu_generator():
    """Sequences own CPU generators; logits live on the model's device (CUDA in production).
    torch refuses a CPU generator for a tensor elsewhere: the meta device refuses it too, so it
    stands in for CUDA here."""
    g = torch.Generator().manual_seed(7)
    before = g.get_state().clone()
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0)]
    out = sample(LOGITS.repeat(3, 1).to("meta"), params, [g, None, None])
    assert out.device.type == "meta" and out.shape == (3,)
    assert not torch.equal(g.get_state(), before)          # the seeded row drew from its own generator


def test_seeded_uniform_same_number_on_every_device():
    a = seeded_uniform(torch.Generator().manual_seed(3), "cpu")
    b = torch.rand(1, generator=torch.Generator().manual_seed(3))   # what a CPU row draws
    assert torch.equal(a, b)
    m = seeded_uniform(torch.Generator().manual_seed(3), torch.device("meta"))
    assert m.device.type == "meta" and m.shape == (1,)


def test_zero_probability_tokens_are_never_drawn():
    """Rows whose mass sits on a few tokens among many -inf: the inversion must skip the flat
    stretches of the cumulative sum, at both ends of [0, 1)."""
    logits = torch.full((2000, 300), float("-inf"))
    logits[:, 0] = logits[:, 299] = logits[:, 150] = 0.0
    tokens = sample(logits, [SamplingParams(temperature=1.0)] * 2000, [None] * 2000)
    assert set(tokens.tolist()) == {0, 150, 299}


def test_top_k_never_emits_excluded():
    tokens = draw(SamplingParams(temperature=5.0, top_k=2), 5000)
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_never_emits_excluded():
    probs = LOGITS.softmax(-1)           # ~ [0.57, 0.21, 0.13, 0.08, 0.03, 0.004]
    top_p = float(probs[:2].sum()) + 0.01  # the nucleus needs three tokens
    tokens = draw(SamplingParams(temperature=1.0, top_p=top_p), 8000)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens = draw(SamplingParams(temperature=1.0, top_p=0.3), 2000)   # the best token alone covers 0.3
    assert set(tokens.tolist()) == {0}


def test_top_p_renormalises_inside_nucleus():
    n = 40000
    top_p = float(LOGITS.softmax(-1)[:2].sum()) - 0.01   # exactly two tokens
    tokens = draw(SamplingParams(temperature=1.0, top_p=top_p), n)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    expected = torch.zeros(len(LOGITS), dtype=torch.double)
    expected[:2] = LOGITS[:2].double().softmax(-1)
    assert (freq - expected).abs().max() < 0.01


def test_filter_logits_combines_k_and_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    out = filter_logits(logits, torch.tensor([3, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0, 3]) and torch.isfinite(out[0, :3]).all()
    assert torch.isfinite(out[1, 0]) and torch.isinf(out[1, 1:]).all()


def test_from_dict_accepts_vllm_keys():
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 1,
                                  "stop": "\n", "stop_token_ids": [7], "ignore_eos": True})
    assert p.stop == ("\n",) and p.stop_token_ids == (7,) and p.max_tokens == 5
    assert SamplingParams.from_dict({"stop": ["a", "b"], "top_k": -1}).stop == ("a", "b")


@pytest.mark.parametrize("bad", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 1.5}, {"max_tokens": "10"}, {"max_tokens": True},
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": "hot"},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -1}, {"top_k": -2}, {"top_k": 2.5},
    {"seed": -1}, {"seed": "x"}, {"stop": 5}, {"stop": [1, 2]}, {"stop": [""]}, {"stop": {"a": 1}},
    {"stop_token_ids": 5}, {"stop_token_ids": [-1]}, {"stop_token_ids": ["a"]}, {"ignore_eos": "yes"},
    {"best_of": 2}, {"nonsense": 1},
])
def test_bad_params_raise_invalid_request(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict(bad)


def test_from_dict_rejects_non_dict():
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict(["max_tokens", 3])
