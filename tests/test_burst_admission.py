"""An idle engine admits a burst of requests together (burst_gap_ms, burst_window_ms)."""
from __future__ import annotations

import threading
import time

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, SamplingParams
from python_backend.config import build_configs

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model_dir: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=model_dir, attention="torch", max_waiting=64, **overrides))


@pytest.fixture
def engine(tiny_model_dir):
    e = make_engine(tiny_model_dir, burst_gap_ms=1000, burst_window_ms=5000, max_running=4)
    yield e
    e.stop()


def test_hold_follows_the_last_arrival_and_ends_at_the_window(engine):
    assert engine._burst_hold() == 0.0                         # nothing waits
    engine.add_request("a", GREEDY)
    assert 0.5 < engine._burst_hold() <= 1.0                   # a gap from the only arrival
    first = engine.requests.waiting[0]
    first.arrival -= 4.5                                       # the window is 5 s after the first
    engine.add_request("b", GREEDY)
    assert 0.2 < engine._burst_hold() <= 0.5
    first.arrival -= 1.0
    assert engine._burst_hold() == 0.0                         # window over: admit now


def test_no_hold_once_a_batch_waits_or_would_run(engine):
    for i in range(4):                                         # max_running of them: a full batch
        engine.add_request(f"p{i}", GREEDY)
    assert engine._burst_hold() == 0.0
    engine.step()                                              # all four prefilled, now running
    assert len(engine.requests.running) == 4
    engine.add_request("late", GREEDY)
    assert engine._burst_hold() == 0.0                         # no room: admitted when a slot frees


def test_a_burst_that_began_with_a_running_request_is_waited_for_but_older_requests_never_wait(tiny_model_dir):
    e = make_engine(tiny_model_dir, burst_gap_ms=1000, burst_window_ms=5000, max_running=8)
    try:
        e.add_request("first", GREEDY)
        e.step()                                               # prefilled alone (the rest came late)
        assert len(e.requests.running) == 1
        e.add_request("second", GREEDY)
        assert 0.5 < e._burst_hold() <= 1.0                    # the same burst: wait for the rest
        e.requests.running[0].arrival -= 4.5
        assert 0.2 < e._burst_hold() <= 0.5                    # ... until the window after the first
        e.requests.running[0].arrival -= 1.0
        assert e._burst_hold() == 0.0                          # a request decoding for longer never waits
    finally:
        e.stop()


@pytest.mark.parametrize("settings", [dict(burst_gap_ms=0), dict(burst_window_ms=0)])
def test_zero_turns_it_off(tiny_model_dir, settings):
    e = make_engine(tiny_model_dir, **settings)
    try:
        e.add_request("a", GREEDY)
        assert e._burst_hold() == 0.0
    finally:
        e.stop()


def test_the_loop_prefills_a_burst_in_one_step(engine):
    engine.start()
    done = [threading.Event() for _ in range(3)]

    def finished(i):
        return lambda out: out.finished and done[i].set()

    for i in range(3):                                         # 0.2 s apart: under the 1 s gap
        engine.add_request(f"burst {i}", GREEDY, on_output=finished(i))
        if i < 2:
            time.sleep(0.2)
            assert engine.stats()["steps"] == 0                # still gathering
    assert all(d.wait(60) for d in done)
    first = engine.trace[0]
    assert first["num_prefill"] == 3 and first["batch_size"] == 3


@pytest.mark.parametrize("key", ["burst_gap_ms", "burst_window_ms"])
@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "1e999", "", "5ms"])
def test_garbage_values_are_refused_with_the_setting_named(key, value):
    with pytest.raises(ValueError, match=key):
        EngineConfig.from_dict({key: value})
    with pytest.raises(ValueError, match=key):                 # as a Triton model parameter
        build_configs({key: value})


def test_triton_parameter_reaches_the_engine_config():
    engine, _ = build_configs({"burst_gap_ms": "2.5", "burst_window_ms": "250"})
    assert (engine.burst_gap_ms, engine.burst_window_ms) == (2.5, 250.0)
    assert EngineConfig().burst_gap_ms == 5.0 and EngineConfig().burst_window_ms == 1000.0
