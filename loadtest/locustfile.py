"""Load test of Triton's generate endpoints (`make loadtest`: 64 users, 120 s, 127.0.0.1:8000).

    python -m locust -f loadtest/locustfile.py --headless -u 64 -r 16 -t 120s --host http://127.0.0.1:8000

Two users: GenerateUser posts /v2/models/fastdecode/generate (one JSON response);
StreamUser posts .../generate_stream with "stream": true and reads the server-sent events,
reporting time to first event as its own entry. Bounded: short completions (FASTDECODE_LOADTEST_MAX_TOKENS,
default 32), a pause between requests, and a refusal to target anything but loopback.
"""
from __future__ import annotations

import json
import os
import random
import time
from urllib.parse import urlparse

from locust import HttpUser, between, events, task

MODEL = os.environ.get("FASTDECODE_LOADTEST_MODEL", "fastdecode")
MAX_TOKENS = int(os.environ.get("FASTDECODE_LOADTEST_MAX_TOKENS", "32"))
PROMPTS = [
    "Write one sentence about the sea.",
    "List three uses of bread.",
    "Explain what a KV-cache is in one line.",
    "Say hello in French, Russian and Chinese.",
    "Give a haiku about trains.",
]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@events.test_start.add_listener
def _loopback_only(environment, **_):
    host = urlparse(environment.host or "").hostname
    if host not in LOOPBACK:
        raise SystemExit(f"loadtest targets loopback only (127.0.0.1), not {environment.host!r}")


def _body(stream: bool) -> dict:
    return {"text_input": random.choice(PROMPTS), "stream": stream, "exclude_input_in_output": True,
            "return_num_output_tokens": True,
            "sampling_parameters": json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0.7})}


class GenerateUser(HttpUser):
    wait_time = between(0.5, 2.0)

    @task
    def generate(self):
        with self.client.post(f"/v2/models/{MODEL}/generate", json=_body(False), name="generate",
                              catch_response=True, timeout=120) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif "text_output" not in r.json():
                r.failure("no text_output in the response")


class StreamUser(HttpUser):
    wait_time = between(0.5, 2.0)

    @task
    def generate_stream(self):
        t0 = time.perf_counter()
        first = None
        events_seen = tokens = first_tokens = 0
        with self.client.post(f"/v2/models/{MODEL}/generate_stream", json=_body(True), name="generate_stream",
                              stream=True, catch_response=True, timeout=120) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    r.failure(event["error"])
                    return
                events_seen += 1
                tokens += int(event.get("num_output_tokens", 0))
                if first is None:
                    first, first_tokens = time.perf_counter() - t0, tokens
            if not events_seen:
                r.failure("no events in the stream")
                return
        total = time.perf_counter() - t0
        timings = [("time_to_first_event", first), ("whole_stream", total)]
        if tokens > first_tokens:            # the tokens after the first event, each in this time
            timings.append(("time_per_output_token", (total - first) / (tokens - first_tokens)))
        for name, seconds in timings:
            self.environment.events.request.fire(request_type="SSE", name=name, response_time=seconds * 1000,
                                                 response_length=events_seen, exception=None, context={})
