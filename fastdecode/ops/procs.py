"""Ports, processes and logs: the helpers every deployment command shares."""
from __future__ import annotations

import os
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
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
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
