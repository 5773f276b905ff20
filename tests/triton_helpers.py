"""Calls to a test tritonserver (test_triton.py's `server` fixture) and its R-workers: generate over
gRPC and HTTP, raw streams of InferInputs, metrics, R-worker KV stats, model load and unload."""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from fastdecode.ops import client


MODEL = "fastdecode"
GREEDY = {"temperature": 0.0, "max_tokens": 24}


def generate(server, prompt, sampling=GREEDY, stream=True, **extra):
    return list(client.generate(prompt, url=server.grpc_url, model=MODEL, sampling=sampling, stream=stream,
                                extra=extra or None, timeout=60))


def generate_concurrently(server, prompts, timeout=120) -> list[str]:
    """Each prompt's streamed text, all requests in flight at once (one thread and stream each)."""
    results: dict[int, str] = {}
    errors = []

    def run(i):
        try:
            results[i] = text(generate(server, prompts[i]))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return [results[i] for i in range(len(prompts))]


def text(responses):
    return "".join(r.get("text_output", "") for r in responses)


def http_post(server, path, body, timeout=60):
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def rworker_stats(addresses):
    import grpc

    from rpart.proto import rworker_pb2, rworker_pb2_grpc

    out = []
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            out.append(rworker_pb2_grpc.RWorkerStub(ch).Stats(rworker_pb2.StatsRequest(), timeout=5))
    return out


def kv_held(fleet) -> tuple[int, int]:
    """(KV tokens, sequences) the R-workers hold."""
    stats = rworker_stats(fleet.addresses)
    return sum(s.kv_tokens for s in stats), sum(s.sequences for s in stats)


def wait_for(condition, timeout: float = 30.0):
    """Poll until condition() is truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def settled_metrics(server, quiet: float = 1.0, timeout: float = 30.0) -> None:
    """Wait until the fastdecode_ metrics stay unchanged for `quiet` s (10 metrics intervals): what
    earlier requests counted has reached the endpoint."""
    def snapshot():
        body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        return [line for line in body.splitlines() if line.startswith("fastdecode_")]

    deadline = time.monotonic() + timeout
    last, since = snapshot(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the metrics did not settle"
        time.sleep(0.1)
        now = snapshot()
        if now != last:
            last, since = now, time.monotonic()


def metric_values(server, name):
    body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return {labels: float(v) for labels, v in re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", body, re.M)}


def total(server, name) -> float:
    return sum(metric_values(server, name).values())


def by_label(values: dict, label: str) -> dict:
    return {re.search(rf'{label}="([^"]+)"', k).group(1): v for k, v in values.items()}


STEP_PARTS = ("s_part", "r_part", "s_wait", "r_wait")


def raw_stream(server, inputs):
    """Send these InferInputs; return (responses, error message)."""
    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                return responses, str(error)
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        c.stop_stream()
        c.close()


def tensor(name, array, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def bytes_tensor(name, value: bytes):
    return tensor(name, np.array([value], dtype=np.object_), "BYTES")


def model_state(c) -> str:
    index = c.get_model_repository_index(as_json=True).get("models", [])
    return next((m.get("state", "") for m in index if m["name"] == MODEL), "")


def stub_processes(server) -> list[int]:
    from fastdecode.ops.procs import cmdline, group_members

    return [p for p in group_members(server.proc.pid) if any("triton_python_backend_stub" in a for a in cmdline(p))]


def http_json(server, path, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if data is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text else None


def load_with_config(server, config: dict) -> None:
    http_json(server, f"/v2/repository/models/{MODEL}/load", {"parameters": {"config": json.dumps(config)}})


def reload_with_config(server, config: dict) -> None:
    """Unload, then load with `config`: the R-workers hold one KV format at a time, so the model
    on the old format lets go of them first."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.unload_model(MODEL)
    deadline = time.monotonic() + 60
    while model_state(c) in ("READY", "UNLOADING") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert model_state(c) == "UNAVAILABLE", model_state(c)
    load_with_config(server, config)
    assert c.is_model_ready(MODEL)
