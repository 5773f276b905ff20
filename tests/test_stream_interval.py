"""stream_interval: under load a streamed response carries several tokens (each send costs the
server about the same CPU whatever it carries). The first token and the last output go out at
once, nothing is lost, repeated or reordered, and no token waits longer than max_hold_s."""
import time

import pytest

from python_backend.config import build_configs
from python_backend.host import AUTO_STREAMS, MAX_STREAM_INTERVAL, EngineHost, auto_interval
from test_response_coalescing import GatedTransport, ManualEngine, out, submit_streams


def make_host(**kw):
    engine, transport = ManualEngine(), GatedTransport()
    transport.gate.set()
    host = EngineHost(engine, transport, make_params=lambda d: d, cancel_poll_s=60, metrics_interval_s=60, **kw)
    return host, engine, transport


def sent_by(transport, sender):
    with transport.cond:
        return [(o["text_output"][0].decode(), final) for s, o, _, final in transport.sent if s == sender]


def wait_finals(transport, count):
    with transport.cond:
        assert transport.cond.wait_for(lambda: sum(final for *_, final in transport.sent) == count, 30)


def feed(engine, host, rid, steps):
    """One output per step, each handed to the sender on its own (as the engine loop does)."""
    for i in range(1, steps + 1):
        engine.callbacks[rid](out(rid, [i], str(i), i == steps, "length" if i == steps else None, n=i))
        settle(host)


def settle(host):
    """Wait until the sender has drained what the engine handed it."""
    deadline = time.monotonic() + 10
    while not host._outputs.empty() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)


@pytest.mark.parametrize("interval, expected", [
    (1, ["1", "2", "3", "4", "5", "6", "7"]),
    (2, ["1", "23", "45", "67"]),
    (3, ["1", "234", "567"]),
    (10, ["1", "234567"])])
def test_a_fixed_interval_sends_the_first_token_alone_then_groups_and_the_rest_at_the_end(interval, expected):
    host, engine, transport = make_host(stream_interval=interval)
    try:
        (rid,), = submit_streams(host, engine, ["s"])
        feed(engine, host, rid, 7)
        wait_finals(transport, 1)
        mine = sent_by(transport, "s")
        assert [text for text, _ in mine] == expected
        assert [final for _, final in mine] == [False] * (len(expected) - 1) + [True]
        assert host.live_count() == 0 and not host._held
    finally:
        host.shutdown()


def test_a_first_token_of_no_text_goes_out_at_once_as_an_empty_response_that_counts_it():
    """A first token of no text (a special token, half a character) still goes out at once: the
    client sees its first token when the engine has it (TTFT), and the token is counted there."""
    host, engine, transport = make_host(stream_interval=8)
    try:
        (rid,), = submit_streams(host, engine, ["s"])
        engine.callbacks[rid](out(rid, [1], "", n=1))
        settle(host)
        assert sent_by(transport, "s") == [("", False)]
        engine.callbacks[rid](out(rid, [2], "a", n=2))
        for i in range(3, 6):
            engine.callbacks[rid](out(rid, [i], "b", n=i))
        settle(host)
        assert sent_by(transport, "s") == [("", False)]            # then responses carry 8 tokens again
        engine.callbacks[rid](out(rid, [6], "c", True, "length", n=6))
        wait_finals(transport, 1)
        assert sent_by(transport, "s") == [("", False), ("abbbc", True)]
    finally:
        host.shutdown()


def test_the_builder_counts_a_first_token_of_no_text_in_its_empty_response_and_sends_no_token_for_nothing():
    from python_backend.request import GenerateRequest
    from python_backend.response import ResponseBuilder

    request = GenerateRequest("p", stream=True, return_num_output_tokens=True)
    b = ResponseBuilder(request)
    assert b.on_output(out("r", [], "", n=0), first=True) == (None, None)         # no token yet: nothing to send
    sent, error = b.on_output(out("r", [1], "", n=1), first=True)
    assert error is None and sent["text_output"].tolist() == [b""] and sent["num_output_tokens"].tolist() == [1]
    assert b.on_output(out("r", [2], "", n=2)) == (None, None)                  # later: only text goes out
    sent, _ = b.on_output(out("r", [3], "ab", n=3))
    assert sent["text_output"].tolist() == [b"ab"] and sent["num_output_tokens"].tolist() == [2]
    whole = ResponseBuilder(GenerateRequest("p", return_num_output_tokens=True))
    assert whole.on_output(out("r", [1], "", n=1), first=True) == (None, None)  # not streamed: one response at the end


def test_auto_streams_every_token_up_to_its_threshold_and_pairs_beyond():
    for streams, expected in ((AUTO_STREAMS, ["1", "2", "3", "4", "5"]), (AUTO_STREAMS + 1, ["1", "23", "45"])):
        host, engine, transport = make_host()
        try:
            senders = [f"s{i}" for i in range(streams)]
            ids = [rids[0] for rids in submit_streams(host, engine, senders)]
            for step in range(1, 6):
                for rid in ids:
                    engine.callbacks[rid](out(rid, [step], str(step), step == 5, "length" if step == 5 else None,
                                              n=step))
                settle(host)
            wait_finals(transport, streams)
            for sender in senders:
                assert [text for text, _ in sent_by(transport, sender)] == expected, (streams, sender)
        finally:
            host.shutdown()


def test_a_held_token_goes_out_after_max_hold_s_when_no_more_come():
    host, engine, transport = make_host(stream_interval=4, max_hold_s=0.2)
    try:
        (rid,), = submit_streams(host, engine, ["s"])
        engine.callbacks[rid](out(rid, [1], "a", n=1))
        settle(host)
        engine.callbacks[rid](out(rid, [2], "b", n=2))      # then the request pauses (preempted, say)
        settle(host)
        assert sent_by(transport, "s") == [("a", False)]
        t = time.monotonic()
        with transport.cond:
            assert transport.cond.wait_for(lambda: len(transport.sent) == 2, 5)
        assert 0.1 <= time.monotonic() - t < 2.0
        assert sent_by(transport, "s") == [("a", False), ("b", False)]
        engine.callbacks[rid](out(rid, [3], "c", True, "length", n=3))
        wait_finals(transport, 1)
        assert sent_by(transport, "s") == [("a", False), ("b", False), ("c", True)]
    finally:
        host.shutdown()


def test_held_tokens_go_out_with_the_step_whose_next_wait_would_pass_max_hold_s(monkeypatch):
    """Tokens that come slower than stream_interval allows within max_hold_s go out with a step's
    output (carrying its token, on the send threads), before max_hold_s, not by the timer."""
    import types

    import python_backend.host as host_module
    clock = [100.0]
    monkeypatch.setattr(host_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    host, engine, transport = make_host(stream_interval=8, max_hold_s=1.0)
    try:
        (rid,), = submit_streams(host, engine, ["s"])
        for i, at in enumerate((100.0, 100.3, 100.6, 100.9), start=1):
            clock[0] = at
            engine.callbacks[rid](out(rid, [i], str(i), n=i))
            settle(host)
        assert sent_by(transport, "s") == [("1", False)]    # 2 has waited 0.6 s: another 0.3 s is within 1 s
        clock[0] = 101.2                                    # 2 has waited 0.9 s: the next token would be late
        engine.callbacks[rid](out(rid, [5], "5", n=5))
        settle(host)
        assert sent_by(transport, "s") == [("1", False), ("2345", False)]
        assert not host._held
        engine.callbacks[rid](out(rid, [6], "6", True, "length", n=6))
        wait_finals(transport, 1)
        assert sent_by(transport, "s") == [("1", False), ("2345", False), ("6", True)]
    finally:
        host.shutdown()


def test_tokens_of_many_streams_released_by_the_timer_all_go_out_once_and_in_order():
    host, engine, transport = make_host(stream_interval=8, max_hold_s=0.2)
    try:
        senders = [f"s{i}" for i in range(20)]
        ids = [rids[0] for rids in submit_streams(host, engine, senders)]
        for step in (1, 2, 3):
            for rid in ids:
                engine.callbacks[rid](out(rid, [step], str(step), n=step))
            settle(host)
        with transport.cond:       # then no more tokens come: the timer sends "23" of every stream
            assert transport.cond.wait_for(lambda: len(transport.sent) == 40, 5)
        for rid in ids:
            engine.callbacks[rid](out(rid, [4], "4", True, "length", n=4))
        wait_finals(transport, 20)
        for sender in senders:
            assert sent_by(transport, sender) == [("1", False), ("23", False), ("4", True)], sender
        assert not host._held
    finally:
        host.shutdown()


def test_a_request_that_ends_while_tokens_wait_sends_them_with_its_end():
    host, engine, transport = make_host(stream_interval=8, max_hold_s=60)
    try:
        (rid,), = submit_streams(host, engine, ["s"])
        engine.callbacks[rid](out(rid, [1], "a", n=1))
        settle(host)
        engine.callbacks[rid](out(rid, [2], "b", n=2))
        settle(host)
        engine.callbacks[rid](out(rid, [], "", True, "stop", n=2))       # a stop string ended it
        wait_finals(transport, 1)
        assert sent_by(transport, "s") == [("a", False), ("b", True)]
        assert not host._held
    finally:
        host.shutdown()


def test_choices_of_one_request_are_held_apart():
    host, engine, transport = make_host(stream_interval=2)
    try:
        (rids,) = submit_streams(host, engine, ["s"], n=2)
        for step in range(1, 4):
            for rid in rids:
                engine.callbacks[rid](out(rid, [step], f"{rid[-1]}{step}", step == 3,
                                          "length" if step == 3 else None, n=step))
            settle(host)
        wait_finals(transport, 1)
        with transport.cond:
            texts = [list(o["text_output"]) for s, o, _, _ in transport.sent]
        joined = ["".join(t[i].decode() for t in texts) for i in range(2)]
        assert joined == ["010203", "111213"]           # every token of each choice, in order
        assert len(texts) == 4                          # per choice: its first token, then 2 and 3 with the end
        assert not host._held
    finally:
        host.shutdown()


def test_auto_interval_doubles_for_every_twice_the_requests_up_to_eight():
    assert [auto_interval(n) for n in (0, 1, 16, 17, 32, 33, 64, 65, 128, 129, 1024, 10**6)] == \
        [1, 1, 1, 2, 2, 4, 4, 8, 8, 8, 8, 8]


def test_max_hold_parameter():
    assert build_configs({})[1].max_hold_s == 2.0
    assert build_configs({"max_hold_ms": "1500"})[1].max_hold_s == 1.5
    for bad in ("0", "-5", "x", "1.5", ""):
        with pytest.raises(ValueError, match="max_hold_ms"):
            build_configs({"max_hold_ms": bad})


def test_stream_interval_parameter():
    assert build_configs({})[1].stream_interval == 0
    assert build_configs({"stream_interval": "auto"})[1].stream_interval == 0
    assert build_configs({"stream_interval": "3"})[1].stream_interval == 3
    assert build_configs({"stream_interval": str(MAX_STREAM_INTERVAL)})[1].stream_interval == MAX_STREAM_INTERVAL
    for bad in ("0", "-1", "x", "1.5", str(MAX_STREAM_INTERVAL + 1), "", "AUTO", "2 tokens", "1e3"):
        with pytest.raises(ValueError, match="stream_interval"):
            build_configs({"stream_interval": bad})
