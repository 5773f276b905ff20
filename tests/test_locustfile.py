"""loadtest/locustfile.py driven by real locust (a subprocess: locust monkey-patches the standard
library with gevent) against a small local HTTP server that answers like Triton's generate
endpoints, or with errors."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fastdecode.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


class FakeTriton(BaseHTTPRequestHandler):
    broken = False
    bodies: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeTriton.bodies.append(body)
        if FakeTriton.broken:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "engine crashed"}')
            return
        self.send_response(200)
        if self.path.endswith("/generate_stream"):
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for text in ("Bon", "jour", "!"):
                event = {"text_output": text, "num_output_tokens": 1}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        else:
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"text_output": "Bonjour!", "num_output_tokens": 3}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_triton():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeTriton)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeTriton.broken, FakeTriton.bodies = False, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_locust(host: str, out: Path, seconds: int = 4) -> tuple[dict[str, dict], subprocess.CompletedProcess]:
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", "4",
         "-r", "4", "-t", f"{seconds}s", "--host", host, "--csv", str(out / "run"), "--only-summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    rows = {}
    if (out / "run_stats.csv").exists():
        with open(out / "run_stats.csv") as f:
            rows = {r["Name"]: r for r in csv.DictReader(f)}
    return rows, proc


def test_users_send_valid_requests_and_report_stream_timings(fake_triton, tmp_path):
    rows, proc = run_locust(fake_triton, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("generate", "generate_stream", "time_to_first_event", "whole_stream", "time_per_output_token"):
        assert int(rows[name]["Request Count"]) > 0, (name, rows.keys())
        assert int(rows[name]["Failure Count"]) == 0
    assert FakeTriton.bodies
    for body in FakeTriton.bodies:            # what the engine will be asked: valid sampling parameters
        assert isinstance(body["text_input"], str) and body["text_input"]
        SamplingParams.from_dict(json.loads(body["sampling_parameters"]))


def test_server_errors_count_as_failures(fake_triton, tmp_path):
    FakeTriton.broken = True
    rows, proc = run_locust(fake_triton, tmp_path, seconds=3)
    assert int(rows["generate"]["Failure Count"]) == int(rows["generate"]["Request Count"]) > 0
    assert int(rows["generate_stream"]["Failure Count"]) == int(rows["generate_stream"]["Request Count"]) > 0
    assert "time_per_output_token" not in rows or int(rows["time_per_output_token"]["Request Count"]) == 0


def test_refuses_a_host_other_than_loopback(tmp_path):
    rows, proc = run_locust("http://192.0.2.1:8000", tmp_path, seconds=2)
    assert proc.returncode != 0
    assert "loopback only" in proc.stderr + proc.stdout
    assert not rows.get("generate") or int(rows["generate"]["Request Count"]) == 0
