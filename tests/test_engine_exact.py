"""Token-exact: our engine (S-Part + an attention backend, batched) vs transformers generate().

The suite is a class so other backends reuse it: subclass EngineExactSuite and
override the `backend_overrides` fixture (a dict of EngineConfig overrides), e.g.

    from test_engine_exact import EngineExactSuite
    class TestRemoteEngineExact(EngineExactSuite):
        @pytest.fixture(params=[1, 2, 3])
        def backend_overrides(self, request, rworker_addresses):
            return {"attention": "remote", "rworkers": tuple(rworker_addresses[:request.param])}
"""
from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

from fastdecode.config import DEFAULT_MODEL_DIR, EngineConfig
from fastdecode.engine import Engine, SamplingParams

NEW_TOKENS = 64
NEAR_TIE = 1e-4
# First decode step, max abs logit difference from transformers (fp32), measured on the default
# model / the tiny ones: the torch backend (fp32 KV) 5.5e-5 / 1.9e-6; the kernel backends, local and
# remote alike (fp16 KV), 0.0153 / 2.2e-3 (kv3; the other tiny ones 1.0e-3). Tolerance: 4x the measured.
LOGIT_TOL = {("torch", "default"): 4 * 5.5e-5, ("torch", "tiny"): 4 * 1.9e-6,
             ("kernel", "default"): 4 * 0.0153, ("kernel", "tiny"): 4 * 2.2e-3}

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
    "Hello, world! Привет, мир! 你好，世界！",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Explain the difference between a list and a tuple in Python. Give a short example of each, and say "
    "when you would choose one over the other in real code that other people read.",
]


@contextlib.contextmanager
def torch_threads(n: int):
    """Batch-1 reference decoding is latency-bound: one thread is as fast on an idle
    machine and far faster on a busy one (no OpenMP spinning against other jobs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def backend_params():
    return [pytest.param({"attention": "torch"}, id="torch"), pytest.param({"attention": "local"}, id="local")]


def default_model_dir() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip(f"default model not converted ({DEFAULT_MODEL_DIR}); run `make model`")
    return str(DEFAULT_MODEL_DIR)


@functools.lru_cache(maxsize=None)
def hf_reference(model_dir: str, dtype: str, new_tokens: int) -> tuple:
    """Per prompt, alone: (generated ids, per-step raw logits [steps, vocab] float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt")["input_ids"]
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                               output_logits=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
            new = g.sequences[0, ids.shape[1]:].tolist()
            out.append((new, torch.cat([x.float() for x in g.logits])))
    return tuple(out)


def run_engine(engine: Engine, new_tokens: int) -> tuple[list[list[int]], dict[int, list[torch.Tensor]], list[str]]:
    """All prompts in one batch, greedy. Returns token ids, per-request logits per step, finish reasons."""
    captured: dict[int, list[torch.Tensor]] = {}
    runner = engine.runner
    decode, prefill = runner.decode, runner.prefill

    def cap_decode(seq_ids, *a):
        res = decode(seq_ids, *a)
        for row, lg in zip(res.rows, res.logits):
            captured.setdefault(seq_ids[row], []).append(lg.clone())
        return res

    def cap_prefill(seq_ids, *a):
        logits, lost = prefill(seq_ids, *a)
        for sid, lg in zip(seq_ids, logits):
            captured.setdefault(sid, []).append(lg.clone())
        return logits, lost

    runner.decode, runner.prefill = cap_decode, cap_prefill
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
        rids = [engine.add_request(p, params) for p in PROMPTS]
        seq_of = {rid: engine.requests.by_id[rid].seq_id for rid in rids}
        tokens = {rid: [] for rid in rids}
        reasons = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.token_ids
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
    finally:
        runner.decode, runner.prefill = decode, prefill
    return [tokens[r] for r in rids], {i: captured[seq_of[r]] for i, r in enumerate(rids)}, [reasons[r] for r in rids]


def compare(ours: list[list[int]], ref: tuple) -> list[str]:
    """Token-for-token; a divergence passes only at a near-tie of the reference. Returns notes."""
    notes = []
    for i, (toks, (ref_toks, ref_logits)) in enumerate(zip(ours, ref)):
        for j, (a, b) in enumerate(zip(toks, ref_toks)):
            if a != b:
                top2 = ref_logits[j].topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap <= NEAR_TIE, (f"prompt {i} diverges at token {j}: ours {a}, transformers {b}, "
                                         f"reference top-2 gap {gap:.3g} is not a near-tie")
                notes.append(f"prompt {i}: near-tie divergence at token {j} (gap {gap:.2g})")
                break
        else:
            assert len(toks) == len(ref_toks), f"prompt {i}: {len(toks)} tokens, transformers {len(ref_toks)}"
    return notes


class EngineExactSuite:
    @pytest.fixture(autouse=True)
    def _one_torch_thread(self):
        with torch_threads(1):
            yield

    @pytest.fixture(params=backend_params())
    def backend_overrides(self, request) -> dict:
        return request.param

    def _check(self, model_dir: str, overrides: dict, capsys=None) -> None:
        ref = hf_reference(model_dir, "float32", NEW_TOKENS)
        config = EngineConfig(model=model_dir, dtype="float32", **overrides)
        engine = Engine(config)
        try:
            toks, logits, reasons = run_engine(engine, NEW_TOKENS)
            assert engine.backend.stats()["sequences"] == 0
        finally:
            engine.stop()
        notes = compare(toks, ref)
        # first decode step = the second generated token's logits
        worst = max((logits[i][1] - ref[i][1][1]).abs().max().item() for i in range(len(PROMPTS))
                    if len(ref[i][0]) > 1)
        tol = LOGIT_TOL["torch" if config.attention == "torch" else "kernel",
                        "default" if model_dir == str(DEFAULT_MODEL_DIR) else "tiny"]
        print(f"\n{model_dir} [{config.attention}]: first decode step logits max abs diff {worst:.3g}; "
              f"finish {reasons}; " + ("; ".join(notes) or "all tokens equal"))
        assert worst <= tol

    def test_default_model_fp32_token_exact(self, backend_overrides):
        self._check(default_model_dir(), backend_overrides)

    @pytest.mark.parametrize("name", ["gqa", "mha_tied", "llama3_rope", "qwen2_bias"])
    def test_tiny_models_token_exact(self, tiny_model_dirs, name, backend_overrides):
        self._check(tiny_model_dirs[name], backend_overrides)


class TestEngineExact(EngineExactSuite):
    pass


# bf16 logits are rounded to 8 significant bits: at a logit of 36 one step (ulp) is 0.25, and
# many top-2 pairs are exact ties. A greedy divergence is fine only at a near-tie of that size.
BF16_NEAR_TIE_ULPS = 4


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


@pytest.mark.parametrize("overrides", backend_params())
def test_default_model_bf16_agreement(overrides):
    """bf16 rounds differently from transformers' bf16 kernels: greedy tokens may part at a
    bf16 near-tie of the reference, never at a clear gap. Reports leading equal tokens per prompt:
    how soon a near-tie comes depends on how the CPU's bf16 products round (about 47% of the
    tokens lead equal on an AMX Xeon, where oneDNN takes other kernels, more on Zen 4), so that
    share is printed, not bounded. Every position is compared instead with transformers'
    continuation fed to us as the prompt: wherever the reference's top two are apart by more than
    a near-tie (at least half the positions), our choice equals its token."""
    with torch_threads(1):
        _bf16_agreement(overrides)


def _bf16_agreement(overrides):
    model_dir = default_model_dir()
    n = NEW_TOKENS
    ref = hf_reference(model_dir, "bfloat16", n)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", **overrides))
    try:
        toks, _, _ = run_engine(engine, n)
        forced = forced_argmax(engine, ref)
    finally:
        engine.stop()
    agree, possible, notes, clear = [], [], [], []
    for i, (ours, (theirs, ref_logits)) in enumerate(zip(toks, ref)):
        k = 0
        while k < min(len(ours), len(theirs)) and ours[k] == theirs[k]:
            k += 1
        agree.append(k)
        possible.append(len(theirs))
        if k < min(len(ours), len(theirs)):
            top2 = ref_logits[k].topk(2).values
            gap, ulps = (top2[0] - top2[1]).item(), (top2[0] - top2[1]).item() / bf16_ulp(top2[0].item())
            notes.append(f"prompt {i} parts at token {k} (reference top-2 gap {gap:.3g} = {ulps:.3g} bf16 ulp)")
            if ulps > BF16_NEAR_TIE_ULPS:
                clear.append(notes[-1])
        else:
            assert len(ours) == len(theirs), f"prompt {i}: {len(ours)} tokens, transformers {len(theirs)}"
    print(f"\nbf16 [{overrides['attention']}]: leading tokens equal to transformers per prompt {agree} "
          f"of {possible} ({sum(agree)}/{sum(possible)}); " + ("; ".join(notes) or "all equal"))
    assert not clear, clear                                   # parting only at a bf16 near-tie
    assert sum(agree) > 0, (agree, possible)
    # Past a parting: every position of transformers' continuation, fed to us as the prompt.
    checked, wrong = 0, []
    for i, ((theirs, ref_logits), ours) in enumerate(zip(ref, forced)):
        for k, (t, o) in enumerate(zip(theirs, ours)):
            top2 = ref_logits[k].topk(2).values
            if (top2[0] - top2[1]).item() / bf16_ulp(top2[0].item()) > BF16_NEAR_TIE_ULPS:
                checked += 1
                if o != t:
                    wrong.append(f"prompt {i} token {k}: {o} against {t}")
    assert checked >= 0.5 * sum(possible) and not wrong, (checked, wrong)


def forced_argmax(engine: Engine, ref: tuple) -> list[list[int]]:
    """Per prompt: our greedy choice at each position of transformers' continuation, teacher-forced
    (the prompt and that continuation as one prompt; the top of each prompt position's logprobs)."""
    tok = engine.tokenizer
    out = []
    for p, (theirs, _) in zip(PROMPTS, ref):
        ids = tok(p)["input_ids"]
        first = list(engine.generate(ids + theirs, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)))
        entries = next(o.prompt_logprobs for o in first if o.prompt_logprobs)
        out.append([e.top[0][0] for e in entries[len(ids):]])    # entry t: the choice for token t
    return out
