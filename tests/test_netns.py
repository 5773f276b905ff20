"""R-workers on separate network hosts: each in its own Linux network namespace, joined
to this one by a veth pair with its own /24 (10.231.x.0/24, created and removed here).
The S-worker side (this process, root namespace) reaches them over those addresses only.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip`; skips with the reason otherwise.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch

from fastdecode.attention.base import KVSpec
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.config import EngineConfig
from fastdecode.ops.fleet import LocalFleet, health
from fastdecode.ops.testing import store_kind

pytestmark = pytest.mark.netns
SUBNETS = ipaddress.ip_network("10.231.0.0/16")
HOSTS = 2


@dataclass
class NetnsHost:
    ns: str              # network namespace
    outer: str           # veth end in the root namespace
    outer_ip: str
    ip: str              # the host's address (inside the namespace)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def why_not() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    caps = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")), 16)
    if not (caps >> 12 & 1 and caps >> 21 & 1):
        return "creating network namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN"
    return None


def free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    """/24s of 10.231.0.0/16 that no address or route on this machine overlaps."""
    used = []
    for word in (ip("-o", "-4", "addr", "show").stdout + ip("-4", "route", "show", "table", "all").stdout).split():
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    used = [n for n in used if n.version == 4 and n.prefixlen > 0]      # not "default"
    free = [n for n in list(SUBNETS.subnets(new_prefix=24))[1:] if not any(n.overlaps(u) for u in used)]
    return free[:count]


def teardown(hosts: list[NetnsHost]) -> None:
    for h in hosts:
        for pid in ip("netns", "pids", h.ns, check=False).stdout.split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", h.ns, check=False)          # deletes the veth pair with it
        ip("link", "del", h.outer, check=False)


def remove_stale() -> None:
    """Namespaces this test left behind in a run that was killed (its pid is gone)."""
    for name in ip("netns", "list", check=False).stdout.split():
        m = re.fullmatch(r"fd(\d+)h\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            teardown([NetnsHost(ns=name, outer=f"fd{m.group(1)}v{name.rsplit('h', 1)[1]}", outer_ip="", ip="")])


@pytest.fixture(scope="module")
def hosts() -> list[NetnsHost]:
    reason = why_not()
    if reason:
        pytest.skip(reason)
    remove_stale()
    tag = f"fd{os.getpid()}"                    # veth names stay within 15 characters
    subnets = free_subnets(HOSTS)
    if len(subnets) < HOSTS:
        pytest.skip("no free /24 in 10.231.0.0/16 for the test hosts")
    made: list[NetnsHost] = []
    try:
        for i, net in enumerate(subnets):
            outer_ip, inner_ip = (str(a) for a in list(net.hosts())[:2])
            h = NetnsHost(ns=f"{tag}h{i}", outer=f"{tag}v{i}", outer_ip=outer_ip, ip=inner_ip)
            r = ip("netns", "add", h.ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(h)
            ip("link", "add", h.outer, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            ip("addr", "add", f"{outer_ip}/24", "dev", h.outer)
            ip("link", "set", h.outer, "up")
            ip("-n", h.ns, "addr", "add", f"{inner_ip}/24", "dev", "eth0")
            ip("-n", h.ns, "link", "set", "eth0", "up")
            ip("-n", h.ns, "link", "set", "lo", "up")
        yield made
    finally:
        teardown(made)


@pytest.fixture(scope="module")
def fleet(hosts, tmp_path_factory):
    with LocalFleet(len(hosts), tmp_path_factory.mktemp("netns_fleet"), kv_capacity="16M", threads=1,
                    hosts=[h.ip for h in hosts], prefixes=[["ip", "netns", "exec", h.ns] for h in hosts],
                    rworker_args=["--store", store_kind(), "--drain-timeout", "5", "--insecure"], stop_timeout=5.0) as f:
        yield f


def test_workers_run_on_their_own_hosts(hosts, fleet):
    assert fleet.addresses == tuple(f"{h.ip}:{50061 + i}" for i, h in enumerate(hosts))
    assert [health(a) for a in fleet.addresses] == ["SERVING"] * len(hosts)
    ours = os.readlink("/proc/self/ns/net")
    namespaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in fleet.pids}
    assert ours not in namespaces and len(namespaces) == len(hosts)
    root_addrs = ip("-o", "-4", "addr", "show").stdout
    for h in hosts:
        assert f" {h.ip}/" not in root_addrs              # the worker's address is not ours
        assert f" {h.ip}/" in ip("-n", h.ns, "-o", "-4", "addr", "show").stdout
    # Separate hosts: the first cannot reach the second (no route between the namespaces).
    r = ip("-n", hosts[0].ns, "route", "get", hosts[1].ip, check=False)
    assert r.returncode != 0 and "unreachable" in r.stderr.lower()


def test_remote_attention_across_hosts_matches_reference(fleet):
    from fastdecode.attention.remote.backend import RemoteAttention

    spec = KVSpec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    backend = RemoteAttention(spec, EngineConfig(attention="remote", rworkers=fleet.addresses))
    ref = TorchAttention(spec)
    seq_ids, lens = [1, 2, 3, 4], [3, 8, 1, 20]

    def kv(n):
        return torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen).half().float()

    try:
        for b in (backend, ref):
            b.open(seq_ids)
        for layer in range(spec.num_layers):
            k, v = kv(sum(lens)), kv(sum(lens))
            backend.prefill(layer, seq_ids, lens, k, v)
            ref.prefill(layer, seq_ids, lens, k, v)
        for _ in range(3):
            for layer in range(spec.num_layers):
                q = torch.randn(len(seq_ids), spec.num_heads, spec.head_dim, generator=gen)
                k, v = kv(len(seq_ids)), kv(len(seq_ids))
                got = backend.submit_decode(layer, seq_ids, q, k, v).result(timeout=30)
                torch.testing.assert_close(got, ref.decode(layer, seq_ids, q, k, v), atol=1e-5, rtol=1e-5)
        workers = backend.stats()["workers"]
        assert sorted(w["address"] for w in workers) == sorted(fleet.addresses)
        assert all(w["sequences"] > 0 for w in workers), workers      # both hosts hold KV
    finally:
        backend.shutdown()


def test_greedy_generation_across_hosts_equals_local(fleet, tiny_model_dir):
    from fastdecode.engine import Engine, SamplingParams

    prompts = [[1, 5, 9, 2], [7, 7, 3], list(range(3, 20))]
    params = SamplingParams.from_dict({"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})

    def generate(**config) -> list[list[int]]:
        engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", **config))
        try:
            ids = [engine.add_request(p, params) for p in prompts]
            out: dict[str, list[int]] = {i: [] for i in ids}
            while engine.has_unfinished():
                for o in engine.step():
                    out[o.request_id] += o.token_ids
            return [out[i] for i in ids]
        finally:
            engine.stop()                      # also shuts the attention backend down

    remote = generate(attention="remote", rworkers=fleet.addresses)
    assert remote == generate(attention="local")
    assert all(len(t) == 12 for t in remote)
