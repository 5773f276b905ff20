"""Model parameters (config.pbtxt `parameters`) -> EngineConfig + the host's own options.

Every parameter whose key is an EngineConfig field goes to EngineConfig (strings, parsed by
EngineConfig.from_dict); an empty value means "not set". FASTDECODE_* environment variables
(EngineConfig.from_env) fill what config.pbtxt leaves unset -- the place for secrets such as
FASTDECODE_RWORKER_TOKEN. Relative paths resolve against the fastdecode checkout
(fastdecode.config.REPO_ROOT), never this machine's absolute paths.

Host options (not EngineConfig fields):
    plan                   JSON file from `python -m fastdecode plan` (`make plan` writes
                           bench/results/plan.json): its "settings" (EngineConfig fields) are
                           defaults under config.pbtxt's values, above FASTDECODE_* variables
    cancel_poll_ms         how often the host asks Triton whether a request was cancelled (100)
    metrics_interval_ms    how often metrics are pushed to Triton (1000)
    fault_step_error_file  TEST ONLY: while this file exists, engine.step raises (crash drill)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from fastdecode.config import REPO_ROOT, EngineConfig

PATH_KEYS = ("model", "trace_path", "rworker_tls_ca", "rworker_tls_cert", "rworker_tls_key", "plan",
             "fault_step_error_file")


@dataclass(frozen=True)
class HostOptions:
    cancel_poll_s: float = 0.1
    metrics_interval_s: float = 1.0
    fault_step_error_file: str = ""


def model_parameters(model_config: dict) -> dict[str, str]:
    """{"parameters": {"key": {"string_value": "v"}}} -> {"key": "v"}, empty values dropped."""
    params = {}
    for key, value in (model_config.get("parameters") or {}).items():
        text = value.get("string_value", "") if isinstance(value, dict) else str(value)
        if text.strip():
            params[key] = text.strip()
    return params


def resolve_path(value: str, root: Path = REPO_ROOT) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (root / path))


def load_plan(path: str) -> dict:
    """The EngineConfig settings of a plan file, as `python -m fastdecode plan` writes it
    (fastdecode/perfmodel.py main): {"settings": {field: value}, "plan": {...}, "perf_model": {...}}.
    A file that cannot be read, has no non-empty "settings" object, or names a setting that is not an
    EngineConfig field or whose JSON value is not of the field's type is a ValueError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"plan {path}: cannot read a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"plan {path}: expected a JSON object, got {type(data).__name__}")
    settings = data.get("settings")
    if not isinstance(settings, dict) or not settings:
        raise ValueError(f'plan {path}: no "settings" object with at least one setting; write the file '
                         f"with `python -m fastdecode plan --model DIR --out FILE`")
    types = {f.name: f.type for f in fields(EngineConfig)}
    unknown = sorted(set(settings) - set(types))
    if unknown:
        raise ValueError(f"plan {path}: unknown setting(s) {unknown}; settings must be EngineConfig fields")
    values = {}
    for key, value in settings.items():
        ok, converted = _json_setting(types[key], value)
        if not ok:
            raise ValueError(f"plan {path}: setting {key}={json.dumps(value)} is not a valid {types[key]}")
        values[key] = converted
    return values


def _json_setting(type_name: str, value) -> tuple[bool, object]:
    """(is `value`, a JSON value, of EngineConfig field type `type_name`?, the value to use)."""
    if type_name == "bool":
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if type_name == "int":
        return isinstance(value, int), value
    if type_name == "float":
        ok = isinstance(value, (int, float)) and math.isfinite(value)
        return ok, float(value) if ok else value
    if type_name == "str":
        return isinstance(value, str), value
    if type_name.startswith("tuple"):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return ok, tuple(value) if ok else value
    return False, value


def build_configs(params: dict[str, str], root: Path = REPO_ROOT) -> tuple[EngineConfig, HostOptions]:
    params = {k: (resolve_path(v, root) if k in PATH_KEYS else v) for k, v in params.items()}
    known = {f.name for f in fields(EngineConfig)}
    host_keys = {"plan", "cancel_poll_ms", "metrics_interval_ms", "fault_step_error_file"}
    unknown = set(params) - known - host_keys
    if unknown:
        raise ValueError(f"unknown model parameter(s) {sorted(unknown)}; EngineConfig fields or {sorted(host_keys)}")
    explicit = {k: v for k, v in params.items() if k in known}
    planned = load_plan(params["plan"]) if "plan" in params else {}
    planned = {k: (resolve_path(v, root) if k in PATH_KEYS and v else v) for k, v in planned.items()}
    if planned:
        try:
            engine = _engine_config({**planned, **explicit})
        except ValueError as e:
            _engine_config(explicit)           # still fails without the plan: not the plan's fault
            raise ValueError(f"plan {params['plan']}: its settings ({', '.join(sorted(planned))}) are not valid "
                             f"here: {e}") from None
    else:
        engine = _engine_config(explicit)
    host = HostOptions(cancel_poll_s=_millis(params, "cancel_poll_ms", 100),
                       metrics_interval_s=_millis(params, "metrics_interval_ms", 1000),
                       fault_step_error_file=params.get("fault_step_error_file", ""))
    return engine, host


def _engine_config(values: dict) -> EngineConfig:
    if values.get("rworkers") and "attention" not in values:
        values = {**values, "attention": "remote"}
    return EngineConfig.from_env(**values)


def _millis(params: dict, key: str, default: int) -> float:
    try:
        value = int(params.get(key, default))
    except ValueError:
        raise ValueError(f"model parameter {key} must be a whole number of milliseconds") from None
    if value <= 0:
        raise ValueError(f"model parameter {key} must be > 0")
    return value / 1000.0
