"""For tests: a checkpoint copy with a chat template, and the frontend as a subprocess."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TEST_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def with_chat_template(model_dir: str | Path, dest: str | Path, template: str = TEST_CHAT_TEMPLATE) -> Path:
    """The tokenizer and config of `model_dir` in `dest`, the tokenizer given `template`."""
    from transformers import AutoTokenizer

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(dest)
    shutil.copy2(Path(model_dir) / "config.json", dest / "config.json")
    return dest


class Frontend:
    """`python -m openai_frontend` on host:port, stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, triton_url: str, model_dir: str | Path, port: int, *, name: str, log_path: Path,
                 host: str = "127.0.0.1", extra: list[str] | None = None):
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "openai_frontend", "--triton-url", triton_url, "--model-dir", str(model_dir),
                     "--host", host, "--port", str(port), "--served-model-name", name, *(extra or [])]
        self.proc: subprocess.Popen | None = None
        self.killed = False

    def __enter__(self) -> "Frontend":
        repo = Path(__file__).resolve().parent.parent
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
        try:
            self.wait_healthy(120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"openai_frontend exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"openai_frontend not healthy after {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait(5)
        self.exit_code = self.proc.returncode if self.proc is not None else None


def post(url: str, body, timeout: float = 60) -> tuple[int, dict | str]:
    """(status, JSON body or text); `body` bytes/str is sent as is (garbage on purpose)."""
    data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def engine_load(metrics_url: str) -> dict[str, float]:
    """The fastdecode model's live load from Triton's metrics: requests running and waiting, KV
    tokens held (summed over R-workers) and requests finished as cancelled."""
    import re

    body = urllib.request.urlopen(metrics_url, timeout=5).read().decode()

    def total(name: str, label: str = "") -> float:
        return sum(float(v) for labels, v in re.findall(rf"^{name}\{{(.*?)\}} (\S+)$", body, re.M) if label in labels)

    return {"running": total("fastdecode_requests_running"), "waiting": total("fastdecode_requests_waiting"),
            "kv_tokens": total("fastdecode_kv_tokens"),
            "cancelled": total("fastdecode_requests_finished_total", 'reason="cancelled"')}


def wait_for(condition, timeout: float = 15.0):
    """Poll until condition() is truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value
