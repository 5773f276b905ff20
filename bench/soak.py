"""Soak (`make soak`, issue #17): `make serve RWORKERS=2` under mixed traffic, with leak checks.

    python bench/soak.py [--seconds 600] [--warmup 60] [--concurrency 24] [--model DIR] [--rworkers 2]
                         [--kv-capacity 1G] [--deadline 300] [--sample-interval 15] [--max-tokens 48] [--seed 0]
                         [--param KEY=VALUE ...] [--only KIND ...] [--out bench/results/soak.json]

Starts the deployment of `make serve RWORKERS=2` (`python -m fastdecode.ops.serve start --rworkers 2`)
in a temporary run directory on free ports (the OpenAI frontend off), then `--concurrency` client
threads send requests back to back for `--seconds` (warm-up included), each request of a kind drawn
at random (KINDS): normal gRPC streams, HTTP generate and generate_stream, streams the client
cancels, HTTP streams the client drops, early stops (stop strings and ids, tiny max_tokens, EOS),
bad requests (BAD_GRPC, BAD_HTTP: each must get an error naming what is wrong) and extreme sampling
values that can drive the logits to inf or NaN (EXTREME: they must end, with text or an error).

Measured:
- lost requests: a request that was not cancelled by its client and got no final response (or an
  error) within --deadline seconds;
- RSS, open fds and threads of tritonserver, its Python-backend stub and each R-worker: once idle
  after the warm-up (traffic paused until every request ended and the R-workers hold no KV) and
  once idle at the end, and every --sample-interval seconds under load in between;
- the R-workers' own KV accounting (Stats: bytes_used, sequences) once the load has stopped: it
  must come back to 0.

Writes --out (JSON) and exits 1 when a request was lost, KV stays held, the worst process's RSS grew
more than 10 %, a request got an answer its kind does not allow, a process of the deployment died
or the server does not serve a plain request at the end. The run directory (logs) is kept when the
run fails and removed otherwise.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import json
import os
import platform
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fastdecode.ops.procs import free_port  # noqa: E402

MODEL = "fastdecode"
MAX_RSS_GROWTH = 0.10
PROMPTS = ("The sea is", "Write a short story about a robot who learns to bake bread.",
           "List three colours.", "Explain why the sky is blue.", "Once upon a time",
           "Translate to French: good morning", "Q: What is 2 + 2?\nA:", "Привет, мир! Hello, world! 🙂")


# ---- the deployment ----------------------------------------------------------------------------

class Deployment:
    """What `make serve RWORKERS=n` starts, in `run_dir`, on free ports, without the OpenAI frontend."""

    def __init__(self, model: str, run_dir: Path, rworkers: int = 2, kv_capacity: str = "1G",
                 params: tuple[str, ...] = (), start_timeout: float = 900.0):
        self.model, self.run_dir, self.rworkers = str(model_path(model)), Path(run_dir), rworkers
        self.kv_capacity, self.params, self.start_timeout = kv_capacity, params, start_timeout
        self.grpc_url = self.http_url = ""
        self.rworker_addresses: list[str] = []
        self.pids: dict[str, int] = {}

    def _serve(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fastdecode.ops.serve", *args, "--run-dir", str(self.run_dir)],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def start(self) -> "Deployment":
        """Start it (the deployment is stopped again when anything fails)."""
        ports = [str(free_port()) for _ in range(3)]
        params = [a for p in self.params for a in ("--param", p)]
        try:
            started = self._serve("start", "--model", self.model, "--rworkers", str(self.rworkers),
                                  "--kv-capacity", self.kv_capacity, "--http-port", ports[0], "--grpc-port", ports[1],
                                  "--metrics-port", ports[2], "--openai-port", "0", *params,
                                  timeout=self.start_timeout)
            if started.returncode != 0:
                raise RuntimeError(f"fastdecode.ops.serve start failed ({started.returncode}):\n{started.stderr[-3000:]}")
            serve = json.loads((self.run_dir / "serve.json").read_text())
            self.grpc_url, self.http_url = serve["grpc"], serve["http"]
            fleet = json.loads((self.run_dir / "rworkers" / "fleet.json").read_text())
            self.rworker_addresses = [w["address"] for w in fleet["workers"]]
            triton = int((self.run_dir / "tritonserver.pid").read_text())
            self.pids = {"tritonserver": triton, "python_backend_stub": _stub_of(triton),
                         **{f"rworker-{w['index']}": w["pid"] for w in fleet["workers"]}}
        except BaseException as e:
            self.stop()
            if isinstance(e, subprocess.TimeoutExpired):
                raise RuntimeError(f"fastdecode.ops.serve start did not return in {self.start_timeout:.0f} s") from None
            raise
        return self

    def processes(self) -> dict[str, psutil.Process | None]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = psutil.Process(pid)
            except psutil.Error:
                out[name] = None
        return out

    def stop(self) -> str:
        try:
            return self._serve("stop", timeout=300).stderr.strip()
        except subprocess.TimeoutExpired:
            return "fastdecode.ops.serve stop did not return in 300 s"


def _stub_of(triton_pid: int) -> int:
    for child in psutil.Process(triton_pid).children(recursive=True):
        try:
            if any("triton_python_backend_stub" in a for a in child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"tritonserver (pid {triton_pid}) has no Python-backend stub process")


def model_path(model_dir: str) -> Path:
    """A model directory as the server resolves it: relative paths against this checkout."""
    return Path(model_dir) if Path(model_dir).is_absolute() else REPO / model_dir


def model_max_len(model_dir: str) -> int:
    return int(json.loads((model_path(model_dir) / "config.json").read_text())["max_position_embeddings"])


# ---- what the deployment's processes and R-workers hold ---------------------------------------------

def sample_processes(procs: dict[str, psutil.Process | None]) -> dict[str, dict]:
    out = {}
    for name, p in procs.items():
        try:
            if p is None or p.status() == psutil.STATUS_ZOMBIE:
                raise psutil.NoSuchProcess(0)
            with p.oneshot():
                out[name] = {"alive": True, "rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads(),
                             **_rss_parts(p.pid)}
        except psutil.Error:
            out[name] = {"alive": False}
    return out


def _rss_parts(pid: int) -> dict[str, int]:
    """RssAnon, RssFile and RssShmem in bytes (Linux /proc/PID/status): which kind of memory grew."""
    parts = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                parts[key.lower().replace("rss", "rss_")] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return parts


def settled_sample(procs: dict[str, psutil.Process | None], timeout: float = 60.0) -> dict[str, dict]:
    """A sample once fds and threads of every process stayed the same over one second (closed
    connections and finished threads take a moment to go), or the last one at the deadline."""
    deadline = time.monotonic() + timeout
    last = sample_processes(procs)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = sample_processes(procs)
        if all((now[n].get("fds"), now[n].get("threads")) == (last[n].get("fds"), last[n].get("threads"))
               for n in now):
            return now
        last = now
    return last


def rworker_stats(addresses: list[str]) -> dict[str, dict]:
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    out = {}
    for a in addresses:
        try:
            with grpc.insecure_channel(a) as ch:
                s = pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
        except grpc.RpcError as e:
            out[a] = {"error": f"{e.code()}: {e.details()}"}
            continue
        out[a] = {"bytes_used": s.bytes_used, "sequences": s.sequences, "kv_tokens": s.kv_tokens,
                  "connections": s.connections, "calls": s.calls}
    return out


def wait_kv_idle(addresses: list[str], timeout: float) -> dict[str, dict]:
    """Poll the R-workers until none holds KV (bytes and sequences); their last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = rworker_stats(addresses)
        if all(s.get("bytes_used") == 0 and s.get("sequences") == 0 for s in stats.values()) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


# ---- one request ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str              # ok | error | cancelled | lost | unreachable
    detail: str = ""         # finish reason, or the error
    tokens: int = 0          # num_output_tokens summed over the responses (when asked for)


def grpc_request(url: str, inputs, deadline_s: float, cancel_after: int | None = None) -> Outcome:
    """One request on its own tritonclient gRPC stream (a fresh connection, as a client opens).
    cancel_after=n: the client cancels the stream after n responses (unless it ended by then)."""
    import tritonclient.grpc as grpcclient

    got: queue.SimpleQueue = queue.SimpleQueue()
    c = grpcclient.InferenceServerClient(url)
    ended = False            # the server ended the request: cancelling it now would race Triton (client.generate)
    responses, tokens, reason = 0, 0, ""
    try:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            c.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        except Exception as e:  # noqa: BLE001 -- the transport's failure is the outcome
            return Outcome("unreachable", f"{type(e).__name__}: {e}")
        end = time.monotonic() + deadline_s
        while True:
            try:
                result, error = got.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return Outcome("lost", f"no final response in {deadline_s:.0f} s ({responses} response(s) before)")
            if error is not None:
                ended = True
                return Outcome("error", str(error), tokens)
            responses += 1
            n = result.as_numpy("num_output_tokens")
            tokens += int(n.sum()) if n is not None else 0
            r = result.as_numpy("finish_reason")
            if r is not None and r.size:
                reason = r.reshape(-1)[0].decode() or reason
            if result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
                return Outcome("ok", reason, tokens)
            if cancel_after is not None and responses >= cancel_after:
                return Outcome("cancelled", f"after {responses} response(s)", tokens)
    finally:
        c.stop_stream(cancel_requests=not ended)
        c.close()


def tensor(name: str, array: np.ndarray, dtype: str):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def text_tensor(name: str, value: bytes):
    return tensor(name, np.array([value], dtype=np.object_), "BYTES")


def valid_inputs(prompt: str, sampling: dict, stream: bool = True):
    return [text_tensor("text_input", prompt.encode()), tensor("stream", np.array([stream]), "BOOL"),
            text_tensor("sampling_parameters", json.dumps(sampling).encode()),
            tensor("return_finish_reason", np.array([True]), "BOOL"),
            tensor("return_num_output_tokens", np.array([True]), "BOOL")]


def http_request(http_url: str, body: dict, deadline_s: float, stream: bool = False,
                 drop_after: int | None = None) -> Outcome:
    """POST /generate (or /generate_stream, server-sent events). drop_after=n: close the connection
    after n events. A socket that waits longer than deadline_s is a lost request."""
    host, port = http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=deadline_s)
    path = f"/v2/models/{MODEL}/{'generate_stream' if stream else 'generate'}"
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Outcome("error", f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:300]}")
        if not stream:
            out = json.loads(resp.read())
            return Outcome("ok", _scalar(out.get("finish_reason", "")), int(np.sum(out.get("num_output_tokens", 0))))
        events, tokens, reason = 0, 0, ""
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                return Outcome("error", str(event["error"]), tokens)
            events += 1
            tokens += int(np.sum(event.get("num_output_tokens", 0)))
            reason = _scalar(event.get("finish_reason", "")) or reason
            if drop_after is not None and events >= drop_after and not reason:
                return Outcome("cancelled", f"connection dropped after {events} event(s)", tokens)
        return Outcome("ok", reason, tokens)
    except TimeoutError:
        return Outcome("lost", f"no answer in {deadline_s:.0f} s")
    except (OSError, http.client.HTTPException) as e:
        return Outcome("unreachable", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _scalar(value) -> str:
    """A one-element output as Triton's generate endpoint writes it: the value, or a list of it."""
    if isinstance(value, list):
        value = value[0] if value else ""
    return str(value)


# ---- the kinds of traffic -----------------------------------------------------------------------

@dataclass
class Target:
    grpc_url: str
    http_url: str
    max_model_len: int
    deadline_s: float
    max_tokens: int = 48      # the longest normal request


@dataclass
class Result:
    kind: str
    case: str
    outcome: Outcome
    expected: bool           # the answer is one this kind allows
    seconds: float


def _normal_sampling(rng: random.Random, target: Target) -> dict:
    s = {"max_tokens": rng.randint(4, target.max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0]),
         "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        s["top_p"] = 0.9
    if rng.random() < 0.3:
        s["seed"] = rng.randrange(1 << 31)
    return s


def _completed(o: Outcome, sampling: dict) -> bool:
    """A normal request: a final answer, and when it ran to its length, max_tokens tokens exactly."""
    if o.status != "ok" or o.detail not in ("stop", "length"):
        return False
    return o.detail != "length" or o.tokens == sampling["max_tokens"]


def kind_stream(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    s = _normal_sampling(rng, t)
    o = grpc_request(t.grpc_url, valid_inputs(rng.choice(PROMPTS), s), t.deadline_s)
    return "grpc", o, _completed(o, s)


def kind_http_generate(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    s = _normal_sampling(rng, t)
    body = {"text_input": rng.choice(PROMPTS), "exclude_input_in_output": True, "return_finish_reason": True,
            "return_num_output_tokens": True, "parameters": s}
    o = http_request(t.http_url, body, t.deadline_s)
    return "generate", o, _completed(o, s)


def kind_http_stream(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    s = _normal_sampling(rng, t)
    body = {"text_input": rng.choice(PROMPTS), "stream": True, "return_finish_reason": True,
            "return_num_output_tokens": True, "sampling_parameters": json.dumps(s)}
    o = http_request(t.http_url, body, t.deadline_s, stream=True)
    return "generate_stream", o, _completed(o, s)


def _long_sampling(t: Target) -> dict:
    return {"max_tokens": min(4 * t.max_tokens, t.max_model_len // 2), "ignore_eos": True, "temperature": 0.8}


def kind_cancel(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    n = rng.randint(1, 6)
    o = grpc_request(t.grpc_url, valid_inputs(rng.choice(PROMPTS), _long_sampling(t)), t.deadline_s, cancel_after=n)
    return f"after {n}", o, o.status in ("cancelled", "ok")


def kind_http_drop(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    n = rng.randint(1, 4)
    body = {"text_input": rng.choice(PROMPTS), "stream": True, "sampling_parameters": json.dumps(_long_sampling(t)),
            "return_finish_reason": True}
    o = http_request(t.http_url, body, t.deadline_s, stream=True, drop_after=n)
    return f"after {n}", o, o.status in ("cancelled", "ok")


def _early_stops(t: Target) -> dict[str, dict]:
    return {
        "stop strings": {"max_tokens": t.max_tokens, "stop": [" ", "e", "."], "temperature": 0.0, "ignore_eos": True},
        "stop token ids": {"max_tokens": t.max_tokens, "stop_token_ids": list(range(0, 4000)), "temperature": 1.0},
        "max_tokens 1": {"max_tokens": 1},
        "max_tokens 2": {"max_tokens": 2, "temperature": 0.0},
        "EOS allowed": {"max_tokens": t.max_tokens, "temperature": 0.0, "ignore_eos": False},
        "min_tokens = max_tokens": {"max_tokens": 3, "min_tokens": 3, "stop": ["a"]},
    }


def kind_early_stop(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    case, s = rng.choice(list(_early_stops(t).items()))
    o = grpc_request(t.grpc_url, valid_inputs("Answer in one word: what colour is the sky?", s), t.deadline_s)
    return case, o, _completed(o, s)


# Values the engine's checks accept that push the logits to inf or NaN. Each must end with its
# text or with an error, and leave the other requests alone.
EXTREME = {
    "temperature 1e-30": {"temperature": 1e-30},
    "temperature 5e-324": {"temperature": 5e-324},
    "temperature 1e300": {"temperature": 1e300},
    "temperature 1.2e-38 (float32 edge)": {"temperature": 1.2e-38},
    "temperature 3.4e38 (float32 edge)": {"temperature": 3.4e38},
    "temperature 1.2e-38 top_p 0.5": {"temperature": 1.2e-38, "top_p": 0.5},
    "top_p 5e-324": {"temperature": 1.0, "top_p": 5e-324},
    "top_p 1e-300 top_k 1": {"temperature": 1.0, "top_p": 1e-300, "top_k": 1},
    "min_p 1": {"temperature": 1.0, "min_p": 1.0},
    "min_p 1 temperature 1e-30": {"temperature": 1e-30, "min_p": 1.0},
    "repetition_penalty 1e-300": {"temperature": 1.0, "repetition_penalty": 1e-300},
    "repetition_penalty 1e300": {"temperature": 0.0, "repetition_penalty": 1e300},
    "penalties 2 temperature 1e-30": {"temperature": 1e-30, "frequency_penalty": 2, "presence_penalty": 2},
    "penalties -2 repetition 1e300": {"temperature": 0.5, "frequency_penalty": -2, "presence_penalty": -2,
                                      "repetition_penalty": 1e300},
    "logprobs 20 temperature 1e-30": {"temperature": 1e-30, "logprobs": 20},
    "seed 2**63-1": {"temperature": 1.0, "seed": 2**63 - 1},
}


def kind_extreme(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    case, s = rng.choice(list(EXTREME.items()))
    s = {"max_tokens": 16, **s}
    o = grpc_request(t.grpc_url, valid_inputs(rng.choice(PROMPTS), s), t.deadline_s)
    return case, o, o.status == "error" or _completed(o, s)


def _bad_grpc(t: Target) -> dict[str, tuple[Callable[[], list], str]]:
    """name: (the inputs, a word the error must contain)."""
    def sampling(s):
        return lambda: [text_tensor("text_input", b"hi"), text_tensor("sampling_parameters", json.dumps(s).encode())]

    def raw(*pairs):
        return lambda: [text_tensor(n, v) if isinstance(v, bytes) else tensor(n, *v) for n, v in pairs]

    too_long = ("hello " * (2 * t.max_model_len)).encode()
    far_too_long = ("x" * (40 * t.max_model_len)).encode()
    return {
        "missing text_input": (lambda: [tensor("stream", np.array([True]), "BOOL")], "text_input"),
        "text_input INT32": (raw(("text_input", (np.array([7], dtype=np.int32), "INT32"))), "text_input"),
        "stream as BYTES": (raw(("text_input", b"hi"), ("stream", b"yes")), "stream"),
        "flag as INT64": (raw(("text_input", b"hi"), ("return_finish_reason", (np.array([1]), "INT64"))),
                          "return_finish_reason"),
        "two prompts": (lambda: [tensor("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
                        "text_input"),
        "sampling not JSON": (raw(("text_input", b"hi"), ("sampling_parameters", b"{max_tokens: 3")), "JSON"),
        "sampling a JSON list": (raw(("text_input", b"hi"), ("sampling_parameters", b"[3]")), "JSON object"),
        "sampling not UTF-8": (raw(("text_input", b"hi"), ("sampling_parameters", b"\xff{}")), "UTF-8"),
        "text_input not UTF-8": (raw(("text_input", b"\xff\xfe\xc3(")), "UTF-8"),
        "empty prompt": (raw(("text_input", b"")), "empty"),
        "prompt over max_model_len": (raw(("text_input", too_long)), "prompt"),
        "prompt far over max_model_len": (raw(("text_input", far_too_long)), "prompt"),
        "max_tokens a string": (sampling({"max_tokens": "many"}), "max_tokens"),
        "max_tokens 0": (sampling({"max_tokens": 0}), "max_tokens"),
        "max_tokens -5": (sampling({"max_tokens": -5}), "max_tokens"),
        "max_tokens 1e11": (sampling({"max_tokens": 100_000_000_000}), "max_tokens"),
        "max_tokens over context": (sampling({"max_tokens": t.max_model_len + 1}), "max_tokens"),
        "max_tokens 1.5": (sampling({"max_tokens": 1.5}), "max_tokens"),
        "temperature -1": (sampling({"temperature": -1}), "temperature"),
        "temperature 1e999 (inf)": (raw(("text_input", b"hi"), ("sampling_parameters", b'{"temperature": 1e999}')),
                                    "temperature"),
        "temperature NaN": (raw(("text_input", b"hi"), ("sampling_parameters", b'{"temperature": NaN}')),
                            "temperature"),
        "top_p 0": (sampling({"top_p": 0}), "top_p"),
        "top_p 1.5": (sampling({"top_p": 1.5}), "top_p"),
        "top_k -7": (sampling({"top_k": -7}), "top_k"),
        "seed -1": (sampling({"seed": -1}), "seed"),
        "repetition_penalty 0": (sampling({"repetition_penalty": 0}), "repetition_penalty"),
        "frequency_penalty 5": (sampling({"frequency_penalty": 5}), "frequency_penalty"),
        "min_tokens > max_tokens": (sampling({"max_tokens": 2, "min_tokens": 3}), "min_tokens"),
        "stop a number": (sampling({"stop": 7}), "stop"),
        "stop empty string": (sampling({"stop": [""]}), "stop"),
        "stop_token_ids negative": (sampling({"stop_token_ids": [-1]}), "stop_token_ids"),
        "logprobs 99": (sampling({"logprobs": 99}), "logprobs"),
        "unknown key": (sampling({"beam_width": 4}), "beam_width"),
        "ignore_eos a string": (sampling({"ignore_eos": "yes"}), "ignore_eos"),
    }


def _bad_http(t: Target) -> dict[str, tuple[dict, str]]:
    return {
        "HTTP max_tokens -1": ({"text_input": "hi", "parameters": {"max_tokens": -1}}, "max_tokens"),
        "HTTP sampling not JSON": ({"text_input": "hi", "sampling_parameters": "{oops"}, "JSON"),
        "HTTP no text_input": ({"prompt": "hi"}, "text_input"),
        "HTTP empty prompt": ({"text_input": ""}, "empty"),
        "HTTP max_tokens over context": ({"text_input": "hi", "parameters": {"max_tokens": t.max_model_len * 4}},
                                         "max_tokens"),
        "HTTP top_p 2": ({"text_input": "hi", "parameters": {"top_p": 2}}, "top_p"),
    }


def kind_bad(t: Target, rng: random.Random) -> tuple[str, Outcome, bool]:
    grpc_cases, http_cases = _bad_grpc(t), _bad_http(t)
    case = rng.choice(list(grpc_cases) + list(http_cases))
    if case in grpc_cases:
        make, word = grpc_cases[case]
        o = grpc_request(t.grpc_url, make(), t.deadline_s)
    else:
        body, word = http_cases[case]
        o = http_request(t.http_url, body, t.deadline_s)
        if o.status == "error" and not o.detail.startswith("HTTP 400"):
            return case, o, False
    return case, o, o.status == "error" and word.lower() in o.detail.lower()


# name: (weight, function(target, rng) -> (case, outcome, expected))
KINDS: dict[str, tuple[int, Callable]] = {
    "stream": (30, kind_stream),
    "http_generate": (8, kind_http_generate),
    "http_stream": (6, kind_http_stream),
    "cancel": (12, kind_cancel),
    "http_drop": (4, kind_http_drop),
    "early_stop": (14, kind_early_stop),
    "bad": (16, kind_bad),
    "extreme": (10, kind_extreme),
}


# ---- the load ---------------------------------------------------------------------------------------

class Load:
    """`concurrency` client threads, each sending one request after another until stop()."""

    def __init__(self, target: Target, concurrency: int, seed: int, phase: str, results: list[Result],
                 kinds: tuple[str, ...] = ()):
        self.target, self.concurrency, self.seed, self.phase = target, concurrency, seed, phase
        self.kinds = list(kinds or KINDS)
        self.results, self._lock = results, threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "Load":
        for i in range(self.concurrency):
            t = threading.Thread(target=self._client, args=(random.Random(f"{self.seed}/{self.phase}/{i}"),),
                                 name=f"soak-{self.phase}-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _client(self, rng: random.Random) -> None:
        names = self.kinds
        weights = [KINDS[n][0] for n in names]
        while not self._stop.is_set():
            kind = rng.choices(names, weights)[0]
            t0 = time.monotonic()
            try:
                case, outcome, expected = KINDS[kind][1](self.target, rng)
            except Exception as e:  # noqa: BLE001 -- a client-side failure is counted, never silent
                case, outcome, expected = "client exception", Outcome("client_error", f"{type(e).__name__}: {e}"), False
            with self._lock:
                self.results.append(Result(kind, case, outcome, expected, time.monotonic() - t0))

    def stop(self, timeout: float) -> int:
        """Let every client finish its request; the number still running at the deadline."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self._threads)

    def count(self) -> int:
        with self._lock:
            return len(self.results)


# ---- the run -----------------------------------------------------------------------------------------

@dataclass
class SoakConfig:
    model: str = "models/smollm2-135m-instruct"
    seconds: float = 600.0            # traffic, warm-up included
    warmup: float = 60.0
    concurrency: int = 24
    rworkers: int = 2
    kv_capacity: str = "1G"
    deadline_s: float = 300.0         # a request without a final response by then is lost
    sample_interval_s: float = 15.0
    max_tokens: int = 48
    seed: int = 0
    idle_timeout_s: float = 180.0     # for the R-workers' KV to come back to 0 once the load stopped
    params: tuple[str, ...] = ()      # --param KEY=VALUE of fastdecode.ops.serve start
    kinds: tuple[str, ...] = ()       # only these kinds of traffic (default: all of KINDS)


def run_soak(cfg: SoakConfig, run_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Start the deployment in run_dir, drive the load, stop it; the figures (see module doc)."""
    started = time.monotonic()
    log(f"soak: starting the deployment (model {cfg.model}, {cfg.rworkers} R-workers) in {run_dir}")
    deployment = Deployment(cfg.model, run_dir, cfg.rworkers, cfg.kv_capacity, cfg.params).start()
    try:
        result = _drive(deployment, cfg, log)
    finally:
        stopped = deployment.stop()
    result["deployment"]["stop"] = stopped
    result["deployment"]["clean_stop"] = "stopped tritonserver" in stopped and "did not exit cleanly" not in stopped
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def _drive(d: Deployment, cfg: SoakConfig, log: Callable[[str], None]) -> dict:
    target = Target(d.grpc_url, d.http_url, model_max_len(cfg.model), cfg.deadline_s, cfg.max_tokens)
    procs = d.processes()
    results: list[Result] = []
    log(f"soak: warm-up {cfg.warmup:.0f} s, {cfg.concurrency} clients; processes {d.pids}")
    t0 = time.monotonic()
    warm = Load(target, cfg.concurrency, cfg.seed, "warmup", results, cfg.kinds).start()
    time.sleep(cfg.warmup)
    stuck = warm.stop(cfg.deadline_s + 60)
    kv_after_warmup = wait_kv_idle(d.rworker_addresses, cfg.idle_timeout_s)
    baseline = settled_sample(procs)
    log(f"soak: after warm-up ({len(results)} requests), idle: {_brief(baseline)}")

    load_s = max(0.0, cfg.seconds - cfg.warmup)
    load = Load(target, cfg.concurrency, cfg.seed, "load", results, cfg.kinds).start()
    load_started = time.monotonic()
    timeline: list[tuple[float, dict]] = []
    while (now := time.monotonic()) < load_started + load_s:
        timeline.append((now - t0, sample_processes(procs)))
        log(f"soak: {now - load_started:5.0f}/{load_s:.0f} s, {load.count()} requests: {_brief(timeline[-1][1])}")
        time.sleep(min(cfg.sample_interval_s, max(0.0, load_started + load_s - time.monotonic())))
    timeline.append((time.monotonic() - t0, sample_processes(procs)))
    stuck += load.stop(cfg.deadline_s + 60)
    traffic_s = time.monotonic() - t0

    check = grpc_request(d.grpc_url, valid_inputs("Still serving?", {"max_tokens": 4, "temperature": 0.0}),
                         cfg.deadline_s)
    kv_idle = wait_kv_idle(d.rworker_addresses, cfg.idle_timeout_s)
    end = settled_sample(procs)
    log(f"soak: load stopped ({len(results)} requests), idle: {_brief(end)}")
    return summarize(cfg, d, results, baseline, end, timeline, kv_after_warmup, kv_idle, check, stuck, traffic_s)


def _brief(sample: dict[str, dict]) -> str:
    return "; ".join(f"{n} {s['rss'] / 2**20:.0f} MiB (anon {s.get('rss_anon', 0) / 2**20:.0f}) {s['fds']} fds "
                     f"{s['threads']} thr" if s["alive"] else f"{n} DEAD" for n, s in sample.items())


def summarize(cfg: SoakConfig, d: Deployment, results: list[Result], baseline: dict, end: dict,
              timeline: list[tuple[float, dict]], kv_after_warmup: dict, kv_idle: dict, check: Outcome,
              stuck: int, traffic_s: float) -> dict:
    processes, failures = {}, []
    for name in baseline:
        b, e = baseline[name], end[name]
        under_load = [s[name] for _, s in timeline if s[name]["alive"]]
        alive = b["alive"] and e["alive"] and len(under_load) == len(timeline)
        if not alive:
            failures.append(f"process {name} (pid {d.pids[name]}) died")
        processes[name] = {
            "pid": d.pids[name], "alive": alive, "after_warmup": b, "end": e,
            "rss_growth_fraction": round((e["rss"] - b["rss"]) / b["rss"], 4) if alive else None,
            "fd_growth": e["fds"] - b["fds"] if alive else None,
            "thread_growth": e["threads"] - b["threads"] if alive else None,
            "max_under_load": {k: max((s[k] for s in under_load), default=None) for k in ("rss", "fds", "threads")},
            "samples_t_rss_fds_threads_anon_shmem": [
                [round(t, 1), s[name]["rss"], s[name]["fds"], s[name]["threads"], s[name].get("rss_anon"),
                 s[name].get("rss_shmem")] for t, s in timeline if s[name]["alive"]],
        }

    def worst(key):
        values = [p[key] for p in processes.values() if p[key] is not None]
        return max(values) if values and len(values) == len(processes) else None

    requests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    cases: dict[str, dict[str, collections.Counter]] = collections.defaultdict(lambda: collections.defaultdict(
        collections.Counter))
    errors: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for r in results:
        o = r.outcome
        requests[r.kind]["sent"] += 1
        requests[r.kind][o.status] += 1
        cases[r.kind][r.case][o.status if o.status != "ok" else f"ok ({o.detail or 'no finish reason'})"] += 1
        seconds[r.kind].append(r.seconds)
        if o.status not in ("ok", "cancelled"):
            errors[r.kind][o.detail[:200]] += 1
        if not r.expected:
            requests[r.kind]["unexpected"] += 1
            unexpected[r.kind][f"{r.case}: {o.status}: {o.detail}"[:300]] += 1

    lost = sum(c["lost"] for c in requests.values())
    kv_bytes = None if any("error" in s for s in kv_idle.values()) else sum(s["bytes_used"] for s in kv_idle.values())
    rss_growth = worst("rss_growth_fraction")
    n_unexpected = sum(c["unexpected"] for c in requests.values())
    if lost:
        failures.append(f"{lost} request(s) lost (no final response in {cfg.deadline_s:.0f} s)")
    if kv_bytes != 0 or any(s.get("sequences") for s in kv_idle.values()):
        failures.append(f"R-workers still hold KV {cfg.idle_timeout_s:.0f} s after the load stopped: {kv_idle}")
    if rss_growth is None or rss_growth > MAX_RSS_GROWTH:
        failures.append(f"RSS growth of the worst process {rss_growth} (limit {MAX_RSS_GROWTH})")
    if n_unexpected:
        failures.append(f"{n_unexpected} request(s) got an answer their kind does not allow (see unexpected)")
    if stuck:
        failures.append(f"{stuck} client(s) still waiting when the load stopped")
    if check.status != "ok":
        failures.append(f"a plain request after the load failed: {check.status}: {check.detail}")
    if not results:
        failures.append("no request was sent")

    return {
        "lost_requests": lost,
        "kv_bytes_idle": kv_bytes,
        "rss_growth_fraction": rss_growth,
        "fd_growth": worst("fd_growth"),
        "thread_growth": worst("thread_growth"),
        "passed": not failures,
        "duration_s": round(traffic_s, 1),
        "failures": failures,
        "requests_total": len(results),
        "requests_by_kind": {k: dict(v) for k, v in sorted(requests.items())},
        "errors_by_kind": {k: dict(v.most_common(25)) for k, v in sorted(errors.items())},
        "unexpected_by_kind": {k: dict(v.most_common(25)) for k, v in sorted(unexpected.items())},
        "cases_by_kind": {k: {c: dict(n) for c, n in sorted(v.items())} for k, v in sorted(cases.items())},
        "request_seconds_by_kind": {k: {"p50": round(float(np.median(v)), 3), "max": round(max(v), 3)}
                                    for k, v in sorted(seconds.items())},
        "processes": processes,
        "rworker_kv_after_warmup": kv_after_warmup,
        "rworker_kv_idle": kv_idle,
        "final_check": {"status": check.status, "detail": check.detail},
        "logs": log_summary(d.run_dir),
        "deployment": {"model": cfg.model, "rworkers": cfg.rworkers, "kv_capacity": cfg.kv_capacity,
                       "params": list(cfg.params), "grpc": d.grpc_url, "http": d.http_url,
                       "rworker_addresses": d.rworker_addresses},
        "load": {"seconds": cfg.seconds, "warmup_s": cfg.warmup, "traffic_s": round(traffic_s, 1),
                 "concurrency": cfg.concurrency, "deadline_s": cfg.deadline_s, "max_tokens": cfg.max_tokens,
                 "sample_interval_s": cfg.sample_interval_s, "seed": cfg.seed,
                 "weights": {k: w for k, (w, _) in KINDS.items() if k in (cfg.kinds or KINDS)}},
        **machine(),
    }


def log_summary(run_dir: Path) -> dict:
    """Size and error lines of tritonserver's log (Triton prefixes errors with E) and the R-workers'."""
    out = {}
    for path in [run_dir / "tritonserver.log", *sorted((run_dir / "rworkers").glob("worker-*.log"))]:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        bad = [line[:300] for line in lines if line.startswith("E") or " ERROR " in line or "Traceback" in line]
        out[path.name] = {"bytes": path.stat().st_size, "error_lines": len(bad), "last_errors": bad[-5:]}
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {"cpu_model": cpu, "cores": os.cpu_count(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="traffic, warm-up included (600)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of traffic before the baseline sample (60)")
    p.add_argument("--concurrency", type=int, default=24, help="client threads (24)")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--rworkers", type=int, default=2)
    p.add_argument("--kv-capacity", default="1G", help="KV pool of each R-worker (1G)")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds before a request counts as lost (300)")
    p.add_argument("--sample-interval", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=48, help="the longest normal request (48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="model parameter, as serve's")
    p.add_argument("--only", action="append", default=[], choices=list(KINDS), metavar="KIND",
                   help=f"send only this kind of traffic (repeatable; default all: {', '.join(KINDS)})")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "soak.json"))
    args = p.parse_args(argv)
    if args.warmup >= args.seconds or args.concurrency < 1:
        p.error("need --warmup < --seconds and --concurrency >= 1")
    cfg = SoakConfig(model=args.model, seconds=args.seconds, warmup=args.warmup, concurrency=args.concurrency,
                     rworkers=args.rworkers, kv_capacity=args.kv_capacity, deadline_s=args.deadline,
                     sample_interval_s=args.sample_interval, max_tokens=args.max_tokens, seed=args.seed,
                     params=tuple(args.param), kinds=tuple(args.only))
    run_dir = Path(tempfile.mkdtemp(prefix="fastdecode-soak-"))
    try:
        result = run_soak(cfg, run_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    except Exception as e:  # noqa: BLE001 -- the deployment did not come up: say why, keep its logs
        print(f"soak: {type(e).__name__}: {e}\nlogs kept in {run_dir}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    keys = ("lost_requests", "kv_bytes_idle", "rss_growth_fraction", "fd_growth", "thread_growth", "requests_total")
    print(json.dumps({k: result[k] for k in keys}), file=sys.stderr)
    print(f"soak: wrote {out}", file=sys.stderr)
    if result["failures"]:
        print("soak: FAILED\n  " + "\n  ".join(result["failures"]) + f"\nlogs kept in {run_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(run_dir, ignore_errors=True)
    print("soak: passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
