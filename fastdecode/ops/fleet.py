"""Local R-worker fleets: N `python -m rworker` processes on this machine, each in its own session,
with its log and pid file under the run directory (`make rworkers` runs fastdecode.ops.rworkers).

Python API (tests, benches, serve):
    from fastdecode.ops.fleet import LocalFleet
    with LocalFleet(2, run_dir, kv_capacity="64M", threads=1) as fleet:
        config = EngineConfig(attention="remote", rworkers=fleet.addresses)
        fleet.kill(0)                    # SIGKILL worker 0; fleet.kill(1, signal.SIGSTOP) stalls one
        fleet.restart(0)                 # worker 0 again, same address
    # leaving the block stops all: SIGTERM (drain), SIGKILL after stop_timeout seconds.

    LocalFleet(n, run_dir, *, base_port=0, kv_capacity="1G", threads=0, host="127.0.0.1",
               rworker_args=(), hosts=None, prefixes=None, start_timeout=60.0, stop_timeout=10.0)
    .start() -> self    .stop()    .kill(i, sig=SIGKILL)    .restart(i)    .alive(i) -> bool
    .addresses: tuple[str, ...]    .pids: list[int]    .log_path(i) -> Path
base_port=0: each worker binds a free port and reports it (50061 + i for workers with a
prefix); restart(i) reuses it. threads=0 gives each worker cpu_count // n threads.
`hosts` (one listen address per worker) and `prefixes` (a command prefix per worker, e.g.
["ip", "netns", "exec", "ns0"]) run workers elsewhere than on 127.0.0.1 (tests/test_netns.py).
Failures raise FleetError with the worker's log tail; nothing is left running.

Run directory: fleet.json (state), worker-<i>.pid, worker-<i>.log, addresses.txt.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import psutil

from fastdecode.config import REPO_ROOT, parse_size
from fastdecode.ops.procs import address_of, alive, log_tail, port_free, stable_ports, status

MAX_WORKERS = 256
DEFAULT_PORT = 50061
READY = re.compile(rb"\bREADY (\S+)")


class FleetError(RuntimeError):
    pass


def health(address: str, timeout: float = 1.0) -> str:
    """grpc.health.v1 status of one R-worker: SERVING, NOT_SERVING, ..., or UNREACHABLE.

    A worker that wants a token for health checks too answers UNAUTHENTICATED: alive.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code()
            return "UNAUTHENTICATED" if code == grpc.StatusCode.UNAUTHENTICATED else "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class LocalFleet:
    """N R-worker processes on this machine. See the module docstring."""

    def __init__(self, n: int, run_dir: str | os.PathLike, *, base_port: int = 0, kv_capacity: str | int = "1G",
                 threads: int = 0, host: str = "127.0.0.1", rworker_args: Sequence[str] = (),
                 hosts: Sequence[str] | None = None, prefixes: Sequence[Sequence[str]] | None = None,
                 start_timeout: float = 60.0, stop_timeout: float = 10.0):
        if not isinstance(n, int) or not 1 <= n <= MAX_WORKERS:
            raise FleetError(f"number of R-workers must be 1..{MAX_WORKERS}, got {n!r}")
        if not isinstance(base_port, int) or not (base_port == 0 or 1 <= base_port <= 65536 - n):
            raise FleetError(f"base port must be 0 (free ports) or 1..{65536 - n} for {n} workers, got {base_port!r}")
        try:
            capacity = kv_capacity if isinstance(kv_capacity, int) else parse_size(str(kv_capacity))
        except ValueError as e:
            raise FleetError(f"bad --kv-capacity: {e}") from None
        if capacity <= 0:
            raise FleetError(f"KV capacity must be > 0, got {kv_capacity!r}")
        if not isinstance(threads, int) or threads < 0:
            raise FleetError(f"threads must be >= 0 (0 = cores / workers), got {threads!r}")
        if hosts is not None and len(hosts) != n or prefixes is not None and len(prefixes) != n:
            raise FleetError(f"hosts and prefixes need one entry per worker ({n})")
        self.n = n
        self.run_dir = Path(run_dir)
        self.base_port = base_port
        self.capacity = capacity
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.hosts = list(hosts) if hosts is not None else [host] * n
        self.prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(n)]
        self.rworker_args = list(rworker_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.workers: list[dict] = []        # the state saved in fleet.json
        self._procs: dict[int, subprocess.Popen] = {}

    # ---- public API
    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(w["address"] for w in self.workers)

    @property
    def pids(self) -> list[int]:
        return [w["pid"] for w in self.workers]

    def log_path(self, i: int) -> Path:
        return self.run_dir / f"worker-{i}.log"

    def alive(self, i: int) -> bool:
        w = self.workers[i]
        if not w["pid"]:
            return False
        proc = self._procs.get(i)
        if proc is not None and proc.poll() is not None:
            return False
        return alive(w["pid"], w["create_time"])

    def start(self) -> "LocalFleet":
        """Start all workers and wait until each serves; on any failure stop them all and raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = self.load(self.run_dir)
        if existing is not None and any(existing.alive(i) for i in range(existing.n)):
            raise FleetError(f"an R-worker fleet is already running in {self.run_dir} "
                             f"({', '.join(existing.addresses)}); stop it first")
        self.workers = []
        try:
            for i in range(self.n):
                if self.base_port:
                    port = self.base_port + i
                elif self.prefixes[i]:       # another host or namespace: its ports cannot be probed from here
                    port = DEFAULT_PORT + i
                else:                        # a port restart(i) can get back (see stable_ports)
                    port = stable_ports(1, self.hosts[i])[0]
                self.workers.append({"index": i, "host": self.hosts[i], "port": port,
                                     "address": address_of(self.hosts[i], port), "pid": 0, "create_time": 0.0})
                self._launch(i)
            for i in range(self.n):
                self._wait_ready(i)
        except BaseException:
            self.stop()
            raise
        self._save()
        return self

    def stop(self) -> None:
        """SIGTERM every worker (drain), SIGKILL those still there after stop_timeout; remove pid files."""
        live = [i for i in range(len(self.workers)) if self.alive(i)]
        self._terminate(live)
        deadline = time.monotonic() + self.stop_timeout
        while live and time.monotonic() < deadline:
            live = [i for i in live if self.alive(i)]
            time.sleep(0.05)
        for i in live:
            self._signal(i, signal.SIGKILL)
        for i in live:
            self._reap(i, timeout=5.0)
        for i in range(len(self.workers)):
            self._reap(i, timeout=0)
            (self.run_dir / f"worker-{i}.pid").unlink(missing_ok=True)
        (self.run_dir / "fleet.json").unlink(missing_ok=True)
        (self.run_dir / "addresses.txt").unlink(missing_ok=True)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to worker i; SIGKILL returns once it is gone, SIGSTOP once it is stopped."""
        self._signal(i, sig)
        if sig == signal.SIGKILL:
            self._reap(i, timeout=10.0)
        deadline = time.monotonic() + 2.0
        while sig == signal.SIGSTOP and status(self.workers[i]["pid"]) != psutil.STATUS_STOPPED \
                and time.monotonic() < deadline:
            time.sleep(0.01)

    def restart(self, i: int) -> None:
        """Start worker i again on its address (after kill); a live one is stopped first."""
        if self.alive(i):
            self._terminate([i])
            if not self._reap(i, timeout=self.stop_timeout):
                self.kill(i)
        self._reap(i, timeout=0)
        self._launch(i)
        try:
            self._wait_ready(i)
        except BaseException:
            if self.alive(i):
                self.kill(i)
            raise
        self._save()

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "LocalFleet | None":
        """The fleet recorded in run_dir/fleet.json (started by this or another process), or None."""
        path = Path(run_dir) / "fleet.json"
        try:
            state = json.loads(path.read_text())
            fleet = cls(state["n"], run_dir, kv_capacity=state["kv_capacity"], threads=state["threads"],
                        hosts=[w["host"] for w in state["workers"]], prefixes=state["prefixes"],
                        rworker_args=state["rworker_args"])
            fleet.workers = state["workers"]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, FleetError) as e:
            raise FleetError(f"{path} is damaged ({e}); remove it after checking no R-worker runs") from None
        return fleet

    # ---- internals
    def _argv(self, i: int) -> list[str]:
        w = self.workers[i]
        return [*self.prefixes[i], sys.executable, "-m", "rworker", "--listen", w["address"],
                "--kv-capacity", str(self.capacity), "--threads", str(self.threads), *self.rworker_args]

    def _launch(self, i: int) -> None:
        w = self.workers[i]
        if w["port"] and not self.prefixes[i] and not port_free(w["host"], w["port"]):
            raise FleetError(f"R-worker {i}: port {w['address']} is already in use")
        log = self.log_path(i)
        with open(log, "ab") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self._argv(i))}\n".encode())
            w["log_offset"] = f.tell()
            proc = subprocess.Popen(self._argv(i), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    cwd=REPO_ROOT, start_new_session=True)
        self._procs[i] = proc
        w["pid"] = proc.pid
        try:
            w["create_time"] = psutil.Process(proc.pid).create_time()
        except psutil.Error:          # already gone: _wait_ready reports it with the log
            w["create_time"] = 0.0
        (self.run_dir / f"worker-{i}.pid").write_text(f"{proc.pid}\n")

    def _wait_ready(self, i: int) -> None:
        w, log = self.workers[i], self.log_path(i)
        deadline = time.monotonic() + self.start_timeout
        ready = None
        while True:
            proc = self._procs[i]
            if proc.poll() is not None:
                raise FleetError(f"R-worker {i} ({w['address']}) exited with status {proc.returncode} "
                                 f"before serving; log {log}:\n{log_tail(log, w['log_offset'])}")
            if ready is None:
                with open(log, "rb") as f:
                    f.seek(w["log_offset"])
                    ready = READY.search(f.read())
                if ready is not None and w["port"] == 0:
                    w["port"] = int(ready.group(1).rsplit(b":", 1)[1])
                    w["address"] = address_of(w["host"], w["port"])
            if ready and (self._tls or health(w["address"], timeout=1.0) in ("SERVING", "UNAUTHENTICATED")):
                return
            if time.monotonic() > deadline:
                raise FleetError(f"R-worker {i} ({w['address']}) not serving after {self.start_timeout:.0f} s; "
                                 f"log {log}:\n{log_tail(log, w['log_offset'])}")
            time.sleep(0.05)

    @property
    def _tls(self) -> bool:
        # Health is probed in plaintext; a TLS worker is taken as ready on its READY line.
        return "--tls-cert" in self.rworker_args

    def _terminate(self, workers: list[int]) -> None:
        # Wake stopped (SIGSTOP) workers and let them run before SIGTERM: a signal sent
        # to a process right after SIGCONT may land on a thread other than the main
        # one, and Python runs handlers on the main thread only.
        stopped = [i for i in workers if status(self.workers[i]["pid"]) == psutil.STATUS_STOPPED]
        for i in stopped:
            self._signal(i, signal.SIGCONT)
        if stopped:
            time.sleep(0.1)
        for i in workers:
            self._signal(i, signal.SIGTERM)

    def _signal(self, i: int, sig: int) -> None:
        if self.alive(i):
            try:
                os.kill(self.workers[i]["pid"], sig)
            except ProcessLookupError:
                pass

    def _reap(self, i: int, timeout: float) -> bool:
        """Wait up to `timeout` for worker i to be gone; True if it is."""
        proc = self._procs.get(i)
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while self.alive(i):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _save(self) -> None:
        state = {"n": self.n, "kv_capacity": self.capacity, "threads": self.threads, "prefixes": self.prefixes,
                 "rworker_args": self.rworker_args, "workers": self.workers}
        tmp = self.run_dir / "fleet.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.run_dir / "fleet.json")
        (self.run_dir / "addresses.txt").write_text(",".join(self.addresses) + "\n")
