"""The frontend as a detached process beside tritonserver (`fastdecode.ops.serve start` / `stop`):
pid and log in the run dir, ready when GET /health answers 200."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fastdecode.ops.procs import alive
from fastdecode.ops.triton import stop_process

PID_FILE = "openai_frontend.pid"
LOG_FILE = "openai_frontend.log"


def start(run_dir: Path, triton_grpc_url: str, model_dir: str, host: str, port: int, timeout: float = 120.0) -> str:
    """Start it and wait until it serves; -> its base URL. RuntimeError with the log's tail if it
    exits or does not answer within `timeout` (it is stopped then)."""
    log_path = run_dir / LOG_FILE
    argv = [sys.executable, "-m", "openai_frontend", "--triton-url", triton_grpc_url, "--model-dir", str(model_dir),
            "--host", host, "--port", str(port), "--served-model-name", Path(model_dir).name]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    (run_dir / PID_FILE).write_text(str(proc.pid))
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _healthy(url):
            return url
        time.sleep(0.5)
    stop(run_dir)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    why = f"exited with {proc.returncode}" if proc.returncode is not None else f"not serving after {timeout:g} s"
    raise RuntimeError(f"the OpenAI frontend {why}; {log_path}:\n{tail}")


def stop(run_dir: Path, timeout: float = 15.0) -> int | None:
    """Stop the frontend recorded in `run_dir`; -> its pid, None when none ran."""
    pid_file = run_dir / PID_FILE
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text())
    if alive(pid):
        stop_process(pid, timeout=timeout)
    pid_file.unlink(missing_ok=True)
    return pid


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
