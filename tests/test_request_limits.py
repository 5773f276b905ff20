"""Per-request work is bounded (prompt size checked before tokenizing, stop strings limited),
and the engine says when it cannot serve (ready is False while no R-worker is live)."""
from __future__ import annotations

import time

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, InvalidRequestError, SamplingParams
from fastdecode.engine.sequence import MAX_CHARS_PER_TOKEN, MAX_STOP_CHARS, MAX_STOP_STRINGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    e = Engine(EngineConfig(model=tiny_model_dir, attention="torch", max_model_len=64))
    yield e
    e.stop()


def serves(engine: Engine) -> bool:
    outs = list(engine.generate("Hello", GREEDY))
    return outs[-1].finish_reason == "length" and engine.backend.stats()["sequences"] == 0


class NoTokenizing:
    """Stands in for the tokenizer: any call to encode fails the test."""

    def __init__(self, real) -> None:
        self.real = real

    def __call__(self, *args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_huge_text_prompt_refused_before_tokenizing(engine):
    real = engine.tokenizer
    engine.tokenizer = NoTokenizing(real)
    try:
        with pytest.raises(InvalidRequestError, match="characters"):
            engine.add_request("a" * (64 * MAX_CHARS_PER_TOKEN + 1), GREEDY)
    finally:
        engine.tokenizer = real
    with pytest.raises(InvalidRequestError, match="limit"):      # long, but not obviously: tokenized, then refused
        engine.add_request("hello " * 100, GREEDY)
    assert serves(engine)


def test_huge_token_list_refused_before_checking_each_id(engine):
    with pytest.raises(InvalidRequestError, match="limit"):
        engine.add_request([1] * 10**6 + ["x"], GREEDY)
    assert serves(engine)


@pytest.mark.parametrize("stop, match", [
    ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "at most 16 stop strings"),
    (["x" * (MAX_STOP_CHARS + 1)], "at most 256 characters"),
])
def test_stop_strings_limited(engine, stop, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("Hello", SamplingParams(max_tokens=4, stop=stop))
    assert not engine.has_unfinished() and serves(engine)


def test_stop_strings_at_the_limits_accepted(engine):
    stop = ["x" * MAX_STOP_CHARS] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]
    outs = list(engine.generate("Hello", SamplingParams(max_tokens=4, stop=stop, ignore_eos=True)))
    assert outs[-1].finish_reason in ("length", "stop")


def test_stop_string_across_tokens_found_in_the_tail(engine):
    free = "".join(o.text for o in engine.generate("The quick brown fox", SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True)))
    stop = free[2:9]                       # spans several tokens
    outs = list(engine.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                                      stop=["\x00" * 200, stop])))
    assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == free[:2]


def test_ready_follows_the_backend(engine, monkeypatch):
    assert engine.ready and engine.stats()["ready"]
    monkeypatch.setattr(engine.backend, "available", lambda: False)
    assert not engine.ready and not engine.stats()["ready"] and engine.healthy
    monkeypatch.undo()
    engine.healthy = False
    assert not engine.ready


def test_not_ready_while_every_rworker_is_down(tiny_model_dir, tmp_path):
    from fastdecode.ops.testing import local_fleet

    with local_fleet(1, tmp_path, kv_capacity="16M") as fleet:
        engine = Engine(EngineConfig(model=tiny_model_dir, attention="remote", rworkers=fleet.addresses,
                                     rworker_timeout_s=2.0))
        try:
            assert engine.ready
            fleet.kill(0)
            deadline = time.monotonic() + 30
            while engine.ready and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not engine.ready and engine.healthy
            fleet.restart(0)
            deadline = time.monotonic() + 30
            while not engine.ready and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.ready
        finally:
            engine.stop()
