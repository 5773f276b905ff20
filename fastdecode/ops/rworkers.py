"""Start, stop and inspect a fleet of R-workers (`make rworkers`, `make rworkers-stop`).

Local mode (default): N `python -m rworker` processes on this machine, each in its own
session, with its log and pid file under the run directory. Inventory mode
(`--inventory hosts.ini`): Ansible rolls the R-worker out as a systemd service on each
host of the inventory's `rworkers` group (deploy/ansible/rworkers.yml).

CLI:
    python -m fastdecode.ops.rworkers start  --n N --run-dir DIR [--base-port P] [--kv-capacity SIZE]
                                   [--threads T] [--host H] [--timeout S] [-- RWORKER_ARGS...]
    python -m fastdecode.ops.rworkers start  --inventory FILE --run-dir DIR [--wheelhouse DIR] [--check] [...]
    python -m fastdecode.ops.rworkers stop   --run-dir DIR [--inventory FILE [--check]] [--timeout S]
    python -m fastdecode.ops.rworkers status --run-dir DIR
`start` prints the comma-separated addresses on stdout (and writes DIR/addresses.txt),
usable as EngineConfig.rworkers / FASTDECODE_RWORKERS. Starting a running fleet again
reports it and restarts only workers that died. Arguments after `--` go to every
`python -m rworker` (e.g. `-- --token-file /etc/rworker.token`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from fastdecode.config import parse_size
from fastdecode.ops.fleet import FleetError, LocalFleet, health
from fastdecode.ops.rollout import ansible_rollout, build_wheelhouse


def _cmd_start(args, rworker_args: list[str]) -> int:
    run_dir = Path(args.run_dir)
    if args.inventory:
        # Settings given here override the inventory's for every host; the rest come from it.
        extra = {"rworker_args": rworker_args} if rworker_args else {}
        if args.kv_capacity is not None:
            try:
                extra["rworker_kv_capacity"] = parse_size(args.kv_capacity)
            except ValueError as e:
                raise FleetError(f"bad --kv-capacity: {e}") from None
        if args.threads is not None:
            if args.threads < 0:
                raise FleetError(f"threads must be >= 0 (0 = all cores), got {args.threads}")
            extra["rworker_threads"] = args.threads
        if args.base_port:
            extra["rworker_port"] = args.base_port
        if not Path(args.inventory).is_file():
            raise FleetError(f"inventory {args.inventory} not found")
        wheelhouse = Path(args.wheelhouse) if args.wheelhouse else build_wheelhouse(run_dir / "wheelhouse")
        if not any(wheelhouse.glob("fastdecode-*.whl")):
            raise FleetError(f"wheelhouse {wheelhouse} holds no fastdecode wheel")
        extra["rworker_wheelhouse"] = str(wheelhouse.resolve())
        addresses = ansible_rollout(args.inventory, run_dir, "started", extra, check=args.check)
        print(",".join(addresses))
        return 0
    fleet = LocalFleet(args.n, run_dir, base_port=args.base_port, kv_capacity=args.kv_capacity or "1G",
                       threads=args.threads or 0, host=args.host, rworker_args=rworker_args,
                       start_timeout=args.timeout)
    existing = LocalFleet.load(run_dir)
    if existing is not None:
        alive = [existing.alive(i) for i in range(existing.n)]
        if all(alive):
            if existing.n != args.n:
                raise FleetError(f"{existing.n} R-workers already run in {run_dir}; stop them to start {args.n}")
            print(f"R-workers already running: {','.join(existing.addresses)}", file=sys.stderr)
            print(",".join(existing.addresses))
            return 0
        if any(alive):
            if existing.n != args.n:
                raise FleetError(f"{existing.n} R-workers are recorded in {run_dir}, some running; "
                                 f"stop them to start {args.n}")
            for i in (i for i, a in enumerate(alive) if not a):
                print(f"R-worker {i} ({existing.addresses[i]}) is not running: restarting it", file=sys.stderr)
                existing.restart(i)
            print(",".join(existing.addresses))
            return 0
        existing.stop()                   # stale state of a dead fleet
    fleet.start()
    for i, w in enumerate(fleet.workers):
        print(f"R-worker {i}: {w['address']} pid {w['pid']} log {fleet.log_path(i)}", file=sys.stderr)
    print(",".join(fleet.addresses))
    return 0


def _cmd_stop(args) -> int:
    run_dir = Path(args.run_dir)
    if args.inventory:
        ansible_rollout(args.inventory, run_dir, "stopped", {}, check=args.check)
        (run_dir / "addresses.txt").unlink(missing_ok=True)
        print("R-workers stopped on the inventory's hosts", file=sys.stderr)
        return 0
    fleet = LocalFleet.load(run_dir)
    if fleet is None:
        print(f"no R-worker fleet recorded in {run_dir}", file=sys.stderr)
        return 0
    fleet.stop_timeout = args.timeout
    fleet.stop()
    print(f"stopped {fleet.n} R-worker(s) in {run_dir}", file=sys.stderr)
    return 0


def _cmd_status(args) -> int:
    fleet = LocalFleet.load(args.run_dir)
    if fleet is None:
        print(f"no R-worker fleet recorded in {args.run_dir}")
        return 3
    ok = True
    for i, w in enumerate(fleet.workers):
        running = fleet.alive(i)
        state = health(w["address"]) if running else "NOT_RUNNING"
        ok = ok and state in ("SERVING", "UNAUTHENTICATED")
        print(f"worker {i}  {w['address']:<21}  pid {w['pid']:<8}  {state}")
    return 0 if ok else 1


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rworker_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m fastdecode.ops.rworkers", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    helps = {"start": "start the R-workers (local, or --inventory hosts); prints their addresses",
             "stop": "stop them (SIGTERM drains, SIGKILL after --timeout)", "status": "health of each worker"}
    for name in ("start", "stop", "status"):
        s = sub.add_parser(name, help=helps[name], epilog="Arguments after `--` go to every `python -m rworker`."
                           if name == "start" else None)
        s.add_argument("--run-dir", required=True, help="pid files, logs, addresses.txt")
        if name == "status":
            continue
        s.add_argument("--inventory", help="Ansible inventory: roll out to its [rworkers] hosts")
        s.add_argument("--check", action="store_true", help="with --inventory: ansible-playbook --check")
        s.add_argument("--timeout", type=float, default=60.0 if name == "start" else 10.0,
                       help="seconds to wait for a worker to serve (start) or to drain (stop)")
        if name == "start":
            s.add_argument("--n", type=int, default=2, help="local R-workers (default 2); "
                           "with --inventory, the hosts of its [rworkers] group")
            s.add_argument("--base-port", type=_port, default=0, help="first port; 0 = free ports (default)")
            s.add_argument("--kv-capacity", help="KV pool per worker, e.g. 512M, 4G (local default 1G)")
            s.add_argument("--threads", type=int, help="kernel threads per worker; local default cores / n")
            s.add_argument("--host", default="127.0.0.1", help="listen address of local workers")
            s.add_argument("--wheelhouse", help="with --inventory: use these wheels instead of building them")
    args = p.parse_args(argv)
    try:
        if args.command == "start":
            return _cmd_start(args, rworker_args)
        if args.command == "stop":
            return _cmd_stop(args)
        return _cmd_status(args)
    except FleetError as e:
        print(f"fastdecode.ops.rworkers: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
