"""An attention failure ends only the requests it concerns; the engine keeps serving
(the local C++ backend refuses non-finite q, k, v; other errors stand for a backend fault)."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from fastdecode.attention.base import AttentionError, SequencesLost
from fastdecode.config import EngineConfig
from fastdecode.engine import Engine

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Hello, world!", "One two three four"]


@pytest.fixture
def engine(tiny_model_dir):
    e = Engine(EngineConfig(model=tiny_model_dir, attention="local", kernel_threads=1, kv_capacity_bytes=16 << 20))
    yield e
    e.stop()


def run(engine: Engine, prompts: list[str]) -> dict[str, list]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return {i: outs[i] for i in ids}


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def poison(engine: Engine, seq_index: int, layer: int, value: float) -> None:
    """From the third decode step on, one sequence's new key at `layer` turns into `value`."""
    runner, start, calls = engine.runner, engine.runner._start_layer, {"n": 0}
    model, pre = engine.runner.model, engine.runner.model.pre_attention
    victim = {}

    def start_layer(lay, mb):
        if lay == 0:
            calls["n"] += 1
        if calls["n"] >= 3 and lay == layer:
            victim.setdefault("id", sorted(engine_seq_ids(engine))[seq_index])
            if victim["id"] in mb.seq_ids:
                row = mb.seq_ids.index(victim["id"])

                def poisoned(*args):
                    q, k, v = pre(*args)
                    k = k.clone()
                    k[row, 0, 0] = value
                    return q, k, v
                model.pre_attention = poisoned
                try:
                    return start(lay, mb)
                finally:
                    model.pre_attention = pre
        return start(lay, mb)
    runner._start_layer = start_layer


def engine_seq_ids(engine: Engine) -> list[int]:
    return [s.seq_id for s in engine.requests.running]


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 1e6])
def test_a_poisoned_sequence_fails_alone(engine, value):
    clean = run(engine, PROMPTS)
    poison(engine, 1, layer=1, value=value)
    outs = run(engine, PROMPTS)
    finals = [o[-1] for o in outs.values()]
    assert [f.finish_reason for f in finals] == ["length", "error", "length"]
    assert "attention" in finals[1].error
    clean_tokens = [tokens(o) for o in clean.values()]
    got = [tokens(o) for o in outs.values()]
    assert got[0] == clean_tokens[0] and got[2] == clean_tokens[2]     # the others are untouched
    assert engine.healthy and engine.backend.stats()["sequences"] == 0  # KV of all three freed
    engine.runner._start_layer = type(engine.runner)._start_layer.__get__(engine.runner)
    assert [tokens(o) for o in run(engine, PROMPTS).values()] == clean_tokens   # and it keeps serving


def test_a_backend_fault_fails_its_batch_not_the_engine(engine):
    clean = run(engine, PROMPTS)
    real, state = engine.backend.submit_decode, {"n": 0}

    def flaky(layer, seq_ids, q, k, v):
        state["n"] += 1
        if state["n"] == 5:                    # one call, mid-generation (2 layers a step)
            raise AttentionError("INTERNAL: worker fault")
        return real(layer, seq_ids, q, k, v)
    engine.backend.submit_decode = flaky
    outs = run(engine, PROMPTS)
    assert {o[-1].finish_reason for o in outs.values()} == {"error"}
    assert all("worker fault" in o[-1].error for o in outs.values())
    assert engine.healthy and engine.backend.stats()["sequences"] == 0
    engine.backend.submit_decode = real
    assert [tokens(o) for o in run(engine, PROMPTS).values()] == [tokens(o) for o in clean.values()]


def test_a_prefill_the_backend_refuses_fails_its_requests_not_the_engine(engine):
    """A non-finite key while a prompt is prefilled: the requests of that prefill end with an
    error, their KV is freed, and the engine serves the next ones."""
    clean = run(engine, PROMPTS)
    model, pre = engine.runner.model, engine.runner.model.pre_attention
    armed = [True]

    def poisoned(layer, h, rope):             # the first call: layer 0 of the three prompts' prefill
        q, k, v = pre(layer, h, rope)
        if armed.pop() if armed else False:
            k = k.clone()
            k[0, 0, 0] = float("nan")
        return q, k, v
    model.pre_attention = poisoned
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert {finals[i].finish_reason for i in ids} == {"error"}
    assert all("prefill" in finals[i].error for i in ids)
    assert engine.healthy and engine.backend.stats()["sequences"] == 0
    model.pre_attention = pre
    assert [tokens(o) for o in run(engine, PROMPTS).values()] == [tokens(o) for o in clean.values()]


def test_a_decode_result_that_never_comes_fails_its_rows_and_the_engine_goes_on(engine):
    """The backstop behind the backend's own deadlines: a call whose future never resolves."""
    from concurrent.futures import Future

    clean = run(engine, PROMPTS)
    backend, submit = engine.backend, engine.backend.submit_decode
    backend.decode_backstop_s = 0.2
    calls = {"n": 0}

    def hanging(*args):
        calls["n"] += 1
        return Future() if calls["n"] == 5 else submit(*args)
    backend.submit_decode = hanging
    try:
        outs = run(engine, PROMPTS)
    finally:
        backend.submit_decode = submit
    finals = [o[-1] for o in outs.values()]
    assert [f.finish_reason for f in finals] == ["error"] * 3          # one mini-batch: all three rows
    assert all("no attention result within 0.2 s" in f.error for f in finals)
    assert engine.healthy and backend.stats()["sequences"] == 0
    assert [tokens(o) for o in run(engine, PROMPTS).values()] == [tokens(o) for o in clean.values()]


def test_a_decode_step_that_loses_every_row_returns_no_logits_in_the_models_dtype(tiny_model_dir):
    """Every row lost: the step's (empty) decode logits join the re-prefill's in the model's
    dtype and on its device (a float32 CPU tensor here broke torch.cat on a GPU)."""
    e = Engine(EngineConfig(model=tiny_model_dir, attention="local", kernel_threads=1, dtype="bfloat16"))
    try:
        def all_lost(layer, seq_ids, q, k, v):
            future = Future()
            future.set_exception(SequencesLost(seq_ids, "test: the R-worker went away"))
            return future
        e.runner.backend.submit_decode = all_lost
        res = e.runner.decode([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0])
        assert sorted(res.lost) == [0, 1, 2, 3, 4] and res.rows == []
        assert res.logits.shape == (0, e.runner.model.args.vocab_size)
        assert res.logits.dtype == torch.bfloat16 and res.logits.device == e.runner.model.embed_tokens.weight.device
    finally:
        e.stop()
