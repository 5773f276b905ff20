"""Inventory mode: Ansible rolls the R-worker out as a systemd service on each host of the inventory's
`rworkers` group (deploy/ansible/rworkers.yml), from a wheelhouse built here (no PyPI on the hosts)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fastdecode.config import REPO_ROOT, process_env
from fastdecode.ops.fleet import DEFAULT_PORT, FleetError
from fastdecode.ops.procs import address_of

PLAYBOOK = REPO_ROOT / "deploy" / "ansible" / "rworkers.yml"


def inventory_addresses(inventory: str, port: int = 0) -> list[str]:
    """host:port of every host in the inventory's `rworkers` group, as the playbook configures them
    (rworker_host, else ansible_host, else the name; rworker_port unless `port` overrides it)."""
    out = _run_ansible(["ansible-inventory", "-i", inventory, "--list"], capture=True)
    data = json.loads(out)
    hostvars = data.get("_meta", {}).get("hostvars", {})

    def hosts_of(group: str) -> list[str]:
        g = data.get(group, {})
        return g.get("hosts", []) + [h for child in g.get("children", []) for h in hosts_of(child)]

    hosts = list(dict.fromkeys(hosts_of("rworkers")))
    if not hosts:
        raise FleetError(f"inventory {inventory} has no hosts in group [rworkers]")
    addresses = []
    for h in hosts:
        v = hostvars.get(h, {})
        host = v.get("rworker_host", v.get("ansible_host", h))
        addresses.append(address_of(host, port or int(v.get("rworker_port", DEFAULT_PORT))))
    return addresses


def build_wheelhouse(out_dir: Path) -> Path:
    """This project's wheel plus the R-worker's runtime dependencies, for hosts without PyPI."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q"]
    req = REPO_ROOT / "deploy" / "ansible" / "roles" / "rworker" / "files" / "requirements.txt"
    for cmd in ([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out_dir), str(REPO_ROOT)],
                [*pip, "download", "-d", str(out_dir), "-r", str(req)]):
        print("+", " ".join(cmd), file=sys.stderr)
        if subprocess.call(cmd) != 0:
            raise FleetError(f"building the wheelhouse failed: {' '.join(cmd)}")
    return out_dir


def _run_ansible(cmd: list[str], capture: bool = False) -> str:
    exe = Path(sys.executable).parent / cmd[0]
    cmd = [str(exe) if exe.exists() else cmd[0], *cmd[1:]]
    env = process_env(ANSIBLE_NOCOLOR="1", ANSIBLE_RETRY_FILES_ENABLED="0")
    try:
        # The playbook's report goes to stderr: stdout carries only the addresses.
        proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE if capture else sys.stderr)
    except FileNotFoundError:
        raise FleetError(f"{cmd[0]} not found: install Ansible (pip install ansible-core)") from None
    if proc.returncode != 0:
        raise FleetError(f"{' '.join(cmd[:2])} ... failed with status {proc.returncode}")
    return proc.stdout or ""


def ansible_rollout(inventory: str, run_dir: Path, state: str, extra_vars: dict, check: bool = False) -> list[str]:
    if not Path(inventory).is_file():
        raise FleetError(f"inventory {inventory} not found")
    addresses = inventory_addresses(inventory, int(extra_vars.get("rworker_port", 0)))
    cmd = ["ansible-playbook", "-i", inventory, str(PLAYBOOK),
           "-e", json.dumps({"rworker_state": state, **extra_vars})]
    _run_ansible(cmd + (["--check", "--diff"] if check else []))
    if state == "started" and not check:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "addresses.txt").write_text(",".join(addresses) + "\n")
    return addresses
