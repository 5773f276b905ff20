"""Ports, processes and logs: the helpers every deployment command shares."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import psutil


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def address_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port. Connections of a killed listener left in TIME_WAIT do not
    count: the servers we start bind with SO_REUSEADDR too."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def alive(pid: int, create_time: float | None = None) -> bool:
    """The process is there and not a zombie; with `create_time`, it is the one we started
    (not a recycled pid)."""
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) >= 0.5:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (zombies excluded)."""
    members = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                members.append(p.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return members


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def log_lines(path: Path, start: int = 0) -> list[str] | None:
    """The lines of a log from byte `start` on; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None


def log_tail(path: Path, start: int = 0, lines: int = 15) -> str:
    text = log_lines(path, start)
    if text is None:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(log empty)"


def stable_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` consecutive free ports below the kernel's ephemeral range. A server restarted on the
    same address needs its port back; a port from the ephemeral range (what binding port 0 gives)
    can meanwhile become the local port of any outgoing connection, and the restart then fails."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = 10000 if low > 10000 + 2 * count else 1024
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(first, low - count)
        if all(port_free(host, base + i) for i in range(count)):
            return [base + i for i in range(count)]
    raise RuntimeError(f"no {count} consecutive free ports in [{first}, {low})")
