"""SLS inside the real engine (tiny random model): the bound holds on the engine's own
trace, admissions are staggered, every request completes, and stats() reports the state."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig


@pytest.mark.parametrize("attention", ["local"])
def test_engine_under_sls(tiny_model_dir, attention):
    from fastdecode.engine import Engine, SamplingParams

    B, F, prompt, gen, w_lim = 8, 4, 5, 24, 100
    cfg = EngineConfig(model=tiny_model_dir, attention=attention, scheduler="sls", max_running=B, sls_f=F,
                       sls_w_lim=w_lim, kv_capacity_bytes=64 << 20)
    engine = Engine(cfg)
    try:
        ids = [engine.add_request([3 + (i + j) % 50 for j in range(prompt)],
                                  SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
               for i in range(20)]
        done = {}
        peak_seen = 0
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, 0)
                done[out.request_id] += len(out.token_ids)
            st = engine.stats()["scheduler"]
            assert st["policy"] == "sls" and st["w_lim"] == w_lim
            peak_seen = max(peak_seen, st["predicted_peak"])
        trace = list(engine.trace)
    finally:
        engine.stop()
    assert sorted(done) == sorted(ids) and set(done.values()) == {gen}
    assert 0 < peak_seen <= w_lim
    assert max(r["context_tokens"] for r in trace) <= w_lim
    admit_steps = [r["step"] for r in trace if r["num_prefill"]]
    # a micro-batch at most every F steps, except when the engine was idle before it
    assert all(b - a >= F for a, b in zip(admit_steps, admit_steps[1:]))
    # the bound actually bound: staggered by F, 8 sequences of up to 29 tokens need > 100
    assert max(r["batch_size"] for r in trace) < B


def test_engine_rejects_garbage_sls_config(tiny_model_dir):
    from fastdecode.engine import Engine

    with pytest.raises(ValueError, match="sls_f"):
        EngineConfig(model=tiny_model_dir, scheduler="sls", sls_f=0)
    with pytest.raises(ValueError, match="smaller than one request"):
        Engine(EngineConfig(model=tiny_model_dir, scheduler="sls", sls_w_lim=8, sls_target_len=64))


def test_request_longer_than_fixed_w_lim_is_refused_and_engine_keeps_serving(tiny_model_dir):
    from fastdecode.engine import Engine, InvalidRequestError, SamplingParams

    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", scheduler="sls", max_running=4,
                                 sls_f=2, sls_w_lim=40))
    try:
        with pytest.raises(InvalidRequestError, match="sls_w_lim=40"):
            engine.add_request([5] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
        outs = list(engine.generate([5] * 10, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    finally:
        engine.stop()
    assert outs[-1].finished and outs[-1].num_output_tokens == 20
