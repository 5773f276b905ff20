"""Rollout files: the Ansible playbook (syntax and a --check dry run on this machine) and
the Kubernetes manifest (parsed and cross-checked; never applied to a cluster here)."""
from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastdecode.config import parse_size
from rworker.__main__ import parse_args as rworker_parse_args
from fastdecode.ops.fleet import FleetError
from fastdecode.ops.rollout import PLAYBOOK, inventory_addresses

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
needs_ansible = pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists() and shutil.which("ansible-playbook") is None,
                                   reason="ansible-core is not installed (pip install ansible-core)")


def ansible_env() -> dict:
    return {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": "/tmp/.ansible-fd-test"}


@needs_ansible
def test_playbook_syntax():
    r = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(DEPLOY / "ansible" / "inventory.example.ini"),
                        str(PLAYBOOK), "--syntax-check"], capture_output=True, text=True, env=ansible_env())
    assert r.returncode == 0, r.stdout + r.stderr


@needs_ansible
def test_inventory_addresses(tmp_path):
    inv = tmp_path / "hosts.ini"
    inv.write_text("[cpu_a]\nnode-1 ansible_host=192.0.2.11\nnode-2 ansible_host=192.0.2.12 rworker_host=198.51.100.2\n"
                   "[cpu_b]\nnode-3 rworker_port=50099\n"
                   "[rworkers:children]\ncpu_a\ncpu_b\n[other]\nweb-1\n")
    assert inventory_addresses(str(inv)) == ["192.0.2.11:50061", "198.51.100.2:50061", "node-3:50099"]
    assert inventory_addresses(str(inv), port=50100)[2] == "node-3:50100"     # --base-port overrides
    inv.write_text("[web]\nweb-1\n")
    with pytest.raises(FleetError, match=r"no hosts in group \[rworkers\]"):
        inventory_addresses(str(inv))


@needs_ansible
def test_rollout_dry_run_on_this_machine(tmp_path):
    """`fleet start --inventory --check` against this machine (local connection): every task
    of the play is evaluated, nothing is installed, no systemd unit or user is created."""
    tag = f"fdtest{os.getpid()}"
    prefix, unit_name = tmp_path / "opt", f"fastdecode-rworker-{tag}"
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[rworkers]\nlocalnode ansible_connection=local ansible_host=127.0.0.1 rworker_port=50991 "
                   f"ansible_python_interpreter={sys.executable}\n[rworkers:vars]\nrworker_token=s3cret\n"
                   f"rworker_prefix={prefix}\nrworker_unit={unit_name}\nrworker_user={tag}\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "fastdecode-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"not installed in --check")
    run = tmp_path / "run"
    base = [sys.executable, "-m", "fastdecode.ops.rworkers"]
    r = subprocess.run([*base, "start", "--inventory", str(inv), "--run-dir", str(run), "--wheelhouse", str(wheels),
                        "--check", "--kv-capacity", "2G", "--threads", "3", "--", "--log-level", "debug"],
                       cwd=REPO, capture_output=True, text=True, env=ansible_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "127.0.0.1:50991"
    assert re.search(r"localnode\s+: ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", r.stderr), r.stderr[-2000:]
    # The unit the play would write (--diff): inventory port and token, CLI capacity, threads and extra args.
    exec_start = re.search(r"^\+ExecStart=(.*)$", r.stderr, re.M).group(1).split()
    assert exec_start[:3] == [f"{prefix}/venv/bin/python", "-m", "rworker"]
    args = rworker_parse_args(exec_start[3:])
    assert (args.listen, args.kv_capacity, args.threads, args.token_file, args.log_level) == \
        ("127.0.0.1:50991", 2 << 30, 3, f"{prefix}/etc/token", "debug")
    assert "s3cret" not in r.stderr                   # the token never shows in the output
    # A dry run changes nothing.
    assert not prefix.exists() and not Path(f"/etc/systemd/system/{unit_name}.service").exists()
    with pytest.raises(KeyError):
        pwd.getpwnam(tag)
    assert not (run / "addresses.txt").exists()


def _local_inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[rworkers]\nlocalnode ansible_connection=local ansible_python_interpreter={sys.executable}\n"
                   f"[rworkers:vars]\nrworker_unit=fastdecode-rworker-fdtest{os.getpid()}\n")
    return inv


def _playbook(inv: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(PLAYBOOK), "--check", *extra],
                          capture_output=True, text=True, env=ansible_env(), timeout=120)


@needs_ansible
@pytest.mark.parametrize("extra", ["rworker_state=started",                      # no wheelhouse
                                   "rworker_wheelhouse=/w rworker_port=70000"])
def test_playbook_refuses_bad_settings(tmp_path, extra):
    r = _playbook(_local_inventory(tmp_path), "-e", extra)
    assert r.returncode != 0 and "rworker_state must be started|stopped" in r.stdout, r.stdout[-2000:]


@needs_ansible
@pytest.mark.slow
@pytest.mark.parametrize("extra", ["rworker_state=sideways", "rworker_wheelhouse=/w rworker_tls_cert=/c.pem"])
def test_playbook_refuses_more_bad_settings(tmp_path, extra):
    test_playbook_refuses_bad_settings(tmp_path, extra)


@needs_ansible
@pytest.mark.slow
def test_stop_dry_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastdecode.ops.rworkers", "stop", "--inventory", str(_local_inventory(tmp_path)),
                        "--run-dir", str(tmp_path / "run"), "--check"],
                       cwd=REPO, capture_output=True, text=True, env=ansible_env(), timeout=120)
    assert r.returncode == 0 and re.search(r"localnode\s+: ok=\d+.*failed=0", r.stderr), r.stderr[-3000:]


def _k8s() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "rworker.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_k8s_manifest_fits_together():
    docs = _k8s()
    assert set(docs) == {"Service", "StatefulSet"}
    svc, sts = docs["Service"], docs["StatefulSet"]
    assert svc["apiVersion"] == "v1" and sts["apiVersion"] == "apps/v1"
    assert svc["spec"]["clusterIP"] == "None"                       # headless
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for selector in (svc["spec"]["selector"], sts["spec"]["selector"]["matchLabels"]):
        assert selector and selector.items() <= labels.items()

    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (svc_port,) = svc["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == svc_port["port"] == 50061

    # The arguments are the real R-worker CLI's, after Kubernetes expands $(VAR).
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)].get("value", "10.0.0.7"), a) for a in c["args"]]
    args = rworker_parse_args(expanded)
    health_port = int(args.health_listen.rsplit(":", 1)[1])       # plaintext grpc.health.v1 for kubelet
    assert health_port != 50061 and health_port in ports.values()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health_port, probe
    assert args.listen == "10.0.0.7:50061" and args.kv_capacity == parse_size(env["KV_CAPACITY"]["value"])
    assert parse_size(c["resources"]["limits"]["memory"].replace("i", "")) > args.kv_capacity

    # The token file comes from the Secret mounted where --token-file points.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (token_volume,) = [n for n, path in mounts.items() if args.token_file.startswith(path + "/")]
    assert volumes[token_volume]["secret"]["secretName"]
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout  # SIGTERM drains before the kill


def test_dockerfile_copies_files_that_exist():
    text = (DEPLOY / "k8s" / "Dockerfile").read_text()
    sources = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")]
    assert "deploy/ansible/roles/rworker/files/requirements.txt" in sources
    assert (REPO / "deploy/ansible/roles/rworker/files/requirements.txt").is_file()
    image = _k8s()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"-t {image} " in text and 'ENTRYPOINT ["python", "-m", "rworker"]' in text


@pytest.mark.slow
def test_wheelhouse_installs_offline_and_serves(tmp_path):
    """What the rworker role does on a host, done here: a venv filled from the wheelhouse
    alone (no index, no pip config), then the installed R-worker serves outside the repo."""
    from fastdecode.ops.fleet import health
    from fastdecode.ops.procs import free_port
    from fastdecode.ops.rollout import build_wheelhouse

    wheels = build_wheelhouse(tmp_path / "wheels")
    venv = tmp_path / "host" / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(DEPLOY / "ansible/roles/rworker/files/requirements.txt")], env=env, check=True)
    subprocess.run([*pip, "--no-deps", "fastdecode"], env=env, check=True)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import rworker; print(rworker.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv))
    # The installed worker, started as the systemd unit starts it (outside the checkout).
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "rworker", "--listen", f"127.0.0.1:{port}",
                             "--kv-capacity", "8M", "--threads", "1"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        assert "READY" in proc.stderr.readline() + proc.stderr.readline()
        assert health(f"127.0.0.1:{port}", timeout=5) == "SERVING"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0                 # SIGTERM drains and exits 0
