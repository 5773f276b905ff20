"""The local R-worker fleet (fastdecode.ops.fleet): API and CLI, with real `python -m rworker` processes."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fastdecode.ops.fleet import FleetError, LocalFleet, health
from fastdecode.ops.procs import free_port, port_free

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(kv_capacity="16M", threads=1)


def fleet_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastdecode.ops.rworkers", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout)


def listeners(address: str) -> list[int]:
    """Pids of processes listening on `address` (a leak check that does not trust pid files)."""
    host, port = address.rsplit(":", 1)
    return [c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)
            and c.laddr.ip.removeprefix("::ffff:") in (host, "0.0.0.0", "::")]     # gRPC listens on v4-mapped v6


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_api_start_kill_restart_stop(tmp_path):
    run = tmp_path / "fleet"
    with LocalFleet(2, run, **SMALL) as fleet:
        addresses, pids = fleet.addresses, fleet.pids
        assert len(set(addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
        assert [health(a) for a in addresses] == ["SERVING", "SERVING"]
        assert [listeners(a) for a in addresses] == [[p] for p in pids]
        assert (run / "addresses.txt").read_text().strip() == ",".join(addresses)
        assert [int((run / f"worker-{i}.pid").read_text()) for i in range(2)] == pids
        assert json.loads((run / "fleet.json").read_text())["n"] == 2
        assert "READY" in fleet.log_path(0).read_text()

        fleet.kill(0)
        assert not fleet.alive(0) and gone(pids[0])
        assert health(addresses[0]) == "UNREACHABLE" and health(addresses[1]) == "SERVING"
        fleet.restart(0)
        assert fleet.addresses == addresses and fleet.pids[0] != pids[0]
        assert health(addresses[0]) == "SERVING"

        fleet.kill(1, signal.SIGSTOP)            # a stalled worker: alive, but answers nothing
        assert fleet.alive(1) and health(addresses[1], timeout=0.5) == "UNREACHABLE"
        final_pids = fleet.pids
        started = time.monotonic()
    assert time.monotonic() - started < 8, "stop() must not wait out the drain of a stalled worker"
    assert all(gone(p) for p in final_pids)
    assert not any(listeners(a) for a in addresses)
    assert sorted(p.name for p in run.iterdir()) == ["worker-0.log", "worker-1.log"]


def test_cli_start_status_idempotent_stop(tmp_path):
    run = str(tmp_path / "fleet")
    r = fleet_cli("start", "--n", "2", "--run-dir", run, "--kv-capacity", "16M", "--threads", "1")
    assert r.returncode == 0, r.stderr
    addresses = r.stdout.strip().split(",")
    try:
        assert len(addresses) == 2 and (Path(run) / "addresses.txt").read_text().strip() == r.stdout.strip()
        pids = [int((Path(run) / f"worker-{i}.pid").read_text()) for i in range(2)]
        assert [health(a) for a in addresses] == ["SERVING", "SERVING"]

        s = fleet_cli("status", "--run-dir", run)
        assert s.returncode == 0 and s.stdout.count("SERVING") == 2, s.stdout

        again = fleet_cli("start", "--n", "2", "--run-dir", run)
        assert again.returncode == 0 and "already running" in again.stderr
        assert again.stdout.strip() == r.stdout.strip()
        assert [int((Path(run) / f"worker-{i}.pid").read_text()) for i in range(2)] == pids
        assert all(len(listeners(a)) == 1 for a in addresses), "a second start must not double-start"

        other_n = fleet_cli("start", "--n", "3", "--run-dir", run)
        assert other_n.returncode == 1 and "stop them" in other_n.stderr

        psutil.Process(pids[1]).kill()          # a dead worker: status says so, start repairs it
        assert wait_until(lambda: gone(pids[1]))
        s = fleet_cli("status", "--run-dir", run)
        assert s.returncode == 1 and "NOT_RUNNING" in s.stdout
        repair = fleet_cli("start", "--n", "2", "--run-dir", run)
        assert repair.returncode == 0 and "restarting" in repair.stderr, repair.stderr
        assert repair.stdout.strip() == r.stdout.strip()
        new_pid = int((Path(run) / "worker-1.pid").read_text())
        assert new_pid != pids[1] and health(addresses[1]) == "SERVING"
        assert int((Path(run) / "worker-0.pid").read_text()) == pids[0]
        pids[1] = new_pid
    finally:
        stop = fleet_cli("stop", "--run-dir", run)
    assert stop.returncode == 0 and "stopped 2" in stop.stderr, stop.stderr
    assert wait_until(lambda: all(gone(p) for p in pids))
    assert not any(listeners(a) for a in addresses)
    assert not list(Path(run).glob("*.pid")) and not (Path(run) / "addresses.txt").exists()
    assert fleet_cli("status", "--run-dir", run).returncode == 3
    again = fleet_cli("stop", "--run-dir", run)
    assert again.returncode == 0 and "no R-worker fleet" in again.stderr


def test_port_taken_is_a_clean_error_and_leaks_nothing(tmp_path):
    # Worker 0's port is free, worker 1's is taken: worker 0 starts and must be stopped again.
    for _ in range(50):
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        taken = blocker.getsockname()[1]
        if taken > 1024 and _free(taken - 1):
            break
        blocker.close()
    blocker.listen()
    base = taken - 1
    try:
        with pytest.raises(FleetError, match=f"127.0.0.1:{taken} is already in use"):
            LocalFleet(2, tmp_path / "a", base_port=base, **SMALL).start()
        assert not listeners(f"127.0.0.1:{base}")
        assert not list((tmp_path / "a").glob("*.pid")) and not (tmp_path / "a" / "fleet.json").exists()

        r = fleet_cli("start", "--n", "1", "--run-dir", str(tmp_path / "b"), "--base-port", str(taken))
        assert r.returncode == 1 and "already in use" in r.stderr and "Traceback" not in r.stderr
        assert r.stdout == ""
    finally:
        blocker.close()


def test_worker_that_exits_or_hangs_gives_log_and_no_orphans(tmp_path):
    # The real R-worker refuses --block-size 0 and exits: its log tail is in the error.
    port = free_port("127.0.0.1")
    with pytest.raises(FleetError, match=r"exited with status [^0].*\n(.|\n)*block-size"):
        LocalFleet(1, tmp_path / "a", base_port=port, rworker_args=["--block-size", "0"], **SMALL).start()
    assert not listeners(f"127.0.0.1:{port}")

    # A worker that never says READY is given up after start_timeout and killed.
    hang = ["sh", "-c", "sleep 60", "hang"]      # the rworker command line becomes $1.. and is ignored
    fleet = LocalFleet(1, tmp_path / "b", prefixes=[hang], start_timeout=1.0, stop_timeout=1.0, **SMALL)
    t0 = time.monotonic()
    with pytest.raises(FleetError, match="not serving after 1 s"):
        fleet.start()
    assert time.monotonic() - t0 < 6
    assert gone(fleet.pids[0]) and not list((tmp_path / "b").glob("*.pid"))


def test_a_running_fleet_is_not_started_twice_through_the_api(tmp_path):
    with LocalFleet(1, tmp_path, **SMALL) as fleet:
        with pytest.raises(FleetError, match="already running"):
            LocalFleet(1, tmp_path, **SMALL).start()
        assert health(fleet.addresses[0]) == "SERVING"


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "number of R-workers"),
    (dict(n=-1), "number of R-workers"),
    (dict(n="2"), "number of R-workers"),
    (dict(n=100000), "number of R-workers"),
    (dict(n=2, base_port=70000), "base port"),
    (dict(n=2, base_port=65535), "base port"),
    (dict(n=1, base_port=-1), "base port"),
    (dict(n=1, kv_capacity="lots"), "kv-capacity"),
    (dict(n=1, kv_capacity="-5M"), "capacity"),
    (dict(n=1, kv_capacity="0"), "capacity"),
    (dict(n=1, threads=-2), "threads"),
    (dict(n=2, hosts=["127.0.0.1"]), "one entry per worker"),
])
def test_api_rejects_garbage(tmp_path, kwargs, message):
    with pytest.raises(FleetError, match=message):
        LocalFleet(run_dir=tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, rc, message", [
    (["start", "--n", "0"], 1, "number of R-workers"),
    (["start", "--n", "two"], 2, "invalid int value"),
    (["start", "--base-port", "http"], 2, "not a TCP port"),
    (["start", "--base-port", "99999"], 2, "not a TCP port"),
    (["start", "--kv-capacity", "12Q"], 1, "kv-capacity"),
    (["start", "--threads", "-1"], 1, "threads"),
    (["start", "--inventory", "/nonexistent/hosts.ini", "--wheelhouse", "/tmp"], 1, "not found"),
    (["start", "--inventory", __file__, "--wheelhouse", "/nonexistent"], 1, "holds no fastdecode wheel"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_cli_rejects_garbage(tmp_path, args, rc, message):
    r = fleet_cli(*args, "--run-dir", str(tmp_path / "run"), timeout=30)
    assert r.returncode == rc and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run" / "fleet.json").exists()


def test_cli_reports_a_damaged_state_file(tmp_path):
    (tmp_path / "fleet.json").write_text("{not json")
    r = fleet_cli("status", "--run-dir", str(tmp_path))
    assert r.returncode == 1 and "damaged" in r.stderr and "Traceback" not in r.stderr


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_port_free_sees_a_listener_but_not_time_wait():
    """A restart on a killed worker's port must not be refused for its connections in TIME_WAIT
    (a chaos run failed so); a port something listens on is still in use."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_free("127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()                  # the server side closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    assert port_free("127.0.0.1", port)
