"""Helpers for tests and benches: local R-worker fleets and throw-away TLS certificates."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from fastdecode.config import REPO_ROOT
from fastdecode.ops.fleet import LocalFleet


def store_kind(asked: str = "kernel") -> str:
    """The KV store of test R-workers: the C++ kernel's unless a test asks for another by name
    (numpy: the reference store). A kernel that does not import is an error, not a switch to
    another store."""
    if asked != "kernel":
        return asked
    try:
        from rpart.kernels import KVStore  # noqa: F401
    except ImportError as e:
        raise ImportError(f"R-workers need the C++ kernel store, and rpart.kernels does not import ({e}); "
                          "run `make build`") from e
    return "kernel"


def local_fleet(n: int, run_dir, *, kv_capacity: str | int = "64M", threads: int = 1,
                extra_args: tuple[str, ...] = (), **kwargs) -> LocalFleet:
    """An unstarted LocalFleet of n small R-workers on free loopback ports (use as a context manager)."""
    args = ("--store", store_kind(), "--drain-timeout", "5", *extra_args)
    return LocalFleet(n, run_dir, kv_capacity=kv_capacity, threads=threads, rworker_args=args,
                      stop_timeout=5.0, **kwargs)


def self_signed_cert(out_dir, name: str = "rworker", ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """Write <name>.crt/<name>.key with SAN localhost + 127.0.0.1: a self-signed CA (ca=None),
    or a leaf (CN=localhost) signed by ca=(cert, key). Needs the `cryptography` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out_dir = Path(out_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    cn = "fastdecode test CA" if ca is None else "localhost"   # a leaf's subject must differ from its issuer's
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    if ca is None:
        issuer, signer = subject, key
    else:
        ca_cert = x509.load_pem_x509_certificate(Path(ca[0]).read_bytes())
        issuer = ca_cert.subject
        signer = serialization.load_pem_private_key(Path(ca[1]).read_bytes(), password=None)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
            .sign(signer, hashes.SHA256()))
    cert_path, key_path = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class Spawned:
    """One `python -m rworker` subprocess (for tests that need its exit status)."""

    def __init__(self, args: list[str], log_path, timeout: float = 60.0) -> None:
        import re
        import subprocess
        import sys
        import time

        self.log_path = Path(log_path)
        self.log = open(self.log_path, "wb")
        argv = [sys.executable, "-m", "rworker", "--listen", "127.0.0.1:0", "--kv-capacity", "16M",
                "--threads", "1", "--store", store_kind(), *args]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=REPO_ROOT)
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(rb"READY (\S+)", self.log_path.read_bytes())
            if m:
                self.address = m.group(1).decode()
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rworker did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        try:
            return self.proc.wait(timeout=10)
        finally:
            self.log.close()

    def __enter__(self) -> "Spawned":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
