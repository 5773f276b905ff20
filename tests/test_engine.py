"""Engine behaviour on a tiny model: API, errors, cancellation, streaming, faults, trace."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from fastdecode.attention.base import AttentionError, SequencesLost
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.config import EngineConfig
from fastdecode.engine import (Engine, EngineOverloadedError, InvalidRequestError, RequestOutput,
                               SamplingParams)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# The pure-torch reference and the local C++ kernel (fp16 KV): the key behaviour tests run on both.
BACKENDS = [pytest.param("torch", id="torch"), pytest.param("local", id="local")]


def make_engine(model_dir: str, attention: str = "torch", **overrides) -> Engine:
    if attention == "local":      # one kernel thread and a small pool: tiny batches, many engines
        overrides = {"kernel_threads": 1, "kv_capacity_bytes": 16 << 20, **overrides}
    return Engine(EngineConfig(model=model_dir, attention=attention, **overrides))


@pytest.fixture
def engine(tiny_model_dir):
    e = make_engine(tiny_model_dir, max_waiting=64)
    yield e
    e.stop()


@pytest.fixture(params=BACKENDS)
def any_engine(request, tiny_model_dir):
    """The engine over each attention backend."""
    e = make_engine(tiny_model_dir, request.param, max_waiting=64)
    assert e.config.attention == request.param
    yield e
    e.stop()


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_generate_streams_and_finishes_with_length(engine):
    outs = list(engine.generate("The quick brown fox", GREEDY))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 12 == outs[-1].num_output_tokens
    assert all(not o.finished for o in outs[:-1])
    text = "".join(o.text for o in outs)
    assert text == engine.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
    assert engine.backend.stats()["sequences"] == 0


def test_continuous_batching_matches_alone(any_engine):
    engine = any_engine
    alone = tokens_of(list(engine.generate("Hello, world!", GREEDY)))
    a = engine.add_request("The quick brown fox", GREEDY)
    early = [o for _ in range(3) for o in engine.step()]
    b = engine.add_request("Hello, world!", GREEDY)       # joins a running batch
    outs = drain(engine)
    assert tokens_of(outs[b]) == alone
    assert outs[a][-1].finish_reason == "length" and len(tokens_of(early + outs[a])) == 12


@pytest.mark.parametrize("prompt, params, match", [
    ("", {"max_tokens": 4}, "empty"),
    ([], {"max_tokens": 4}, "empty"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"max_tokens": -1}, "max_tokens"),
    ("hi", {"top_p": 0}, "top_p"),
    ("hi", {"top_p": 1.01}, "top_p"),
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"stop": 3}, "stop"),
    ("hi", {"stop": [None]}, "stop"),
    ("hi", {"frobnicate": 1}, "unknown"),
    ([1, 2, 10**9], {}, "token ids"),
    ([1, "a"], {}, "token ids"),
    (42, {}, "prompt must be"),
    (None, {}, "prompt must be"),
])
def test_bad_requests_get_clear_error_and_engine_keeps_serving(any_engine, prompt, params, match):
    engine = any_engine
    good = engine.add_request("The quick brown fox", GREEDY)
    first = engine.step()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    outs = drain(engine)
    assert outs[good][-1].finish_reason == "length" and len(tokens_of(first + outs[good])) == 12
    assert engine.healthy and engine.backend.stats()["sequences"] == 0


def test_prompt_longer_than_model_limit(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", max_model_len=32))
    try:
        with pytest.raises(InvalidRequestError, match="limit"):
            engine.add_request(list(range(3, 35)), GREEDY)
        # a prompt that fits stops at the limit with "length"
        outs = list(engine.generate(list(range(3, 30)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)))
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 32 - 27
    finally:
        engine.stop()


def test_queue_limit_overloaded(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", max_waiting=3))
    try:
        for _ in range(3):
            engine.add_request("hi", GREEDY)
        with pytest.raises(EngineOverloadedError):
            engine.add_request("hi", GREEDY)
        drain(engine)
        engine.add_request("hi", GREEDY)          # room again
    finally:
        engine.stop()


def test_duplicate_request_id_rejected(engine):
    engine.add_request("hi", GREEDY, request_id="x")
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("hi", GREEDY, request_id="x")


def test_abort_frees_kv_at_once(any_engine):
    engine = any_engine
    a = engine.add_request("The quick brown fox", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    b = engine.add_request("Hello", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    first = engine.step() + engine.step()
    assert engine.backend.stats()["sequences"] == 2
    assert engine.abort(a)
    assert engine.backend.stats()["sequences"] == 1      # freed now, not at the next step
    assert not engine.abort(a)                            # already finished
    outs = drain(engine)
    assert outs[a][-1].finish_reason == "cancelled"
    assert outs[b][-1].finish_reason == "length"
    assert engine.backend.stats()["sequences"] == 0 and engine.backend.stats()["kv_tokens"] == 0


def test_abort_waiting_request(engine):
    got = []
    a = engine.add_request("hi", GREEDY, on_output=got.append)
    assert engine.abort(a)
    assert [(o.finish_reason, o.num_output_tokens) for o in got] == [("cancelled", 0)]   # told at once
    assert not engine.has_unfinished()
    assert [o.request_id for o in engine.step()] == [a]      # and a synchronous caller sees it at the next step


def test_stop_token_ids_and_eos(engine):
    free = tokens_of(list(engine.generate("The quick brown fox", GREEDY)))
    stop_at = free[4]
    first = free.index(stop_at)
    outs = list(engine.generate("The quick brown fox",
                                SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at], ignore_eos=True)))
    assert outs[-1].finish_reason == "stop"
    assert tokens_of(outs) == free[: first + 1]          # the stop token is reported, its text is not
    eos = engine.tokenizer.eos_token_id
    assert engine.eos_token_ids == {eos}


def test_stop_string_trimmed_like_vllm(engine):
    outs = list(engine.generate("The quick brown fox", GREEDY))
    full = "".join(o.text for o in outs)
    assert len(full) > 6
    stop = full[3:6]
    outs = list(engine.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0, stop=[stop, "\x00zz"],
                                                                      ignore_eos=True)))
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_text_never_splits_utf8(engine):
    # force multi-byte characters through byte-level tokens one at a time
    tok = engine.tokenizer
    ids = tok("Привет 你好 🙂", add_special_tokens=False)["input_ids"]
    from fastdecode.engine.detokenizer import IncrementalDetokenizer
    d = IncrementalDetokenizer(tok)
    byte_ids = [t for t in ids]
    pieces = [d.push(t) for t in byte_ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(byte_ids)
    assert all("\ufffd" not in p for p in pieces)


def test_seeded_sampling_reproducible_in_engine(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, ignore_eos=True)
    a = tokens_of(list(engine.generate("Hello", p)))
    engine.add_request("The quick brown fox", SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    rid = engine.add_request("Hello", p)
    b = tokens_of(drain(engine)[rid])
    assert a == b


def test_background_loop_callbacks_and_stats(engine):
    engine.start()
    done = threading.Event()
    got: list[RequestOutput] = []

    def on_output(o):
        got.append(o)
        if o.finished:
            done.set()

    engine.add_request("Hello", GREEDY, on_output=on_output)
    assert done.wait(60)
    assert got[-1].finish_reason == "length" and sum(len(o.token_ids) for o in got) == 12
    streamed = list(engine.generate("Hello", GREEDY))      # generate() with the loop running
    assert tokens_of(streamed) == [t for o in got for t in o.token_ids]
    s = engine.stats()
    assert s["healthy"] and s["running"] == 0 and s["waiting"] == 0 and s["tokens"] >= 24
    assert s["kv"]["sequences"] == 0


def test_trace_records(tiny_model_dir, tmp_path):
    path = tmp_path / "trace.jsonl"
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", trace_path=str(path)))
    try:
        list(engine.generate("Hello", GREEDY))
    finally:
        engine.stop()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 12 == len(engine.trace)
    keys = {"step", "time", "batch_size", "num_prefill", "context_tokens", "s_time", "r_time", "s_wait", "r_wait",
            "step_time"}
    assert all(keys <= set(r) for r in lines)
    assert lines[0]["num_prefill"] == 1 and lines[1]["num_prefill"] == 0 and lines[1]["batch_size"] == 1
    assert all(r["step_time"] > 0 and r["r_time"] >= 0 for r in lines)


def test_crash_marks_unhealthy_and_ends_requests_with_error(engine):
    """A fault in the S-Part's step kills the loop (an attention failure only ends its requests:
    tests/test_attention_failures.py)."""
    def boom(*args):
        raise RuntimeError("boom")
    engine.runner.model.logits = boom
    engine.start()
    outs = list(engine.generate("Hello", GREEDY))
    assert outs[-1].finish_reason == "error" and "boom" in outs[-1].error
    deadline = time.time() + 10
    while engine.healthy and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.healthy
    with pytest.raises(RuntimeError):
        engine.add_request("Hello", GREEDY)


class LosingBackend(TorchAttention):
    """Loses the KV of `victims` once, at `layer` of decode step `at_call`, like a dead R-worker."""

    def __init__(self, spec, victims, at_call=3, layer=1, with_output=True, fail_reopen=False):
        super().__init__(spec)
        self.victims, self.at_call, self.layer = set(victims), at_call, layer
        self.with_output, self.fail_reopen = with_output, fail_reopen
        self.calls = 0
        self.fired = False

    def submit_decode(self, layer, seq_ids, q, k, v):
        if layer == self.layer:
            self.calls += 1
        hit = [s for s in seq_ids if s in self.victims]
        if not self.fired and layer == self.layer and self.calls >= self.at_call and hit:
            self.fired = True
            out = super().submit_decode(layer, seq_ids, q, k, v).result()
            for s in hit:                      # their KV is gone
                self.k.pop(s)
                self.v.pop(s)
            fut = Future()
            fut.set_exception(SequencesLost(hit, "worker died", out if self.with_output else None))
            return fut
        return super().submit_decode(layer, seq_ids, q, k, v)

    def open(self, seq_ids):
        if self.fired and self.fail_reopen:
            raise AttentionError("no R-workers left")
        return super().open(seq_ids)


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("with_output", [True, False])
def test_lost_sequences_rebuilt_output_identical(tiny_model_dir, minibatches, with_output):
    prompts = ["The quick brown fox", "Hello, world!", "def f(x):", "FastDecode splits"]
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True), GREEDY]
    # float32: a rebuilt sequence's prefill and the clean run's decode steps agree to the bit only there
    config = EngineConfig(model=tiny_model_dir, attention="torch", num_minibatches=minibatches, dtype="float32")

    def run(backend_factory):
        engine = Engine(config)
        engine.runner.min_minibatch = 1           # split even this small batch
        if backend_factory:
            engine.backend = engine.runner.backend = backend_factory(engine.spec)
        try:
            rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            outs = drain(engine)
            assert engine.backend.stats()["sequences"] == 0
            return [tokens_of(outs[r]) for r in rids], [outs[r][-1].finish_reason for r in rids], engine.backend
        finally:
            engine.stop()

    clean, _, _ = run(None)
    faulty, reasons, backend = run(lambda spec: LosingBackend(spec, victims={2, 3}, with_output=with_output))
    assert backend.fired
    assert faulty == clean and reasons == ["length"] * 4


def test_lost_sequences_without_workers_end_with_error(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch"))
    engine.backend = engine.runner.backend = LosingBackend(engine.spec, victims={1}, fail_reopen=True)
    try:
        a = engine.add_request("The quick brown fox", GREEDY)
        b = engine.add_request("Hello", GREEDY)
        outs = drain(engine)
        assert outs[a][-1].finish_reason == "error" and "no R-workers left" in outs[a][-1].error
        assert outs[b][-1].finish_reason == "length" and len(tokens_of(outs[b])) == 12
        assert engine.healthy
        # still no workers: a new request ends with a clear error, the engine stays up
        outs = list(engine.generate("Hello", GREEDY))
        assert outs[-1].finish_reason == "error" and "no R-workers left" in outs[-1].error
        assert engine.healthy
    finally:
        engine.stop()


class RecordingBackend(TorchAttention):
    """Futures complete only when waited for, so the call order shows the pipeline."""

    def __init__(self, spec):
        super().__init__(spec)
        self.events = []

    def submit_decode(self, layer, seq_ids, q, k, v):
        self.events.append(("submit", layer, tuple(seq_ids)))
        inner = super().submit_decode(layer, seq_ids, q, k, v)
        events = self.events

        class Lazy(Future):
            def result(self, timeout=None):
                events.append(("wait", layer, tuple(seq_ids)))
                return inner.result()

        fut = Lazy()
        fut.set_result(None)
        return fut


def test_two_minibatches_ping_pong(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch", num_minibatches=2))
    engine.runner.min_minibatch = 1
    rec = RecordingBackend(engine.spec)
    engine.backend = engine.runner.backend = rec
    try:
        for p in ["a b", "c d", "e f", "g h"]:
            engine.add_request(p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        drain(engine)
    finally:
        engine.stop()
    a, b = (1, 2), (3, 4)
    layers = engine.args.num_layers
    expected = [("submit", 0, a), ("submit", 0, b)]
    for i in range(1, layers):
        expected += [("wait", i - 1, a), ("submit", i, a), ("wait", i - 1, b), ("submit", i, b)]
    expected += [("wait", layers - 1, a), ("wait", layers - 1, b)]
    assert rec.events == expected      # B's attention is in flight while A's S-Part runs, and back


def test_on_a_thread_of_its_own_returns_raises_and_leaves_no_openmp_pool(tmp_path):
    """The engine loads its model on a thread that ends (fastdecode.engine.engine): a thread that
    ran a parallel torch op keeps an OpenMP pool, and two pools on all the cores made every op of
    the engine's loop wait for a sleeping worker. Checked in a fresh process: a pool left on the
    calling thread shows as OpenMP worker threads that stay after the call."""
    import subprocess
    import sys

    from fastdecode.engine.engine import on_a_thread_of_its_own

    assert on_a_thread_of_its_own(lambda a, b: (a + b, threading.current_thread().name), 1, 2) == \
        (3, "fastdecode-load")
    with pytest.raises(ZeroDivisionError):
        on_a_thread_of_its_own(lambda: 1 / 0)
    script = """
import os, threading, time, torch
from fastdecode.engine.engine import on_a_thread_of_its_own
torch.set_num_threads(2)
work = lambda: (torch.randn(512, 512) @ torch.randn(512, 512)).sum()
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
on_a_thread_of_its_own(work)
deadline = time.monotonic() + 30          # the ended pool's workers exit on their own time
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
after_thread = threads()
work()
time.sleep(0.5)
print(before, after_thread, threads())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after_thread, after_main = map(int, out.stdout.split())
    assert after_thread == before, out.stdout
    assert after_main > before, out.stdout      # the same work on the calling thread leaves its pool


def test_detokenizer_fast_path_decodes_as_the_tokenizer_does(engine):
    """The fast path (the Rust tokenizer's decode) against tokenizer.decode: special tokens skipped,
    spaces and multi-byte characters kept, on ids from the whole vocabulary."""
    import functools

    from fastdecode.engine.detokenizer import decoder_of
    tok = engine.tokenizer
    fast = decoder_of(tok)
    assert isinstance(fast, functools.partial) and fast.func == tok.backend_tokenizer.decode
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (1, 2, 3, 7, 40) for _ in range(40)]
    samples += [tok(" héllo wörld, 日本語 🙂 . , !")["input_ids"], [tok.eos_token_id, 42, tok.eos_token_id], []]
    for ids in samples:
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def spy_logits(engine):
    """Every LM-head call of the engine as (data_ptr, close to a fresh plain call, out given)."""
    model, seen = engine.model, []
    real = model.logits

    def spy(h, out=None):
        got = real(h, out=out)
        seen.append((got.data_ptr(), torch.allclose(got, real(h), rtol=1e-5, atol=1e-5), out is not None))
        return got
    model.logits = spy
    return seen, real


def test_decode_logits_reuse_one_buffer_and_equal_a_fresh_lm_head(engine, monkeypatch):
    """Logits bigger than malloc maps afresh go into memory kept from step to step (a fresh 50 MB
    tensor a step was page-faulted in anew); every step's values are those of the plain LM head."""
    from fastdecode.engine import model_runner

    monkeypatch.setattr(model_runner, "FRESH_MAP_BYTES", 0)      # the tiny model's logits count as big
    runner, model = engine.runner, engine.model
    seen, real = spy_logits(engine)
    try:
        for i in range(3):
            engine.add_request(f"prompt {i} " * (i + 1), GREEDY, request_id=f"r{i}")
        drain(engine)
    finally:
        model.logits = real
    decodes = [s for s in seen if s[2]]
    assert len(decodes) >= GREEDY.max_tokens - 1
    assert all(same for _, same, _ in seen)
    assert len({ptr for ptr, _, _ in decodes}) == 1
    assert runner._logits is not None and runner._logits.shape[0] % 64 == 0


def test_small_decode_logits_come_from_the_model_lm_head(engine):
    """Below malloc's mmap threshold no buffer is kept: the model's (packed) LM head is faster."""
    seen, real = spy_logits(engine)
    try:
        engine.add_request("a small batch", GREEDY, request_id="small")
        drain(engine)
    finally:
        engine.model.logits = real
    assert seen and not any(out for _, _, out in seen) and all(same for _, same, _ in seen)
    assert engine.runner._logits is None
