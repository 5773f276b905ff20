"""R-worker security (#17): a non-loopback bind needs a token, mutual TLS or --insecure, and the
deployment files (Ansible, Kubernetes) hold to it, with probes on a plaintext health port.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from rpart.proto import rworker_pb2 as pb
from rpart.proto import rworker_pb2_grpc as pb_grpc
from rworker.server import ServerOptions, check_exposure, is_loopback

from test_rworker_limits import C, REPO, stats, in_process


# ---- binding (item 5) -------------------------------------------------------------------
@pytest.mark.parametrize("listen,local", [
    ("127.0.0.1:1", True), ("127.8.9.10:1", True), ("localhost:50061", True), ("[::1]:1", True),
    ("unix:/tmp/rworker.sock", True), ("0.0.0.0:1", False), ("[::]:1", False), ("10.0.0.7:50061", False),
    ("rworker-0.rworker:50061", False), ("256.1.1.1:99999", False)])
def test_is_loopback(listen, local):
    assert is_loopback(listen) is local


def test_exposure_needs_a_token_mutual_tls_or_insecure():
    exposed = "0.0.0.0:0"
    with pytest.raises(ValueError, match="--insecure"):
        check_exposure(ServerOptions(listen=exposed))
    with pytest.raises(ValueError, match="--insecure"):                          # TLS without client certs
        check_exposure(ServerOptions(listen=exposed, tls_cert="c", tls_key="k"))
    for ok in (dict(token="t"), dict(tls_cert="c", tls_key="k", tls_client_ca="ca"), dict(insecure=True)):
        check_exposure(ServerOptions(listen=exposed, **ok))
    check_exposure(ServerOptions(listen="127.0.0.1:0"))


def _start(args: list[str], timeout: float = 60.0) -> tuple[int | None, str]:
    """(exit status, or None if it served; its stderr so far) of `python -m rworker args`."""
    proc = subprocess.Popen([sys.executable, "-m", "rworker", "--store", "numpy", "--threads", "1",
                             "--kv-capacity", "4M", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not any("READY" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    rc = proc.poll()
    if rc is None:
        proc.kill()
    proc.wait(timeout=10)
    reader.join(timeout=10)
    return rc, "".join(lines)


def test_non_loopback_bind_without_auth_refuses_to_start_unless_insecure():
    rc, err = _start(["--listen", "0.0.0.0:0"])
    assert rc is not None and rc != 0, err
    assert "READY" not in err and "Traceback" not in err
    assert "--insecure" in err and "--token" in err and "--tls-client-ca" in err, err
    rc, err = _start(["--listen", "0.0.0.0:0", "--insecure"])
    assert rc is None and "READY" in err and "--insecure" in err, err          # serves, with a warning
    rc, err = _start(["--listen", "0.0.0.0:0", "--token", "s3cret"])
    assert rc is None and "READY" in err, err


# ---- deployment files (item 5) ----------------------------------------------------------
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
needs_ansible = pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(), reason="ansible-core is not installed")


def _dry_run(tmp_path: Path, host_vars: str) -> subprocess.CompletedProcess:
    """`ansible-playbook --check --diff` of the rworker play against this machine (installs nothing)."""
    tag = f"fdlim{os.getpid()}"
    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[rworkers]\nlocalnode ansible_connection=local ansible_python_interpreter={sys.executable} "
                   f"rworker_host=192.0.2.11 {host_vars}\n[rworkers:vars]\nrworker_prefix={tmp_path / 'opt'}\n"
                   f"rworker_unit=fastdecode-rworker-{tag}\nrworker_user={tag}\nrworker_wheelhouse={tmp_path}\n")
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": "/tmp/.ansible-fd-test"}
    return subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(REPO / "deploy/ansible/rworkers.yml"),
                           "--check", "--diff"], capture_output=True, text=True, env=env, timeout=300)


@needs_ansible
def test_ansible_refuses_a_host_address_without_token_or_mutual_tls(tmp_path):
    r = _dry_run(tmp_path, "")
    assert r.returncode != 0 and "192.0.2.11 is not a loopback address" in r.stdout, r.stdout[-2000:]
    r = _dry_run(tmp_path, "rworker_insecure=true")                 # explicit: the unit says --insecure
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    exec_start = re.search(r"^\+ExecStart=(.*)$", r.stdout, re.M).group(1).split()
    assert "--insecure" in exec_start and "--listen" in exec_start


def test_k8s_manifest_serves_mutual_tls_and_probes_a_plaintext_health_port():
    import yaml

    from rworker.__main__ import _options, parse_args

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "deploy/k8s/rworker.yaml").read_text()) if d}
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: "10.0.0.7" if m.group(1) == "POD_IP" else "1G", a) for a in c["args"]]
    args = parse_args(expanded)
    check_exposure(_options(parse_args([a for a in expanded if a not in ("--token-file", args.token_file)])))
    assert args.tls_cert and args.tls_key and args.tls_client_ca and args.token_file
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca, args.token_file):
        assert volumes[mounts[str(Path(path).parent)]]["secret"]["secretName"], path
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]   # can read the Secrets
    health_port = int(args.health_listen.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health_port != 50061, probe
    assert {p["containerPort"] for p in c["ports"]} == {50061, health_port}


def test_health_port_serves_probes_in_plaintext_while_the_service_port_needs_mutual_tls(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fastdecode.ops.testing import self_signed_cert

    ca = self_signed_cert(tmp_path, "ca")
    cert, key = self_signed_cert(tmp_path, "server", ca=ca)
    opts = dict(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca[0]), health_listen="127.0.0.1:0")
    with in_process(**opts) as server:
        def health() -> int:
            with grpc.insecure_channel(server.health_address) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status

        assert health() == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(server.health_address) as ch:                 # nothing else there
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
            assert e.value.code() == C.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as e:                                 # plaintext on the TLS port
            stats(server.address)
        assert e.value.code() == C.UNAVAILABLE and "Socket closed" in e.value.details(), e.value.details()
        server.service.drain()
        assert health() == health_pb2.HealthCheckResponse.NOT_SERVING
