"""Identical prompts in one prefill (the n choices of a request) run the S-Part once and decode
exactly as if each had been prefilled alone."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 7], [5, 9, 13, 2, 7], [11, 3, 8], [5, 9, 13, 2, 7]]


def run_together(engine: Engine, prompts, params) -> tuple[list[list[int]], list[int]]:
    """Generate all prompts admitted in one step; -> their tokens, and the token rows the S-Part
    embedded in each step."""
    embedded: list[int] = []
    embed = engine.model.embed
    engine.model.embed = lambda tokens: (embedded.append(len(tokens)), embed(tokens))[1]
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i),
                           on_output=lambda o: outs.setdefault(o.request_id, []).extend(o.token_ids))
    while engine.has_unfinished():
        engine.step()
    return [outs[str(i)] for i in range(len(prompts))], embedded


@pytest.mark.parametrize("attention", ["local", "torch"])
def test_identical_prompts_prefill_once_and_decode_as_alone(tiny_model_dir, attention):
    config = EngineConfig(model=tiny_model_dir, attention=attention, kernel_threads=1, kv_capacity_bytes=16 << 20)
    engine = Engine(config)
    try:
        alone = {tuple(p): run_together(engine, [p], GREEDY)[0][0] for p in PROMPTS}
        together, embedded = run_together(engine, PROMPTS, GREEDY)
    finally:
        engine.stop()
    assert together == [alone[tuple(p)] for p in PROMPTS]
    assert embedded[0] == 5 + 3                     # two distinct prompts, not four
    assert embedded[1:] == [len(PROMPTS)] * (GREEDY.max_tokens - 1)


def test_siblings_sample_independently(tiny_model_dir):
    """Shared prefill, separate sampling: seeded siblings with different seeds diverge, the same
    seed agrees."""
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch"))
    try:
        outs = []
        for seed in (1, 2, 1):
            engine.add_request([5, 9, 13, 2, 7], SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                               ignore_eos=True), request_id=f"s{len(outs)}",
                               on_output=lambda o: outs[int(o.request_id[1:])].extend(o.token_ids))
            outs.append([])
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.stop()
    assert outs[0] == outs[2] and outs[0] != outs[1]
