"""vLLM's sampling parameters beyond temperature/top-k/top-p: repetition, frequency and presence
penalties, min_p, min_tokens, logit_bias and logprobs, each compared with its definition written inline in
plain torch (and with transformers' logits processors where it has one); garbage is refused."""
from __future__ import annotations

import math

import pytest
import torch

from fastdecode.engine import InvalidRequestError, SamplingParams
from fastdecode.engine.sampling import (TokenHistory, apply_logit_bias, apply_min_p, apply_min_tokens,
                                        apply_penalties, sample, token_logprobs)

V = 40


# ---- the definitions, in plain torch

def ref_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float,
                  pres: float) -> torch.Tensor:
    """transformers/vLLM repetition penalty over prompt + output, then OpenAI/vLLM frequency and
    presence penalties over the output."""
    x = logits.clone()
    seen = torch.zeros(x.shape[-1], dtype=torch.bool)
    seen[torch.tensor(prompt + output, dtype=torch.long)] = True
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[-1]).float()
    x = x - freq * counts
    x = x - pres * (counts > 0).float()
    return x


def ref_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def history(prompt, output=()):
    return TokenHistory(list(prompt), list(output))


CASES = [  # (prompt, output, repetition, frequency, presence)
    ([1, 2, 3], [4, 4, 4, 5], 1.3, 0.0, 0.0),
    ([1, 2, 3], [4, 4, 4, 5], 1.0, 0.7, 0.0),
    ([1, 2, 3], [4, 4, 4, 5], 1.0, 0.0, -1.5),
    ([7, 7, 9], [9, 10, 10, 10, 2], 0.8, -0.4, 1.2),
    ([5], [], 1.7, 2.0, 2.0),
    ([0, 39], [39, 0, 39, 39], 2.5, 1.0, 1.0),
]


def test_penalties_match_the_definition():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for _, _, r, f, p in CASES]
    x = logits.clone()
    apply_penalties(x, params, [history(pr, out) for pr, out, *_ in CASES])
    for i, (pr, out, r, f, p) in enumerate(CASES):
        torch.testing.assert_close(x[i], ref_penalties(logits[i], pr, out, r, f, p), rtol=0, atol=1e-6)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(2, V) * 3
    prompt, output = [3, 8, 8, 21], [21, 30, 3, 1]
    x = logits.clone()
    apply_penalties(x, [SamplingParams(repetition_penalty=1.4)] * 2, [history(prompt, output)] * 2)
    expected = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + output] * 2), logits.clone())
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_the_definition_and_transformers(min_p):
    from transformers.generation.logits_process import MinPLogitsWarper

    torch.manual_seed(2)
    logits = torch.randn(3, V) * 2
    got = apply_min_p(logits.clone(), torch.full((3,), min_p))
    for i in range(3):
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref_min_p(logits[i], min_p)))
    if min_p > 0:
        expected = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(expected))


def test_min_tokens_masks_stop_tokens_until_reached():
    eos = (2,)
    params = [SamplingParams(min_tokens=3, stop_token_ids=[5, 7]),                 # 2 generated: masked
              SamplingParams(min_tokens=3, stop_token_ids=[5]),                    # 3 generated: free
              SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True),   # EOS not a stop token
              SamplingParams(min_tokens=1, stop_token_ids=[V + 5])]                # out of the vocabulary
    hs = [history([1], [9, 9]), history([1], [9, 9, 9]), history([1]), history([1])]
    x = torch.zeros(4, V)
    apply_min_tokens(x, params, hs, eos)
    inf = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in x]
    assert inf == [{2, 5, 7}, set(), {7}, {2}]


def test_sample_greedy_takes_the_argmax_of_penalized_logits():
    torch.manual_seed(3)
    logits = torch.randn(len(CASES), V) * 3
    for i, (pr, out, *_) in enumerate(CASES):     # a seen token leads an unseen one (20) by a little
        logits[i, (out or pr)[0]], logits[i, 20] = 6.1, 6.0
    params = [SamplingParams(temperature=0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for _, _, r, f, p in CASES]
    hs = [history(pr, out) for pr, out, *_ in CASES]
    tokens = sample(logits, params, [None] * len(CASES), hs)
    expected = torch.stack([ref_penalties(logits[i], pr, out, r, f, p).argmax()
                            for i, (pr, out, r, f, p) in enumerate(CASES)])
    assert torch.equal(tokens, expected)
    assert not torch.equal(tokens, logits.argmax(-1))      # the penalties changed something


def test_sampled_frequencies_follow_penalties_temperature_min_p():
    """Many rows of one request: the draws follow softmax(min_p(penalized / T))."""
    n, t = 40000, 1.5
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -4.0, -6.0])
    prompt, output = [0, 3], [1, 1, 2]
    p = SamplingParams(temperature=t, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                       min_p=0.05)
    expected = ref_min_p(ref_penalties(logits, prompt, output, 1.2, 0.3, 0.2) / t, 0.05).softmax(-1).double()
    h = history(prompt, output)
    torch.manual_seed(4)
    tokens = sample(logits.repeat(n, 1), [p] * n, [None] * n, [h] * n)
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    support = expected > 0
    assert torch.all(freq[~support] == 0), freq
    chi2 = (((freq - expected)[support] * n) ** 2 / (expected[support] * n)).sum().item()
    assert chi2 < 24.3, (chi2, freq.tolist(), expected.tolist())     # p = 0.001 at <= 6 degrees of freedom


def test_bf16_cpu_logits_penalized_then_sampled_by_the_fused_kernels():
    """bf16 CPU logits (the S-Part's): the penalized copy stays bf16 (each penalized logit rounded
    once) and the fused kernels sample it; min_p rows take the float32 path."""
    n, t = 40000, 0.9
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -4.0, -6.0]).to(torch.bfloat16)
    prompt, output = [0, 3], [1, 1, 2]
    h = history(prompt, output)
    for extra in ({}, {"min_p": 0.05}):
        p = SamplingParams(temperature=t, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, **extra)
        penalized = ref_penalties(logits.float(), prompt, output, 1.2, 0.3, 0.2)
        expected = ref_min_p(penalized / t, extra.get("min_p", 0.0)).softmax(-1).double()
        torch.manual_seed(8)
        tokens = sample(logits.repeat(n, 1), [p] * n, [None] * n, [h] * n)
        freq = torch.bincount(tokens, minlength=len(logits)).double() / n
        support = expected > 0
        assert torch.all(freq[~support] == 0), freq
        chi2 = (((freq - expected)[support] * n) ** 2 / (expected[support] * n)).sum().item()
        assert chi2 < 24.3, (extra, chi2, freq.tolist(), expected.tolist())
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(logits[None], [greedy], [None], [history([0])]).item() == 1      # 2.0 / 1.5 < 1.5
    held = SamplingParams(temperature=2.0, min_tokens=2, stop_token_ids=[1])        # EOS 0 and token 1 masked
    tokens = sample(logits.repeat(5000, 1), [held] * 5000, [None] * 5000, [history([3], [4])] * 5000, (0,))
    assert set(tokens.tolist()) == {2, 3, 4, 5, 6, 7}
    both = SamplingParams(temperature=2.0, min_p=0.2, min_tokens=1)                  # fused: no float32 copy
    tokens = sample(logits.repeat(5000, 1), [both] * 5000, [None] * 5000, [history([3])] * 5000, (0,))
    keep = ref_min_p(logits.float().masked_fill(torch.arange(8) == 0, float("-inf")) / 2.0, 0.2) > float("-inf")
    assert set(tokens.tolist()) == set(torch.nonzero(keep).flatten().tolist())


def test_seeded_rows_reproducible_with_penalties():
    p = SamplingParams(temperature=1.0, seed=11, frequency_penalty=0.5)
    h = history([1, 2], [3])
    logits = torch.randn(1, V)

    def run():
        g = torch.Generator().manual_seed(11)
        return [sample(logits, [p], [g], [h]).item() for _ in range(30)]

    assert run() == run()


def test_mixed_batch_plain_rows_unchanged():
    """Plain rows in a batch with adjusted rows sample exactly as in a batch without them
    (greedy: the same argmax; seeded: the same draws)."""
    torch.manual_seed(5)
    logits = torch.randn(4, V)
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)]
    alone = sample(logits[:2], plain, [None, torch.Generator().manual_seed(3)])
    mixed = sample(logits, plain + [SamplingParams(temperature=0, repetition_penalty=1.5),
                                    SamplingParams(temperature=1.0, min_p=0.2)],
                   [None, torch.Generator().manual_seed(3), None, None],
                   [None, None, history([1, 2]), None])
    assert torch.equal(mixed[:2], alone)


def test_no_params_never_reads_histories_and_stays_byte_identical():
    torch.manual_seed(6)
    logits = torch.randn(64, V).to(torch.bfloat16)
    params = [SamplingParams(temperature=0)] * 64

    def boom():
        raise AssertionError("histories read without need")

    assert torch.equal(sample(logits, params, [None] * 64, boom, (2,)), logits.float().argmax(-1))
    assert token_logprobs(logits, params, logits.float().argmax(-1)) is None


# ---- logprobs

def test_logprobs_of_raw_logits():
    torch.manual_seed(7)
    logits = torch.randn(4, V) * 2
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(),
              SamplingParams(temperature=2.0, repetition_penalty=2.0, logprobs=0),
              SamplingParams(temperature=0.5, logprobs=20)]
    tokens = torch.tensor([5, 6, 7, 8])
    out = token_logprobs(logits, params, tokens)
    ref = logits.log_softmax(-1)           # the raw model distribution: before penalties and temperature
    assert out[1] is None
    for i in (0, 2, 3):
        assert out[i].token_id == int(tokens[i])
        assert math.isclose(out[i].logprob, ref[i, tokens[i]].item(), abs_tol=1e-6)
        n = params[i].logprobs
        values, ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out[i].top] == ids.tolist()
        assert all(math.isclose(a, b, abs_tol=1e-6) for (_, a), b in zip(out[i].top, values.tolist()))
        assert len(out[i].top) == n


def test_logit_bias_adds_to_its_tokens_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 3
    params = [SamplingParams(logit_bias={"3": 5.5, 7: -100}), SamplingParams(), SamplingParams(logit_bias={39: 0.25})]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        ref = x.float().clone()
        ref[0, 3] += 5.5
        ref[0, 7] -= 100
        ref[2, 39] += 0.25
        apply_logit_bias(x, params)
        assert torch.equal(x, ref.to(dtype))


def test_logit_bias_steers_greedy_and_sampled_rows():
    torch.manual_seed(2)
    logits = torch.randn(4, V) * 3
    logits[2, 5] = logits[2, 11] = 1.0       # equally likely once the rest is banned
    top = logits.argmax(-1)
    keep = {5: 0.0, 11: 0.0}
    ban_all_but = {t: -100 for t in range(V) if t not in keep}
    params = [SamplingParams(temperature=0, logit_bias={int(top[0]): -100}),    # greedy: the runner-up
              SamplingParams(temperature=0, logit_bias={9: 100}),               # greedy: forced
              SamplingParams(temperature=1.0, logit_bias=ban_all_but),          # sampled: only 5 or 11
              SamplingParams(temperature=0.7, top_k=30, logit_bias={9: 100})]  # the float32 path: forced
    seen = set()
    for seed in range(40):
        gens = [None, None, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)]
        tokens = sample(logits, params, gens)
        assert int(tokens[0]) == int(logits[0].topk(2).indices[1]) and int(tokens[1]) == 9 and int(tokens[3]) == 9
        seen.add(int(tokens[2]))
    assert seen == {5, 11}
    assert torch.equal(logits.argmax(-1), top)      # the caller's logits are left alone


# ---- validation

def test_new_params_accepted_from_json():
    p = SamplingParams.from_dict({"repetition_penalty": 1.1, "frequency_penalty": -2, "presence_penalty": 2,
                                  "min_p": 0.5, "min_tokens": 4, "max_tokens": 4, "logprobs": 20})
    assert p.adjusts and p.needs_history and p.penalized and p.logprobs == 20
    nulls = SamplingParams.from_dict({"repetition_penalty": None, "frequency_penalty": None,
                                      "presence_penalty": None, "min_p": None, "min_tokens": None, "logprobs": None})
    assert nulls == SamplingParams() and not nulls.adjusts and not nulls.needs_history
    assert SamplingParams(min_p=0.1).adjusts and not SamplingParams(min_p=0.1).needs_history
    bias = SamplingParams.from_dict({"logit_bias": {"7": 3, "5": -2.5, 9: 0}})
    assert bias.logit_bias == ((5, -2.5), (7, 3.0), (9, 0.0)) and bias.adjusts and not bias.needs_history
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == () == SamplingParams(logit_bias={}).logit_bias


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad,name", [
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"), ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty"), ({"repetition_penalty": True}, "repetition_penalty"),
    ({"repetition_penalty": [1.2]}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": NAN}, "frequency_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"presence_penalty": -INF}, "presence_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"), ({"presence_penalty": {}}, "presence_penalty"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.01}, "min_p"), ({"min_p": NAN}, "min_p"), ({"min_p": "0.1"}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"), ({"min_tokens": "3"}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"), ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"), ({"logprobs": 2.0}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": "5"}, "logprobs"),
    ({"logit_bias": "x"}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": 3}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"), ({"logit_bias": {"9" * 30: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": NAN}}, "logit_bias"), ({"logit_bias": {"5": INF}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
])
def test_garbage_is_refused_with_the_parameter_named(bad, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams.from_dict(bad)


# ---- through the engine, on a tiny model (fp32, torch attention)

@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from fastdecode.config import EngineConfig
    from fastdecode.engine import Engine

    e = Engine(EngineConfig(model=tiny_model_dir, attention="torch", dtype="float32"))
    yield e
    e.stop()


def run(engine, prompt, **params):
    outs = list(engine.generate(prompt, SamplingParams(**params)))
    tokens = [t for o in outs for t in o.token_ids]
    return tokens, outs


def test_engine_greedy_with_penalties_equals_reference_decoding(engine, tiny_model_dir):
    """Greedy decoding, each step the argmax of the reference-penalized transformers logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    prompt = engine.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    settings = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    got, _ = run(engine, prompt, temperature=0, max_tokens=10, ignore_eos=True, **settings)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            x = ref_penalties(logits, prompt, out, 1.5, 0.4, 0.3)
            top2 = x.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "near tie: pick another prompt"
            out.append(int(x.argmax()))
    plain, _ = run(engine, prompt, temperature=0, max_tokens=10, ignore_eos=True)
    assert got == out
    assert got != plain


def test_engine_logit_bias_bans_and_forces_tokens(engine):
    prompt = "Once upon a time"
    plain, outs = run(engine, prompt, temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    runner_up = outs[0].logprobs[0].top[1][0]
    banned, _ = run(engine, prompt, temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100})
    assert banned[0] == runner_up and plain[0] not in banned
    forced, _ = run(engine, prompt, temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logit_bias={"17": 100})
    assert forced == [17] * 6
    with pytest.raises(InvalidRequestError, match="logit_bias token id"):
        engine.add_request(prompt, SamplingParams(logit_bias={engine.args.vocab_size: 1}))


def test_engine_min_tokens_holds_off_stop_tokens_and_strings(engine):
    prompt = "Once upon a time"
    tokens, _ = run(engine, prompt, temperature=0, max_tokens=8, ignore_eos=True)
    first = tokens[0]
    stopped, outs = run(engine, prompt, temperature=0, max_tokens=8, stop_token_ids=[first])
    assert stopped == [first] and outs[-1].finish_reason == "stop"
    held, outs = run(engine, prompt, temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=5)
    assert len(held) >= 5 and first not in held[:5]
    # a stop string early in the text: not looked for before min_tokens tokens
    stop = engine.tokenizer.decode(tokens).strip()[:1]
    short, outs = run(engine, prompt, temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    assert outs[-1].finish_reason == "stop" and len(short) <= 4
    long, _ = run(engine, prompt, temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=len(short) + 2)
    assert len(long) >= len(short) + 2


def test_engine_returns_logprobs_of_the_model(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    prompt = engine.tokenizer("Hello there")["input_ids"]
    tokens, outs = run(engine, prompt, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=5,
                       repetition_penalty=1.3)
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 5 for lp in lps)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)[len(prompt) - 1:-1]
    for j, lp in enumerate(lps):
        assert math.isclose(lp.logprob, ref[j, tokens[j]].item(), abs_tol=1e-4)
        assert [t for t, _ in lp.top] == ref[j].topk(5).indices.tolist()
    plain, outs = run(engine, prompt, temperature=0, max_tokens=2)
    assert all(o.logprobs is None for o in outs)


def test_engine_returns_prompt_logprobs_of_the_model_on_the_first_output(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    prompt = engine.tokenizer("Hello there, how are you")["input_ids"]
    tokens, outs = run(engine, prompt, temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    first = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:]) and all(o.logprobs is None for o in outs)
    assert [lp.token_id for lp in first] == prompt
    assert first[0].logprob is None and first[0].top == []
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for t, lp in enumerate(first[1:]):
        assert math.isclose(lp.logprob, ref[t, prompt[t + 1]].item(), abs_tol=1e-4)
        assert [i for i, _ in lp.top] == ref[t].topk(4).indices.tolist()
    again, _ = run(engine, prompt, temperature=0, max_tokens=3, ignore_eos=True)
    assert again == tokens                              # asking for them changes nothing else
    from fastdecode.engine import model_runner

    rows, model_runner.PROMPT_LOGITS_ROWS = model_runner.PROMPT_LOGITS_ROWS, 2    # the LM head over 2 rows a call
    try:
        _, chunked = run(engine, prompt, temperature=0, max_tokens=1, prompt_logprobs=4)
    finally:
        model_runner.PROMPT_LOGITS_ROWS = rows
    def ids(lps):
        return [(lp.token_id, [i for i, _ in lp.top]) for lp in lps]

    def values(lps):        # float rounding differs with the GEMM's shape
        return [v for lp in lps[1:] for v in [lp.logprob] + [x for _, x in lp.top]]
    assert len(chunked[0].prompt_logprobs) == len(prompt) and ids(chunked[0].prompt_logprobs) == ids(first)
    assert values(chunked[0].prompt_logprobs) == pytest.approx(values(first), abs=1e-5)
    (one,) = [o.prompt_logprobs for o in run(engine, prompt[:1], temperature=0, max_tokens=1)[1]]
    assert one is None
    _, single = run(engine, prompt[:1], temperature=0, max_tokens=1, prompt_logprobs=0)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in single[0].prompt_logprobs] == [(prompt[0], None, [])]
    for bad in (-1, 21, "2", True, 1.5):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


# ---- the Triton model's logprobs output (python_backend/response.py)

def test_response_logprobs_tensor_only_when_asked():
    import json

    from fastdecode.engine.sampling import TokenLogprobs
    from fastdecode.engine.sequence import RequestOutput
    from python_backend.request import GenerateRequest
    from python_backend.response import ResponseBuilder

    lp = [TokenLogprobs(5, -0.5, [(5, -0.5), (6, -1.0)]), TokenLogprobs(7, float("-inf"), [(5, -0.1), (6, -1.0)]),
          TokenLogprobs(8, -0.2, [(8, -0.2), (6, -3.0)])]
    outs = [RequestOutput("r", [5], "", False, None, 3, 1, logprobs=lp[:1]),     # no complete character yet
            RequestOutput("r", [7], "ab", False, None, 3, 2, logprobs=lp[1:2]),
            RequestOutput("r", [8], "c", True, "length", 3, 3, logprobs=lp[2:])]
    entry = [{"token_id": 5, "logprob": -0.5, "top_logprobs": [{"token_id": 5, "logprob": -0.5},
                                                                {"token_id": 6, "logprob": -1.0}]},
             {"token_id": 7, "logprob": -9999.0, "top_logprobs": [{"token_id": 5, "logprob": -0.1},
                                                                   {"token_id": 6, "logprob": -1.0}]},
             {"token_id": 8, "logprob": -0.2, "top_logprobs": [{"token_id": 8, "logprob": -0.2},
                                                                {"token_id": 6, "logprob": -3.0}]}]
    stream = ResponseBuilder(GenerateRequest("p", stream=True, sampling={"logprobs": 2}))
    sent = [stream.on_output(o)[0] for o in outs]
    assert sent[0] is None
    assert [json.loads(s["logprobs"][0]) for s in sent[1:]] == [entry[:2], entry[2:]]
    whole = ResponseBuilder(GenerateRequest("p", sampling={"logprobs": 2}))
    sent = [whole.on_output(o)[0] for o in outs]
    assert sent[:2] == [None, None] and json.loads(sent[2]["logprobs"][0]) == entry
    plain = ResponseBuilder(GenerateRequest("p", stream=True))
    assert all("logprobs" not in s for s in (plain.on_output(o)[0] for o in outs) if s)


def test_response_prompt_logprobs_tensor_on_the_first_response_sent():
    import json

    from fastdecode.engine.sampling import TokenLogprobs
    from fastdecode.engine.sequence import RequestOutput
    from python_backend.request import GenerateRequest
    from python_backend.response import ResponseBuilder

    prompt = [TokenLogprobs(1, None, []), TokenLogprobs(2, -1.5, [(3, -0.5)]), TokenLogprobs(4, float("-inf"), [(3, -0.1)])]
    entries = [{"token_id": 1, "logprob": None, "top_logprobs": []},
               {"token_id": 2, "logprob": -1.5, "top_logprobs": [{"token_id": 3, "logprob": -0.5}]},
               {"token_id": 4, "logprob": -9999.0, "top_logprobs": [{"token_id": 3, "logprob": -0.1}]}]
    outs = [RequestOutput("r", [5], "", False, None, 3, 1, prompt_logprobs=prompt),   # no complete character yet
            RequestOutput("r", [7], "ab", False, None, 3, 2),
            RequestOutput("r", [8], "c", True, "length", 3, 3)]
    stream = ResponseBuilder(GenerateRequest("p", stream=True, sampling={"prompt_logprobs": 1}))
    sent = [stream.on_output(o)[0] for o in outs]
    assert sent[0] is None and json.loads(sent[1]["prompt_logprobs"][0]) == entries
    assert "prompt_logprobs" not in sent[2]
    whole = ResponseBuilder(GenerateRequest("p", sampling={"prompt_logprobs": 1}))
    sent = [whole.on_output(o)[0] for o in outs]
    assert json.loads(sent[2]["prompt_logprobs"][0]) == entries
    plain = ResponseBuilder(GenerateRequest("p", stream=True, sampling={"logprobs": 1}))
    assert all("prompt_logprobs" not in s for s in (plain.on_output(o)[0] for o in outs) if s)
