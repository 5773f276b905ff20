"""Model parameters (config.pbtxt `parameters`) -> EngineConfig + the host's own options.

Every parameter whose key is an EngineConfig field is an engine setting, read by
fastdecode.config.config_from_settings like every other entry point's (an empty value means
"not set"; FASTDECODE_* environment variables fill what config.pbtxt leaves unset -- the place
for secrets such as FASTDECODE_RWORKER_TOKEN; relative paths resolve against the checkout).

Host options (not EngineConfig fields):
    plan                   JSON file from `python -m fastdecode plan` (`make plan` writes
                           bench/results/plan.json): its "settings" (EngineConfig fields) are
                           defaults under config.pbtxt's values, above FASTDECODE_* variables
    cancel_poll_ms         how often the host asks Triton whether a request was cancelled, 32
                           requests at a time (250)
    metrics_interval_ms    how often metrics are pushed to Triton (1000)
    send_threads           threads that send responses to Triton, several in flight (8; 1 = one
                           at a time; each request's responses stay in order on one of them)
    stream_interval        tokens a streamed response carries (auto: 1 while at most 16 requests are
                           in flight, 2 up to 32, 4 up to 64, 8 beyond; N: N). The first token and
                           the last output go out at once
    max_hold_ms            the longest a generated token waits for the next ones to share its
                           response (2000)
    fault_step_error_file  TEST ONLY: while this file exists, engine.step raises (crash drill)
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from fastdecode.config import REPO_ROOT, EngineConfig, config_from_settings, resolve_path
from python_backend.host import MAX_STREAM_INTERVAL

HOST_KEYS = ("plan", "cancel_poll_ms", "metrics_interval_ms", "send_threads", "stream_interval",
             "max_hold_ms", "fault_step_error_file")
MAX_SEND_THREADS = 64


@dataclass(frozen=True)
class HostOptions:
    cancel_poll_s: float = 0.25
    metrics_interval_s: float = 1.0
    send_threads: int = 8
    stream_interval: int = 0                    # 0 = auto
    max_hold_s: float = 2.0
    fault_step_error_file: str = ""


def model_parameters(model_config: dict) -> dict[str, str]:
    """{"parameters": {"key": {"string_value": "v"}}} -> {"key": "v"}, empty values dropped."""
    params = {}
    for key, value in (model_config.get("parameters") or {}).items():
        text = value.get("string_value", "") if isinstance(value, dict) else str(value)
        if text.strip():
            params[key] = text.strip()
    return params


def build_configs(params: dict[str, str], root: Path = REPO_ROOT) -> tuple[EngineConfig, HostOptions]:
    known = {f.name for f in fields(EngineConfig)}
    unknown = set(params) - known - set(HOST_KEYS)
    if unknown:
        raise ValueError(f"unknown model parameter(s) {sorted(unknown)}; EngineConfig fields or {sorted(HOST_KEYS)}")
    plan = resolve_path(params["plan"], root) if "plan" in params else ""
    engine = config_from_settings({k: v for k, v in params.items() if k in known}, plan=plan, root=root)
    fault = params.get("fault_step_error_file", "")
    host = HostOptions(cancel_poll_s=_millis(params, "cancel_poll_ms", 250),
                       metrics_interval_s=_millis(params, "metrics_interval_ms", 1000),
                       send_threads=_send_threads(params), stream_interval=_stream_interval(params),
                       max_hold_s=_millis(params, "max_hold_ms", 2000),
                       fault_step_error_file=resolve_path(fault, root) if fault else "")
    return engine, host


def _millis(params: dict, key: str, default: int) -> float:
    try:
        value = int(params.get(key, default))
    except ValueError:
        raise ValueError(f"model parameter {key} must be a whole number of milliseconds") from None
    if value <= 0:
        raise ValueError(f"model parameter {key} must be > 0")
    return value / 1000.0


def _send_threads(params: dict) -> int:
    text = params.get("send_threads", str(HostOptions.send_threads))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SEND_THREADS:
        raise ValueError(f"model parameter send_threads must be a whole number in [1, {MAX_SEND_THREADS}], "
                         f"got {text!r}")
    return value


def _stream_interval(params: dict) -> int:
    text = params.get("stream_interval", "auto")
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_STREAM_INTERVAL:
        raise ValueError(f"model parameter stream_interval must be auto or a whole number in "
                         f"[1, {MAX_STREAM_INTERVAL}], got {text!r}")
    return value
