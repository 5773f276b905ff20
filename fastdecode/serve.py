"""Run fastdecode on Triton: local R-workers + tritonserver + one streamed completion.

    python -m fastdecode.serve start --model DIR --rworkers N --run-dir DIR
                                     [--grpc-port 8001 --http-port 8000 --metrics-port 8002]
                                     [--host 127.0.0.1] [--param KEY=VALUE ...] [--timeout S]
    python -m fastdecode.serve stop --run-dir DIR

`start` runs the R-Part in-process by default (the local attention backend: the same kernel, on
the S-Part's cores); --rworkers N launches N local R-workers (rworker.fleet.LocalFleet) and
--rworkers-at HOST:PORT,... uses R-workers that already run elsewhere. It writes
DIR/model_repository (the repository's config.pbtxt with the model parameters filled in, the
model code linked, not copied), starts tritonserver in the background (log and pid in DIR),
waits for /v2/health/ready, streams one completion and prints how to call the server.

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

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from fastdecode.config import EngineConfig, config_from_settings, process_env

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    return "\n".join(keep).rstrip() + "\n\n# set by fastdecode.serve\n" + pbtxt_parameters(parameters) + "\n"


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
    try:
        all_lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    errors = [line[:2000] for line in all_lines if line.startswith("E") or line.startswith("error:")][-8:]
    tail = [line for line in all_lines[-lines:] if line not in errors and not line.startswith(("|", "+-"))]
    return "\n".join(errors + ["..."] + tail) if all_lines else "(log empty)"


def stop_process(pid: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Stop the tritonserver we started (it leads its own process group): SIGTERM, SIGKILL after
    `timeout` s. Then end what is left of its group and unlink the stubs' shared-memory regions.

    A safety net: Python-backend stubs outlive a server that gave up waiting for a model to
    unload. Triton 2.51 can keep a model UNLOADING forever when a gRPC client cancels its stream
    just as the final response of a request is written (see fastdecode.client.generate); then
    the server waits its whole --exit-timeout-secs and exits non-zero with the stub still alive.
    Returns True when none of that was needed: the server exited 0 on SIGTERM, nothing left."""
    clean = True
    def gone() -> bool:
        if proc is not None:
            return proc.poll() is not None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return _is_zombie(pid)

    shm = [arg for member in _group_members(pid) for arg in _cmdline(member)
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
    while _group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_members(pid):
        clean = False
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for name in shm:
        Path("/dev/shm", name).unlink(missing_ok=True)
    return clean


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (zombies excluded)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


# ---- CLI

def _engine_parameters(args) -> dict[str, str]:
    params = {"model": str(args.model)}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param wants KEY=VALUE, got {item!r}")
        params[key.strip()] = value
    return params


def cmd_start(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "tritonserver.pid").exists():
        pid = int((run_dir / "tritonserver.pid").read_text())
        if _alive(pid):
            print(f"tritonserver already runs (pid {pid}) with run dir {run_dir}; `make stop` first", file=sys.stderr)
            return 1
    params = _engine_parameters(args)
    fleet = None
    if args.rworkers_at:
        params["rworkers"] = args.rworkers_at
    elif args.rworkers > 0:
        from rworker.fleet import LocalFleet

        print(f"starting {args.rworkers} local R-worker(s) ...", file=sys.stderr)
        fleet = LocalFleet(args.rworkers, run_dir / "rworkers", kv_capacity=args.kv_capacity).start()
        params["rworkers"] = ",".join(fleet.addresses)
        print(f"R-workers: {','.join(fleet.addresses)}", file=sys.stderr)
    try:                                    # bad settings fail here, not as a model that will not load
        engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
        config_from_settings({k: v for k, v in params.items() if k in engine_keys}, plan=params.get("plan", ""))
    except ValueError as e:
        print(f"fastdecode.serve: {e}", file=sys.stderr)
        if fleet is not None:
            fleet.stop()
        return 2
    repo = write_model_repository(run_dir / "model_repository", params)
    server = TritonServer(repo, run_dir, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr)
    try:
        server.start(timeout=args.timeout)
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"fastdecode.serve: {e}", file=sys.stderr)
        if fleet is not None:
            fleet.stop()
        return 1
    server.proc = None   # keep it running after we exit; `stop` ends it through the pid file
    (run_dir / "serve.json").write_text(json.dumps({"http": server.http_url, "grpc": server.grpc_url,
                                                    "metrics": server.metrics_url, "parameters": params}, indent=1))
    from fastdecode import client

    prompt = "The sea is"
    print(f"\nready. one streamed completion from model {DEFAULT_MODEL_NAME!r}:", file=sys.stderr)
    print(prompt, end="", flush=True)
    try:
        text = client.stream_completion(prompt, url=server.grpc_url,
                                        sampling={"max_tokens": 32, "temperature": 0.0}, out=sys.stdout)
    except Exception as e:  # noqa: BLE001 -- any failure of the first completion fails the command
        text, reason = "", f"{type(e).__name__}: {e}"
    else:
        reason = "" if text else "the completion streamed no text"
    if reason:
        print(f"\nfastdecode.serve: the server started but its first completion failed ({reason}); it keeps "
              f"running for a look at {server.log_path}; `make stop` ends it", file=sys.stderr)
        return 1
    openai = ""
    if args.openai_port:
        from openai_frontend import process as openai_process

        try:
            url = openai_process.start(run_dir, server.grpc_url, str(Path(args.model).resolve()), server.host,
                                       args.openai_port)
        except RuntimeError as e:
            print(f"\nfastdecode.serve: {e}\ntritonserver keeps running; `make stop` ends it", file=sys.stderr)
            return 1
        openai = f"""
OpenAI API: {url}/v1 (model {Path(args.model).name!r})
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{Path(args.model).name}", "messages": [{{"role": "user", "content": "Hello"}}]}}'"""
    print(f"""

tritonserver runs on {server.host}: HTTP {server.http_port}, gRPC {server.grpc_port}, metrics {server.metrics_port}
  python -m fastdecode.client "Hello" --url {server.grpc_url} --max-tokens 64
  curl -s -X POST http://{server.http_url}/v2/models/{DEFAULT_MODEL_NAME}/generate \\
       -d '{{"text_input": "Hello", "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
  curl -sN -X POST http://{server.http_url}/v2/models/{DEFAULT_MODEL_NAME}/generate_stream \\
       -d '{{"text_input": "Hello", "stream": true, "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
  curl -s {server.metrics_url} | grep fastdecode_{openai}
stop with: make stop   (python -m fastdecode.serve stop --run-dir {run_dir})""")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def cmd_stop(args) -> int:
    run_dir = Path(args.run_dir)
    from openai_frontend import process as openai_process

    if (pid := openai_process.stop(run_dir)) is not None:
        print(f"stopped the OpenAI frontend (pid {pid})", file=sys.stderr)
    pid_file = run_dir / "tritonserver.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        if _alive(pid):
            clean = stop_process(pid, timeout=args.timeout)
            print(f"stopped tritonserver (pid {pid})" + ("" if clean else
                  f"; it did not exit cleanly, leftovers were killed (log {run_dir / 'tritonserver.log'})"),
                  file=sys.stderr)
        pid_file.unlink(missing_ok=True)
    else:
        print(f"no tritonserver recorded in {run_dir}", file=sys.stderr)
    if (run_dir / "rworkers" / "fleet.json").exists():
        from rworker.fleet import LocalFleet

        fleet = LocalFleet.load(run_dir / "rworkers")
        if fleet is not None:
            fleet.stop()
            print(f"stopped {fleet.n} R-worker(s)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start")
    s.add_argument("--model", default="models/smollm2-135m-instruct", help="HF model directory")
    s.add_argument("--rworkers", type=int, default=0, help="local R-workers; 0 = in-process attention (default)")
    s.add_argument("--rworkers-at", default="", help="HOST:PORT,... of R-workers already running elsewhere")
    s.add_argument("--kv-capacity", default="1G", help="KV pool of each local R-worker")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--host", default="127.0.0.1", help="address tritonserver binds to")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API beside Triton; 0 = off")
    s.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a model parameter (EngineConfig field, e.g. scheduler=sls, dtype=bfloat16)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    t = sub.add_parser("stop")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--timeout", type=float, default=40.0)
    args = p.parse_args(argv)
    return cmd_start(args) if args.command == "start" else cmd_stop(args)


if __name__ == "__main__":
    sys.exit(main())
