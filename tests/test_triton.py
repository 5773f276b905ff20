"""A real tritonserver on free ports with a tiny model and two local R-worker processes.

One server for the module (start ~10 s); the tests that reload the model (crash drill, unload,
scheduler=sls, int4 KV) run last. The R-workers need the C++ kernel: without it the module errors.
"""
from __future__ import annotations

import json
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fastdecode.ops import client
from fastdecode.ops.triton import TritonServer, log_tail, tritonserver_binary, write_model_repository

from triton_helpers import (MODEL, GREEDY, generate, generate_concurrently, text, http_post, kv_held,
                             wait_for, settled_metrics, metric_values, total, by_label, STEP_PARTS,
                             raw_stream, tensor, bytes_tensor, model_state, stub_processes, http_json,
                             load_with_config, reload_with_config)


pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not tritonserver_binary().exists(),
                                 reason=f"tritonserver binary missing ({tritonserver_binary()}): "
                                        "pip install nvidia-pytriton==0.7.0")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two local R-worker processes (the kernel store)."""
    from fastdecode.ops.fleet import LocalFleet

    with LocalFleet(2, tmp_path_factory.mktemp("rworkers"), kv_capacity="64M", threads=1) as f:
        yield f


@pytest.fixture(scope="module")
def server(tiny_model_dir, fleet, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("triton")
    crash_flag = run_dir / "crash-engine"
    repo = write_model_repository(run_dir / "model_repository", {
        "model": tiny_model_dir, "rworkers": ",".join(fleet.addresses), "max_running": "64",
        "metrics_interval_ms": "100", "cancel_poll_ms": "20", "fault_step_error_file": str(crash_flag)})
    # exit timeout 3 s: only a bound for a failing run. A gRPC client that cancels its stream as the
    # final response is written makes Triton 2.51 keep the model UNLOADING (fastdecode.ops.client.generate
    # no longer does that); the server would then wait out the timeout and exit non-zero.
    with TritonServer(repo, run_dir, exit_timeout_s=3) as s:
        s.crash_flag = crash_flag
        yield s
        pid = s.proc.pid
    # the clean path, not the safety net: the server exited 0 on SIGTERM with nothing left to kill
    assert s.clean_exit, f"tritonserver did not exit cleanly; log {s.log_path}:\n{log_tail(s.log_path)}"
    assert "Exit timeout expired" not in s.log_path.read_text()
    # nothing outlives the server: no stub process, no shared-memory region
    from fastdecode.ops.procs import group_members

    assert group_members(pid) == []
    assert not [p for p in Path("/dev/shm").glob("triton_python_backend_shm_region*") if _created_by(p, run_dir)]


def _created_by(shm: Path, run_dir: Path) -> bool:
    """Shared-memory regions carry no owner; ours are the ones younger than this server's run dir."""
    return shm.stat().st_mtime >= run_dir.stat().st_mtime


# ---- happy paths

PROMPT = "Hello, world! Привет, мир! 🙂"


def test_grpc_streaming_equals_non_streaming(server):
    streamed = generate(server, PROMPT, return_finish_reason=True, return_num_output_tokens=True,
                        return_num_input_tokens=True)
    assert len(streamed) > 1
    whole = generate(server, PROMPT, stream=False, exclude_input_in_output=True, return_num_output_tokens=True)
    assert len(whole) == 1
    assert text(streamed) == whole[0]["text_output"] and text(streamed)
    assert sum(r["num_output_tokens"] for r in streamed) == whole[0]["num_output_tokens"] == GREEDY["max_tokens"]
    assert streamed[-1]["finish_reason"] == "length"
    assert all(r["finish_reason"] == "" for r in streamed[:-1])
    assert streamed[0]["num_input_tokens"] > 5


def test_ensemble_streams_the_same_text(server):
    direct = generate(server, PROMPT)
    via = list(client.generate(PROMPT, url=server.grpc_url, model="ensemble", sampling=GREEDY, timeout=60,
                               extra={"return_finish_reason": True}))
    assert len(via) > 1 and text(via) == text(direct)
    assert via[-1]["finish_reason"] == "length"
    with pytest.raises(client.GenerationError, match="max_tokens"):
        list(client.generate(PROMPT, url=server.grpc_url, model="ensemble", sampling={"max_tokens": 0}, timeout=60))


def test_non_streaming_prepends_prompt_by_default(server):
    (r,) = generate(server, PROMPT, stream=False)
    (excluded,) = generate(server, PROMPT, stream=False, exclude_input_in_output=True)
    assert r["text_output"] == PROMPT + excluded["text_output"]


def test_http_generate_and_generate_stream(server):
    expected = text(generate(server, PROMPT))
    status, body = http_post(server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                                  "parameters": GREEDY})
    assert status == 200, body
    assert json.loads(body)["text_output"] == expected
    status, body = http_post(server, "generate_stream", {"text_input": PROMPT, "stream": True,
                                                         "sampling_parameters": json.dumps(GREEDY)})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected


def test_a_prompt_of_token_ids_generates_as_its_text(server, tiny_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT)["input_ids"]
    expected = text(generate(server, PROMPT))
    streamed = generate(server, ids, return_num_input_tokens=True)
    assert text(streamed) == expected and expected
    assert streamed[0]["num_input_tokens"] == len(ids)
    (whole,) = generate(server, ids, stream=False)       # never prepended: there is no text of it
    assert whole["text_output"] == expected
    status, body = http_post(server, "generate", {"input_ids": ids, "parameters": GREEDY})
    assert status == 200, body
    assert json.loads(body)["text_output"] == expected


def test_16_concurrent_streams_equal_one_by_one(server):
    prompts = [f"Request {i}: the quick brown fox {'jumps ' * (i % 4)}" for i in range(16)]
    one_by_one = [text(generate(server, p)) for p in prompts]
    assert generate_concurrently(server, prompts) == one_by_one
    assert len(set(one_by_one)) > 1


def test_past_16_streams_responses_carry_two_tokens_and_nothing_changes(server):
    """stream_interval auto: with more than 16 requests streaming, a response carries two tokens
    (the first token still goes alone); the text is the same as each request's alone."""
    prompts = [f"Stream {i}: the quick brown fox {'jumps ' * (i % 3)}" for i in range(24)]
    long = {**GREEDY, "max_tokens": 96, "ignore_eos": True}    # long enough that the streams overlap
    one_by_one = [text(generate(server, p, long)) for p in prompts]
    streams: dict[int, list] = {}

    def run(i):
        streams[i] = generate(server, prompts[i], long, return_num_output_tokens=True)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [text(streams[i]) for i in range(len(prompts))] == one_by_one
    for responses in streams.values():
        counts = [r["num_output_tokens"] for r in responses]
        assert sum(counts) == long["max_tokens"] and counts[0] == 1
    assert sum(len(r) for r in streams.values()) < 0.7 * len(prompts) * long["max_tokens"]


def test_cancelling_a_stream_frees_rworker_kv(server, fleet):
    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    c.async_stream_infer(MODEL, client.build_inputs("Tell a long story.", {"max_tokens": 450, "ignore_eos": True,
                                                                          "temperature": 0.0}))
    for _ in range(3):
        result, error = got.get(timeout=30)
        assert error is None
    assert kv_held(fleet)[0] > 0

    def cancelled():
        return sum(v for k, v in metric_values(server, "fastdecode_requests_finished_total").items()
                   if "cancelled" in k)

    cancelled_before = cancelled()
    c.stop_stream(cancel_requests=True)
    c.close()
    assert wait_for(lambda: kv_held(fleet) == (0, 0))
    wait_for(lambda: cancelled() > cancelled_before)
    assert cancelled() == cancelled_before + 1
    assert sum(r["num_output_tokens"] for r in generate(server, "still serving?", return_num_output_tokens=True)) == 24


def test_metrics_endpoint_shows_custom_metrics(server, fleet):
    settled_metrics(server)
    before = sum(metric_values(server, "fastdecode_generation_tokens_total").values())
    steps_before = total(server, "fastdecode_steps_total")
    step_s_before = total(server, "fastdecode_step_seconds_total")
    parts_before = {p: total(server, f"fastdecode_{p}_seconds_total") for p in STEP_PARTS}
    for _ in range(2):
        generate(server, PROMPT)
    wait_for(lambda: total(server, "fastdecode_generation_tokens_total") - before >= 2 * GREEDY["max_tokens"]
             and total(server, "fastdecode_steps_total") - steps_before >= 2 * GREEDY["max_tokens"]
             and total(server, "fastdecode_batch_size") == 0)
    settled_metrics(server, quiet=0.5)
    generated = sum(metric_values(server, "fastdecode_generation_tokens_total").values())
    assert generated - before == 2 * GREEDY["max_tokens"]
    # the per-step trace, summarised: two requests one after the other, one token per step each
    assert total(server, "fastdecode_steps_total") - steps_before == 2 * GREEDY["max_tokens"]
    step_s = total(server, "fastdecode_step_seconds_total") - step_s_before
    parts = {p: total(server, f"fastdecode_{p}_seconds_total") - parts_before[p] for p in STEP_PARTS}
    assert 0 < step_s < 60
    assert 0 < parts["s_part"] <= step_s and 0 < parts["r_part"] <= step_s * 1.001
    assert 0 <= parts["s_wait"] <= step_s and 0 <= parts["r_wait"] <= step_s
    step_time = by_label(metric_values(server, "fastdecode_step_time_seconds"), "stat")
    assert set(step_time) == {"mean", "p50", "p99", "max"}
    assert 0 < step_time["p50"] <= step_time["p99"] <= step_time["max"] < 10
    assert step_time["mean"] <= step_time["max"]
    assert list(metric_values(server, "fastdecode_batch_size").values()) == [0.0]          # idle now
    assert list(metric_values(server, "fastdecode_context_tokens").values()) == [0.0]
    assert metric_values(server, "fastdecode_sls_w_lim") == {}                             # scheduler fcfs
    assert sum(metric_values(server, "fastdecode_prompt_tokens_total").values()) > 0
    ttft = metric_values(server, "fastdecode_time_to_first_token_seconds_count")
    ttft_sum = metric_values(server, "fastdecode_time_to_first_token_seconds_sum")
    assert sum(ttft.values()) >= 2 and 0 < sum(ttft_sum.values()) / sum(ttft.values()) < 10
    tpot = metric_values(server, "fastdecode_time_per_output_token_seconds_sum")
    assert 0 < sum(tpot.values()) < 10 * sum(metric_values(server, "fastdecode_time_per_output_token_seconds_count").values())
    kv = metric_values(server, "fastdecode_kv_tokens")
    assert {re.search(r'rworker="([^"]+)"', k).group(1) for k in kv} == set(fleet.addresses)
    assert all(v == 0 for v in kv.values())          # nothing in flight
    assert list(metric_values(server, "fastdecode_requests_running").values()) == [0.0]
    assert list(metric_values(server, "fastdecode_requests_waiting").values()) == [0.0]


# ---- bad requests

BAD = {
    "missing text_input": ([tensor("stream", np.array([True]), "BOOL")], "text_input"),
    "malformed JSON": ([bytes_tensor("text_input", b"hi"), bytes_tensor("sampling_parameters", b"{max_tokens: 3")],
                       "not valid JSON"),
    "JSON not an object": ([bytes_tensor("text_input", b"hi"), bytes_tensor("sampling_parameters", b"[3]")],
                           "JSON object"),
    "wrong type text_input": ([tensor("text_input", np.array([7], dtype=np.int32), "INT32")], "text_input"),
    "wrong type stream": ([bytes_tensor("text_input", b"hi"), bytes_tensor("stream", b"yes")], "stream"),
    "wrong value type": ([bytes_tensor("text_input", b"hi"), bytes_tensor("sampling_parameters",
                                                                           b'{"max_tokens": "many"}')], "max_tokens"),
    "max_tokens 0": ([bytes_tensor("text_input", b"hi"), bytes_tensor("sampling_parameters", b'{"max_tokens": 0}')],
                     "max_tokens"),
    "max_tokens huge": ([bytes_tensor("text_input", b"hi"),
                         bytes_tensor("sampling_parameters", b'{"max_tokens": 100000000000}')], "max_tokens"),
    "unknown sampling key": ([bytes_tensor("text_input", b"hi"), bytes_tensor("sampling_parameters", b'{"beam": 4}')],
                             "beam"),
    "non-UTF-8 bytes": ([bytes_tensor("text_input", b"\xff\xfe\xc3(")], "UTF-8"),
    "empty string": ([bytes_tensor("text_input", b"")], "empty"),
    "two prompts": ([tensor("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")], "text_input"),
    "text and ids": ([bytes_tensor("text_input", b"hi"), tensor("input_ids", np.array([5, 6]), "INT64")], "not both"),
    "float ids": ([tensor("input_ids", np.array([5.0, 6.0], dtype=np.float32), "FP32")], "input_ids"),
    "ids beyond the vocabulary": ([tensor("input_ids", np.array([5, 10**9]), "INT64")], "token ids"),
    "negative ids": ([tensor("input_ids", np.array([-1, 5]), "INT64")], "token ids"),
    "no ids": ([tensor("input_ids", np.zeros(0, dtype=np.int64), "INT64")], "input_ids"),
    "ids of two prompts": ([tensor("input_ids", np.array([[5, 6], [7, 8]]), "INT64")], "input_ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_clear_error_and_server_keeps_serving(server, case):
    inputs, expected = BAD[case]
    responses, error = raw_stream(server, inputs)
    assert error is not None, f"{case}: no error, got {len(responses)} response(s)"
    assert expected in error, error
    ok = generate(server, "ok?", {"max_tokens": 2, "temperature": 0.0}, return_num_output_tokens=True)
    assert sum(r["num_output_tokens"] for r in ok) == 2


def test_http_bad_requests(server):
    status, body = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": "{oops"})
    assert status == 400 and "not valid JSON" in body
    status, body = http_post(server, "generate", {"text_input": "hi", "parameters": {"max_tokens": -1}})
    assert status == 400 and "max_tokens" in body
    status, body = http_post(server, "generate", {"prompt": "hi"})
    assert status == 400 and "text_input" in body
    status, _ = http_post(server, "generate", {"text_input": "hi", "parameters": {"max_tokens": 2}})
    assert status == 200


# ---- crash drill (last: it unloads the model, then reloads it)

def test_crashed_engine_loop_makes_model_not_ready_then_reload(server):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert c.is_model_ready(MODEL)
    server.crash_flag.write_text("crash")
    try:
        t0 = time.monotonic()
        with pytest.raises(client.GenerationError, match="injected engine fault|crashed|unavailable"):
            generate(server, "this request meets a crashing engine")
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 15
        while c.is_model_ready(MODEL) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not c.is_model_ready(MODEL)
        assert c.is_server_live()
        t0 = time.monotonic()
        with pytest.raises(client.GenerationError):
            generate(server, "and this one is refused")
        assert time.monotonic() - t0 < 10
    finally:
        server.crash_flag.unlink(missing_ok=True)
    c.load_model(MODEL)
    assert c.is_model_ready(MODEL)
    assert sum(r["num_output_tokens"] for r in generate(server, "back again", {"max_tokens": 3, "temperature": 0.0},
                                                        return_num_output_tokens=True)) == 3


# ---- clean unload (after the crash drill: unloads the model, then loads it again)

def test_unload_after_every_kind_of_request_is_prompt(server, fleet):
    """After streamed, non-streamed, concurrent, HTTP, ensemble, bad and cancelled requests, the
    model unloads at once: finalize() runs and its stub exits (no wait for Triton's timeouts)."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert c.is_model_ready(MODEL)
    short = {"max_tokens": 4, "temperature": 0.0}
    for i in range(4):
        generate(server, f"streamed {i}", short)
        generate(server, f"whole {i}", short, stream=False)
    threads = [threading.Thread(target=generate, args=(server, f"concurrent {i}", short)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert http_post(server, "generate", {"text_input": "http", "parameters": short})[0] == 200
    assert http_post(server, "generate_stream", {"text_input": "sse", "stream": True,
                                                 "sampling_parameters": json.dumps(short)})[0] == 200
    assert list(client.generate("ensemble", url=server.grpc_url, model="ensemble", sampling=short, timeout=60))
    for case in ("malformed JSON", "max_tokens 0", "empty string"):
        assert raw_stream(server, BAD[case][0])[1] is not None
    got: queue.Queue = queue.Queue()
    cancelled = grpcclient.InferenceServerClient(server.grpc_url)
    cancelled.start_stream(callback=lambda result, error: got.put((result, error)))
    cancelled.async_stream_infer(MODEL, client.build_inputs("a long one", {"max_tokens": 450, "ignore_eos": True}))
    assert got.get(timeout=30)[1] is None
    cancelled.stop_stream(cancel_requests=True)
    cancelled.close()
    assert wait_for(lambda: kv_held(fleet) == (0, 0))       # the cancellation reached the engine

    finalized = server.log_path.read_text().count("fastdecode: finalize: done")
    t0 = time.monotonic()
    c.unload_model(MODEL)
    while model_state(c) in ("READY", "UNLOADING") and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    state, took = model_state(c), time.monotonic() - t0
    assert state == "UNAVAILABLE", f"model still {state} after {took:.1f} s; log {server.log_path}"
    assert took < 20        # ~1.2 s measured
    assert server.log_path.read_text().count("fastdecode: finalize: done") == finalized + 1
    deadline = time.monotonic() + 5
    while stub_processes(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub_processes(server) == []
    c.load_model(MODEL)
    assert c.is_model_ready(MODEL)
    assert len(stub_processes(server)) == 1


# ---- scheduler=sls (last: reloads the model with an SLS config, then with its own again)

def test_sls_scheduler_streams_equal_fcfs_and_report_w_lim(server):
    """The model loaded with parameter scheduler=sls (a W_lim that fits about two of these requests)
    and a trace file: concurrent greedy streams give fcfs's text, SLS keeps its bound, and the step
    metrics add up to what the engine's trace says."""
    from fastdecode.trace import load_trace

    prompts = [f"SLS {i}: once upon a time {'there was ' * i}" for i in range(6)]
    fcfs, max_len = [], 0
    for p in prompts:
        responses = generate(server, p, return_num_input_tokens=True)
        fcfs.append(text(responses))
        max_len = max(max_len, responses[0]["num_input_tokens"] + GREEDY["max_tokens"])
    w_lim = 2 * max_len + max_len // 2
    trace_path = server.run_dir / "sls-trace.jsonl"
    original = http_json(server, f"/v2/models/{MODEL}/config")
    sls = json.loads(json.dumps(original))
    sls["parameters"].update({k: {"string_value": v} for k, v in {
        "scheduler": "sls", "sls_f": "2", "sls_w_lim": str(w_lim), "trace_path": str(trace_path)}.items()})
    load_with_config(server, sls)
    try:
        assert http_json(server, f"/v2/models/{MODEL}/config")["parameters"]["scheduler"]["string_value"] == "sls"
        steps_before = total(server, "fastdecode_steps_total")
        step_s_before = total(server, "fastdecode_step_seconds_total")
        assert generate_concurrently(server, prompts) == fcfs
        wait_for(lambda: total(server, "fastdecode_steps_total") - steps_before >= len(load_trace(trace_path))
                 and total(server, "fastdecode_sls_w_in_flight") == 0)
        settled_metrics(server, quiet=0.5)
        trace = load_trace(trace_path)
        assert max(r["context_tokens"] for r in trace) <= w_lim
        assert 1 < max(r["batch_size"] for r in trace) < len(prompts)     # W_lim held some back
        assert total(server, "fastdecode_steps_total") - steps_before == len(trace)
        assert total(server, "fastdecode_step_seconds_total") - step_s_before == \
            pytest.approx(sum(r["step_time"] for r in trace), rel=1e-3)
        assert list(metric_values(server, "fastdecode_sls_w_lim").values()) == [w_lim]
        assert list(metric_values(server, "fastdecode_sls_w_in_flight").values()) == [0.0]     # all done
        idle = list(metric_values(server, "fastdecode_batch_size").values())
        assert idle and all(v == 0 for v in idle)
    finally:
        load_with_config(server, original)
    assert http_json(server, f"/v2/models/{MODEL}/config")["parameters"]["scheduler"]["string_value"] == ""


# ---- int4 KV (last: reloads the model with kv_format=int4 on the same R-workers, and leaves it so)

def test_int4_kv_model_answers_the_contract(server, fleet, tiny_model_dir):
    """Loaded with kv_format=int4 (KV on the R-workers in int4): streamed, non-streamed and HTTP
    answers agree and carry the contract's fields, and the text is the in-process engine's with
    int4 KV, not the fp16 text."""
    from fastdecode.config import EngineConfig
    from fastdecode.engine import Engine, SamplingParams

    fp16 = text(generate(server, PROMPT))
    original = http_json(server, f"/v2/models/{MODEL}/config")
    int4 = json.loads(json.dumps(original))
    int4["parameters"]["kv_format"] = {"string_value": "int4"}
    reload_with_config(server, int4)
    assert http_json(server, f"/v2/models/{MODEL}/config")["parameters"]["kv_format"]["string_value"] == "int4"
    streamed = generate(server, PROMPT, return_finish_reason=True, return_num_output_tokens=True)
    (whole,) = generate(server, PROMPT, stream=False, exclude_input_in_output=True)
    status, body = http_post(server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                                  "parameters": GREEDY})
    assert len(streamed) > 1 and streamed[-1]["finish_reason"] == "length"
    assert sum(r["num_output_tokens"] for r in streamed) == GREEDY["max_tokens"]
    assert status == 200 and json.loads(body)["text_output"] == whole["text_output"] == text(streamed)
    engine = Engine(EngineConfig(model=tiny_model_dir, attention="local", kv_format="int4", kernel_threads=1))
    try:
        engine.add_request(PROMPT, SamplingParams.from_dict(GREEDY))
        expected = ""
        while engine.has_unfinished():
            expected += "".join(o.text for o in engine.step())
    finally:
        engine.stop()
    assert text(streamed) == expected != fp16
