"""The one configuration object of fastdecode, and the one way to it from text.

Every setting the engine, the attention backends and the scheduler read lives in
`EngineConfig`. Every entry point (Triton model parameters, `make serve --param`,
`python -m fastdecode`, benches) turns its text settings into one with
`config_from_settings`. This module is the only reader of environment variables.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from rpart.formats import INT4_GROUPS, KV_FORMATS, parse_size

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"

ATTENTION_BACKENDS = ("local", "remote", "torch")
SCHEDULERS = ("fcfs", "sls")
CPU_GEMMS = ("auto", "onednn", "avx512bf16")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    # model
    model: str = str(DEFAULT_MODEL_DIR)
    dtype: str = "auto"                   # "auto": GPU bf16/fp16; CPU the faster of bf16 and fp32 (model/dtype_choice.py)
    device: str = "auto"                  # "auto" = cuda when present, else cpu
    max_model_len: int = 0                # 0 = the checkpoint's max_position_embeddings
    cpu_gemm: str = "auto"                # bf16 products on the CPU: auto | onednn | avx512bf16 (model/packed.py)

    # R-Part (attention backend)
    attention: str = "local"              # local | remote | torch (pure-torch reference)
    rworkers: tuple[str, ...] = ()        # "host:port" of R-workers (attention="remote")
    rworker_token: str = ""               # shared secret sent on every R-worker call
    rworker_tls_ca: str = ""              # CA bundle to verify R-workers (enables TLS)
    rworker_tls_cert: str = ""            # client cert/key for mutual TLS
    rworker_tls_key: str = ""
    rworker_timeout_s: float = 10.0       # deadline of one R-worker call
    head_shards: int = 1                  # R-workers that split one sequence's KV heads
    kv_format: str = "fp16"               # fp16 | int4
    kv_int4_fp16_tail: bool = True        # int4: each sequence's newest block also in fp16 (local backend)
    kv_int4_k_group: int = 0              # int4 (local backend): key channels per scale and zero; 0 = 32
    kv_int4_v_group: int = 0              # int4 (local backend): value channels per scale and zero; 0 = 64
    kv_capacity_bytes: int = 2 << 30      # local backend's KV pool
    kv_populate: bool = True              # local backend: commit the pool's memory from the start, not at first use
    kv_block_size: int = 16               # tokens per KV block
    kernel_threads: int = 0               # 0 = all cores

    # batching and admission
    max_running: int = 512                # sequences decoding at once
    max_waiting: int = 4096               # queued requests before new ones are refused
    max_prefill_tokens: int = 4096        # prompt tokens prefilled in one step
    num_minibatches: int = 2              # ping-pong mini-batches (docs/design.md, "Pipeline")
    scheduler: str = "fcfs"               # fcfs | sls
    sls_f: int = 8                        # admit a micro-batch every F steps
    sls_w_lim: int = 0                    # bound on total context in flight; 0 = derive
    sls_target_len: int = 0               # S of Algorithm 1; 0 = derive from requests
    burst_gap_ms: float = 5.0             # an idle engine admits a burst together: it waits while requests
    burst_window_ms: float = 1000.0       # arrive under burst_gap_ms apart, up to burst_window_ms; 0 = at once

    # observability
    trace_path: str = ""                  # JSON lines of per-step trace; "" = off
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.attention in ATTENTION_BACKENDS,
              f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        check(self.scheduler in SCHEDULERS, f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        check(self.cpu_gemm in CPU_GEMMS, f"cpu_gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        check(self.kv_format in KV_FORMATS, f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        check(self.attention != "remote" or len(self.rworkers) > 0,
              "attention='remote' needs at least one R-worker address")
        check(self.max_running >= 1 and self.max_waiting >= 0, "max_running >= 1 and max_waiting >= 0")
        check(self.num_minibatches in (1, 2), "num_minibatches must be 1 or 2")
        check(self.sls_f >= 1, "sls_f must be >= 1")
        check(self.head_shards >= 1, "head_shards must be >= 1")
        for name in ("burst_gap_ms", "burst_window_ms"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and value >= 0, f"{name} must be a finite number of milliseconds >= 0, got {value!r}")
        check(bool(self.rworker_tls_cert) == bool(self.rworker_tls_key),
              "rworker_tls_cert and rworker_tls_key go together (mutual TLS)")
        check(not self.rworker_tls_cert or bool(self.rworker_tls_ca),
              "mutual TLS (rworker_tls_cert) needs rworker_tls_ca to verify the R-workers")
        check(self.kv_block_size >= 1 and self.kv_capacity_bytes > 0, "kv_block_size and kv_capacity_bytes > 0")
        check(isinstance(self.kv_int4_fp16_tail, bool), "kv_int4_fp16_tail must be a bool")
        check(isinstance(self.kv_populate, bool), "kv_populate must be a bool")
        for name in ("kv_int4_k_group", "kv_int4_v_group"):
            value = getattr(self, name)
            check(type(value) is int and value in INT4_GROUPS,
                  f"{name} must be one of {INT4_GROUPS} (0 = the kernel's default), got {value!r}")

    @property
    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # imported lazily: the config is torch-free for the scheduler

        return "cuda" if torch.cuda.is_available() else "cpu"

    def replace(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        """Build from strings (Triton parameters, CLI, env): unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, raw in values.items():
            if key not in known:
                raise ValueError(f"EngineConfig: unknown setting {key!r}")
            kwargs[key] = _coerce(known[key].type, raw, key)
        return cls(**kwargs)

    @classmethod
    def from_env(cls, prefix: str = "FASTDECODE_", **overrides) -> "EngineConfig":
        values = {}
        for f in fields(cls):
            env = os.environ.get(prefix + f.name.upper())
            if env is not None:
                values[f.name] = env
        values.update(overrides)
        return cls.from_dict(values)


# ---- text settings -> EngineConfig

PATH_SETTINGS = ("model", "trace_path", "rworker_tls_ca", "rworker_tls_cert", "rworker_tls_key")


def config_from_settings(settings: Mapping[str, object], plan: str = "", root: Path = REPO_ROOT) -> EngineConfig:
    """Explicit settings (strings or typed values), over a plan file's (`python -m fastdecode plan`),
    over FASTDECODE_* environment variables, over the defaults. R-worker addresses with no
    `attention` setting mean attention=remote; relative paths resolve against `root`."""
    explicit = _resolved(settings, root)
    planned = _resolved(load_plan(plan), root) if plan else {}
    if not planned:
        return _from_layers(explicit)
    try:
        return _from_layers({**planned, **explicit})
    except ValueError as e:
        _from_layers(explicit)                  # still fails without the plan: not the plan's fault
        raise ValueError(f"plan {plan}: its settings ({', '.join(sorted(planned))}) are not valid here: {e}") from None


def _resolved(settings: Mapping[str, object], root: Path) -> dict:
    return {k: (resolve_path(v, root) if k in PATH_SETTINGS and isinstance(v, str) and v else v)
            for k, v in settings.items()}


def _from_layers(values: dict) -> EngineConfig:
    if values.get("rworkers") and "attention" not in values:
        values = {**values, "attention": "remote"}
    return EngineConfig.from_env(**values)


def resolve_path(value: str, root: Path = REPO_ROOT) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (root / path))


def load_plan(path: str) -> dict:
    """The EngineConfig settings of a plan file, as `python -m fastdecode plan` writes it
    (fastdecode/ops/plan.py): {"settings": {field: value}, "plan": {...}, "perf_model": {...}}.
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


def process_env(**extra: str) -> dict[str, str]:
    """This process's environment with `extra` set: for the processes fastdecode starts."""
    return {**os.environ, **extra}


def _coerce(type_name: str, raw, key: str):
    if not isinstance(raw, str):
        return tuple(raw) if type_name.startswith("tuple") and not isinstance(raw, tuple) else raw
    try:
        if type_name == "int":
            return parse_size(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            word = raw.strip().lower()
            if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(word)
            return word in ("1", "true", "yes", "on")
        if type_name.startswith("tuple"):
            return tuple(a.strip() for a in raw.split(",") if a.strip())
    except ValueError:
        raise ValueError(f"EngineConfig: {key}={raw!r} is not a valid {type_name}") from None
    return raw
