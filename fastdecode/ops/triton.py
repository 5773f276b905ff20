"""tritonserver from the PyPI wheel nvidia-pytriton, run as a child process with our model repository.

The launch recipe for the `tritonserver` of the PyPI wheel nvidia-pytriton==0.7.0 (Triton 2.51),
proven on a CPU-only machine:
  1. the Python backend needs the stub for our Python beside it:
     cp pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub
        pytriton/tritonserver/backends/python/          (`make setup` does it; ensure_stub() too)
  2. PATH starts with the venv's bin: the stub finds its packages through `python3`;
  3. LD_LIBRARY_PATH starts with this interpreter's libpython directory (the stub must load the
     libpython of the stdlib it imports, not the system's) and ends with
     site-packages/nvidia_pytriton.libs (what pytriton does);
  4. tritonserver --model-repository R --backend-directory pytriton/tritonserver/backends
        --http-address/--grpc-address/--metrics-address 127.0.0.1 and the three ports,
        --model-control-mode explicit --load-model '*'  (explicit mode lets a model whose
        engine crashed unload itself, so that it reports not-ready instead of hanging clients);
  5. poll GET /v2/health/ready with a timeout, and give up early when the process exits: a stub
     that cannot start can hang the server.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

from fastdecode.config import REPO_ROOT, process_env
from fastdecode.ops.procs import alive, cmdline, free_port, group_members, log_lines

MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL_NAME = "fastdecode"


# ---- where the server lives

def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)")
    return Path(list(spec.submodule_search_locations)[0])


def tritonserver_binary() -> Path:
    return pytriton_dir() / "tritonserver" / "bin" / "tritonserver"


def backends_dir() -> Path:
    return pytriton_dir() / "tritonserver" / "backends"


def ensure_stub() -> Path:
    """Copy the Python-backend stub of this interpreter's version beside the backend (idempotent)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = backends_dir() / "python" / "triton_python_backend_stub"
    if not stub.exists():
        source = pytriton_dir() / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not source.exists():
            raise FileNotFoundError(f"no Triton Python-backend stub for Python {version} at {source}")
        shutil.copy2(source, stub)
        stub.chmod(0o755)
    return stub


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = process_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libs = pytriton_dir().parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (python_libdir(), env.get("LD_LIBRARY_PATH", ""), str(libs)) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def python_libdir() -> str:
    """The directory of this interpreter's libpython, when it has one. The stub links
    libpython3.11.so.1.0 and would otherwise get the system's, which can be older than the
    stdlib it then imports (pyenv 3.11.7 stdlib on Debian's 3.11.2: `undefined symbol` in _ssl)."""
    import sysconfig

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return ""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return libdir if (Path(libdir) / str(sysconfig.get_config_var("INSTSONAME"))).exists() else ""


# ---- the model repository a server runs

def pbtxt_parameters(params: Mapping[str, str]) -> str:
    return "\n".join(f'parameters {{ key: {_quote(k)} value {{ string_value: {_quote(v)} }} }}'
                     for k, v in params.items())


def _quote(value) -> str:
    """A protobuf text-format string literal (JSON's escapes minus \\u: non-ASCII stays UTF-8)."""
    return json.dumps(str(value), ensure_ascii=False)


def write_model_repository(dest: str | os.PathLike, parameters: Mapping[str, str] | None = None,
                           source: str | os.PathLike = MODEL_REPOSITORY) -> Path:
    """Copy of the repository's config.pbtxt files with `parameters` replacing those of the same key
    in every Python-backend model; the model code (version directories) is symlinked, so relative
    paths in the parameters still resolve against this checkout."""
    dest, source = Path(dest), Path(source)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for model in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        out = dest / model.name
        out.mkdir()
        text = (model / "config.pbtxt").read_text()
        if parameters and 'backend: "python"' in text:
            text = _set_parameters(text, parameters)
        (out / "config.pbtxt").write_text(text)
        for item in model.iterdir():
            if item.name != "config.pbtxt":
                (out / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    return dest


def _set_parameters(text: str, parameters: Mapping[str, str]) -> str:
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("parameters") and any(f'key: "{k}"' in stripped for k in parameters):
            continue
        keep.append(line)
    return "\n".join(keep).rstrip() + "\n\n# set by fastdecode.ops.serve\n" + pbtxt_parameters(parameters) + "\n"


# ---- one tritonserver process

class TritonServer:
    """A background tritonserver on 127.0.0.1 (log + pid in run_dir). Use as a context manager."""

    def __init__(self, model_repository: str | os.PathLike, run_dir: str | os.PathLike, *,
                 host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 env: Mapping[str, str] | None = None, log_verbose: int = 0, exit_timeout_s: int = 30):
        self.model_repository = Path(model_repository)
        self.run_dir = Path(run_dir)
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.extra_env = dict(env or {})
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.proc: subprocess.Popen | None = None
        self.clean_exit: bool | None = None   # after stop(): exited 0 on SIGTERM, nothing left to kill

    @property
    def log_path(self) -> Path:
        return self.run_dir / "tritonserver.log"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / "tritonserver.pid"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def argv(self) -> list[str]:
        return [str(tritonserver_binary()), f"--model-repository={self.model_repository}",
                f"--backend-directory={backends_dir()}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--model-control-mode=explicit", "--load-model=*",
                "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout_s}",
                f"--log-verbose={self.log_verbose}"]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        if not tritonserver_binary().exists():
            raise FileNotFoundError(f"tritonserver binary not found at {tritonserver_binary()}")
        ensure_stub()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=server_env(self.extra_env), cwd=REPO_ROOT, start_new_session=True)
        self.pid_path.write_text(f"{self.proc.pid}\n")
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if http_ok(f"http://{self.http_url}/v2/health/ready"):
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; log {self.log_path}:\n"
                           f"{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is not None:
            self.clean_exit = stop_process(self.proc.pid, self.exit_timeout_s + 10, proc=self.proc)
            self.proc = None
        self.pid_path.unlink(missing_ok=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path, lines: int = 25) -> str:
    """The server's error lines (Triton prefixes them with E) and then the last lines of its log."""
    all_lines = log_lines(path)
    if all_lines is None:
        return "(no log)"
    errors = [line[:2000] for line in all_lines if line.startswith("E") or line.startswith("error:")][-8:]
    tail = [line for line in all_lines[-lines:] if line not in errors and not line.startswith(("|", "+-"))]
    return "\n".join(errors + ["..."] + tail) if all_lines else "(log empty)"


def stop_process(pid: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Stop the tritonserver we started (it leads its own process group): SIGTERM, SIGKILL after
    `timeout` s. Then end what is left of its group and unlink the stubs' shared-memory regions.

    A safety net: Python-backend stubs outlive a server that gave up waiting for a model to
    unload. Triton 2.51 can keep a model UNLOADING forever when a gRPC client cancels its stream
    just as the final response of a request is written (see fastdecode.ops.client.generate); then
    the server waits its whole --exit-timeout-secs and exits non-zero with the stub still alive.
    Returns True when none of that was needed: the server exited 0 on SIGTERM, nothing left."""
    clean = True
    def gone() -> bool:
        return proc.poll() is not None if proc is not None else not alive(pid)

    shm = [arg for member in group_members(pid) for arg in cmdline(member)
           if arg.startswith("triton_python_backend_shm_region")]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        clean = clean and sig == signal.SIGTERM
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + timeout
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.1)
        if gone():
            break
    if proc is not None and proc.returncode != 0:
        clean = False
    deadline = time.monotonic() + 5.0
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pid):
        clean = False
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for name in shm:
        Path("/dev/shm", name).unlink(missing_ok=True)
    return clean
