"""Extreme sampling values: the ones float32 cannot hold are refused with the reason; the ones it
can hold sample without failing the step (one such request once took the engine down)."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, InvalidRequestError, SamplingParams


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e300, 3.5e38])
def test_temperatures_float32_cannot_hold_are_refused(temperature):
    with pytest.raises((ValueError, InvalidRequestError), match="float32"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extreme_but_valid_values_sample_and_the_engine_keeps_serving(tiny_model_dir, one_torch_thread, dtype):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", dtype=dtype))
    extremes = [dict(temperature=1.2e-38), dict(temperature=3.0e38), dict(temperature=1.0, top_p=5e-324),
                dict(temperature=1.0, min_p=1.0), dict(temperature=0.7, repetition_penalty=1e-300),
                dict(temperature=0.7, repetition_penalty=1e300, frequency_penalty=2.0, presence_penalty=-2.0)]
    try:
        outs = {}
        for i, extra in enumerate(extremes):
            engine.add_request([5, 9, 13], SamplingParams(max_tokens=4, ignore_eos=True, seed=i, **extra),
                               request_id=str(i), on_output=lambda o: outs.__setitem__(o.request_id, o))
        while engine.has_unfinished():
            engine.step()
        assert engine.healthy
        assert all(outs[str(i)].finish_reason == "length" and outs[str(i)].num_output_tokens == 4
                   for i in range(len(extremes))), {k: (o.finish_reason, o.error) for k, o in outs.items()}
    finally:
        engine.stop()


def test_a_row_the_sampler_fails_on_ends_alone(tiny_model_dir, one_torch_thread, monkeypatch):
    """Whatever a sampler failure is, it ends the request whose row caused it, not the step."""
    import fastdecode.engine.postprocess as postprocess

    real = postprocess.sample

    def picky(logits, params, *args, **kwargs):
        if any(p.temperature == 0.123 for p in params):
            raise RuntimeError("sample_rows: temperatures must be finite and > 0")
        return real(logits, params, *args, **kwargs)

    monkeypatch.setattr(postprocess, "sample", picky)
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch"))
    try:
        outs = {}
        for rid, t in (("good", 0.0), ("bad", 0.123), ("also-good", 0.8)):
            engine.add_request([5, 9, 13], SamplingParams(max_tokens=5, temperature=t, ignore_eos=True, seed=1),
                               request_id=rid, on_output=lambda o: outs.__setitem__(o.request_id, o))
        while engine.has_unfinished():
            engine.step()
        assert engine.healthy
        assert outs["bad"].finish_reason == "error" and "temperatures must be finite" in outs["bad"].error
        assert outs["good"].finish_reason == outs["also-good"].finish_reason == "length"
        assert outs["good"].num_output_tokens == outs["also-good"].num_output_tokens == 5
    finally:
        engine.stop()
