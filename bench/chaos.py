"""Fault injection under concurrent streaming load (`make chaos`, issue #17).

    python bench/chaos.py [--model models/smollm2-135m-instruct] [--clients 64] [--max-tokens 16]
                          [--scenarios kill,stall,malformed,restart,netns] [--dtype float32]
                          [--deadline-s 180] [--out bench/results/chaos.json]

The deployment is `make serve RWORKERS=2`'s, built the way fastdecode.ops.serve's `start` builds it:
two local R-workers (fastdecode.ops.fleet.LocalFleet) and tritonserver with the `fastdecode` model
(attention=remote), in a temporary run directory. `--clients` threads each keep one request in
flight: one tritonclient gRPC stream per request, greedy, `--max-tokens` tokens (ignore_eos);
client i always sends prompt i. First a fault-free run of every prompt gives the expected texts;
then each scenario, one at a time, starts the load, waits until requests are mid-generation,
injects its fault, recovers, and keeps the load going until every client has completed a request
submitted after the recovery (a client that has submits no more):

  kill       SIGKILL R-worker 0 while it holds KV of running requests, restart it on its address
  stall      SIGSTOP R-worker 1 for --stall-s seconds, then SIGCONT
  malformed  R-workers 0 and 1 in turn get random bytes, malformed calls (wrong shapes, absurd
             lengths, unknown sequence ids, ...) and an oversized message on streams of their own
  restart    SIGKILL tritonserver (with its stub); requests then in flight end with an error;
             clients wait until it serves again on the same ports, then submit as before
  netns      R-workers in network namespaces of their own (as tests/test_netns.py); worker 0's
             link goes down for --cut-s seconds, then up. Skipped, with the reason, without root
             and CAP_NET_ADMIN or where `ip netns` fails

Each request ends one way: completed (its text equal to the fault-free run's: correct, or not:
incorrect), error (a final error response or a broken stream) or lost (no final response within
--deadline-s). The run fails (exit 1) when any request is lost, when a scenario in which one
R-worker stays up (kill, stall, malformed, netns) has an error, when a request submitted after
tritonserver's restart has one, or when a scenario could not run (e.g. its fault never found
requests mid-generation). Writes bench/results/chaos.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_peers import commit, cpu_model, prompt_text  # noqa: E402
from fastdecode.ops import procs  # noqa: E402

MODEL = "fastdecode"
SCENARIOS = ("kill", "stall", "malformed", "restart", "netns")
ONE_WORKER_STAYS_UP = {"kill", "stall", "malformed", "netns"}
NETNS_PORT = 50061                      # LocalFleet's port for worker i in a namespace: NETNS_PORT + i


@dataclass
class Settings:
    model: str = "models/smollm2-135m-instruct"
    clients: int = 64
    max_tokens: int = 16
    dtype: str = "float32"               # "" = the model parameter's default (auto)
    deadline_s: float = 180.0            # a request with no final response by then is lost
    stall_s: float = 5.0
    cut_s: float = 15.0                  # longer than rworker_timeout_s (10 s): the engine notices
    kv_capacity: str = "1G"              # per R-worker, as `make serve`
    rworker_args: tuple[str, ...] = ()
    malformed_rounds: int = 4
    startup_timeout_s: float = 300.0
    seed: int = 0


def sampling(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def wait_for(condition, timeout: float, interval: float = 0.1):
    """Poll condition() until it is truthy or `timeout` s pass; its last value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(interval)
    return value


# ---- one request

@dataclass
class Outcome:
    client: int
    submitted: float                     # time.monotonic()
    ended: float
    kind: str                            # completed | error | lost
    text: str = ""
    error: str = ""


def stream_request(triton, prompt: str, max_tokens: int, deadline_s: float, on_first_text=lambda: None):
    """One request on a stream of its own: (kind, text, error) with kind completed, error or lost."""
    from fastdecode.ops import client

    responses: queue.SimpleQueue = queue.SimpleQueue()
    parts: list[str] = []
    ended = False                        # the server ended it: nothing to cancel (see client.generate)
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        try:
            triton.async_stream_infer(MODEL, client.build_inputs(prompt, sampling(max_tokens)),
                                      enable_empty_final_response=True)
        except Exception as e:  # noqa: BLE001 -- the stream broke before the request went out
            ended = True
            return "error", "", f"submit failed: {e}"
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "lost", "".join(parts), f"no final response within {deadline_s:g} s"
            if error is not None:
                ended = True
                return "error", "".join(parts), str(error)
            text = client.decode_result(result).get("text_output", "")
            if text and not parts:
                on_first_text()
            parts.append(text)
            if result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
                return "completed", "".join(parts), ""
    finally:
        triton.stop_stream(cancel_requests=not ended)


class Load:
    """`len(prompts)` client threads; client i sends prompts[i], one request at a time, until stop()
    (once=True: one request each). New submissions wait between pause() and resume()."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, deadline_s: float, once: bool = False):
        self.url, self.prompts, self.max_tokens, self.deadline_s, self.once = url, prompts, max_tokens, deadline_s, once
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.epoch = 0                               # resume() count: clients reconnect after a pause
        self.stopping = threading.Event()
        self.in_flight: dict[int, float] = {}        # client -> submitted at
        self.streaming: set[int] = set()             # clients whose request has streamed text
        self.abandoned: set[int] = set()             # clients join() gave up on
        self.enough_after: float | None = None       # see finish_after()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"chaos-client-{i}")
                        for i in range(len(prompts))]

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def _client(self, i: int) -> None:
        import tritonclient.grpc as grpcclient

        triton, epoch = None, self.epoch
        while not self.stopping.is_set():
            if not self.gate.wait(timeout=0.2) or self.stopping.is_set():
                continue
            if triton is not None and epoch != self.epoch:
                # a fresh channel after a pause: one that saw the server go may sit in reconnect backoff
                triton.close()
                triton = None
            if triton is None:
                triton, epoch = grpcclient.InferenceServerClient(self.url), self.epoch
            t0 = time.monotonic()
            with self.lock:
                self.in_flight[i] = t0
            try:
                kind, text, error = stream_request(triton, self.prompts[i], self.max_tokens, self.deadline_s,
                                                   on_first_text=lambda: self._streaming(i))
            except Exception as e:  # noqa: BLE001 -- whatever the client library raises is this request's error
                kind, text, error = "error", "", f"{type(e).__name__}: {e}"
            with self.lock:
                if i in self.abandoned:          # join() has counted this request lost already
                    return
                self.in_flight.pop(i, None)
                self.streaming.discard(i)
                self.outcomes.append(Outcome(i, t0, time.monotonic(), kind, text, error))
            if kind != "completed":
                triton.close()
                triton = None
            if self.once or (kind == "completed" and self.enough_after is not None and t0 >= self.enough_after):
                break
        if triton is not None:
            triton.close()

    def finish_after(self, t: float) -> None:
        """A client that completes a request submitted at or after t submits no more."""
        self.enough_after = t

    def pause(self) -> None:
        """Hold new submissions (those in flight go on)."""
        self.gate.clear()

    def resume(self) -> None:
        self.epoch += 1
        self.gate.set()

    def _streaming(self, i: int) -> None:
        with self.lock:
            self.streaming.add(i)

    def num_streaming(self) -> int:
        with self.lock:
            return len(self.streaming)

    def num_in_flight(self) -> int:
        with self.lock:
            return len(self.in_flight)

    def clients_done_since(self, t: float) -> int:
        """Clients that completed a request submitted at or after t."""
        with self.lock:
            return len({o.client for o in self.outcomes if o.kind == "completed" and o.submitted >= t})

    def stop(self) -> None:
        """No new submissions; wait for the requests in flight (each ends by its deadline)."""
        self.stopping.set()
        self.gate.set()
        self.join()

    def join(self) -> None:
        """Wait for the client threads (after stop(), or with once=True). One still stuck past
        the deadline of its request has that request counted as lost."""
        join_by = time.monotonic() + self.deadline_s + 60.0
        for t in self.threads:
            t.join(timeout=max(0.0, join_by - time.monotonic()))
        with self.lock:
            for i, t0 in self.in_flight.items():
                self.outcomes.append(Outcome(i, t0, time.monotonic(), "lost", error="client thread stuck"))
                self.abandoned.add(i)
            self.in_flight.clear()


def tally(outcomes: list[Outcome], prompts: list[str], expected: dict[int, str]) -> dict:
    correct = [o for o in outcomes if o.kind == "completed" and o.text == expected[o.client]]
    incorrect = [o for o in outcomes if o.kind == "completed" and o.text != expected[o.client]]
    errors = [o for o in outcomes if o.kind == "error"]
    lost = [o for o in outcomes if o.kind == "lost"]
    return {"accepted": len(outcomes), "completed_correct": len(correct), "completed_incorrect": len(incorrect),
            "errors": len(errors), "lost": len(lost),
            "error_samples": sorted({o.error[:300] for o in errors})[:5],
            "lost_samples": sorted({o.error[:300] for o in lost})[:5],
            "incorrect_samples": [{"prompt": prompts[o.client], "expected": expected[o.client], "got": o.text}
                                  for o in incorrect[:3]]}


# ---- the deployment

def model_kv_shape(model_dir: str) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model: the KV shape the engine configures each R-worker with."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
            cfg.get("head_dim") or cfg["hidden_size"] // heads)


class Deployment:
    """Two R-workers and tritonserver, as fastdecode.ops.serve's `start` with --rworkers 2; `netns`:
    the R-workers each in a network namespace of its own (hosts from netns_hosts)."""

    def __init__(self, settings: Settings, run_dir: Path, netns: list | None = None) -> None:
        self.settings, self.run_dir, self.netns = settings, Path(run_dir), netns
        self.fleet = None
        self.server = None
        self.repo: Path | None = None

    def start(self) -> "Deployment":
        from fastdecode.ops.triton import TritonServer, write_model_repository
        from fastdecode.ops.fleet import LocalFleet

        s = self.settings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ports = procs.stable_ports(5)               # 2 R-workers (unless in namespaces), 3 for tritonserver
        where = {"base_port": ports[0]}
        args = list(s.rworker_args)
        if self.netns:
            where = {"hosts": [h.ip for h in self.netns],
                     "prefixes": [["ip", "netns", "exec", h.ns] for h in self.netns]}
            args.append("--insecure")        # a non-loopback address with no token: refused otherwise
        try:
            self.fleet = LocalFleet(2, self.run_dir / "rworkers", kv_capacity=s.kv_capacity, rworker_args=args,
                                    **where).start()
            params = {"model": str(Path(s.model).resolve()), "attention": "remote",
                      "rworkers": ",".join(self.fleet.addresses)}
            if s.dtype:
                params["dtype"] = s.dtype
            self.repo = write_model_repository(self.run_dir / "model_repository", params)
            self.server = TritonServer(self.repo, self.run_dir, http_port=ports[2], grpc_port=ports[3],
                                       metrics_port=ports[4]).start(timeout=s.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    def kill_server(self) -> None:
        """SIGKILL tritonserver and its stub (its process group), then remove the stub's shared memory."""
        from fastdecode.ops.procs import cmdline, group_members

        pid = self.server.proc.pid
        shm = [a for m in group_members(pid) for a in cmdline(m) if a.startswith("triton_python_backend_shm_region")]
        os.killpg(pid, signal.SIGKILL)
        self.server.proc.wait(timeout=30)
        wait_for(lambda: not group_members(pid), timeout=30)
        for name in shm:
            Path("/dev/shm", name).unlink(missing_ok=True)
        self.server.proc = None

    def start_server_again(self) -> None:
        """A fresh tritonserver on the same ports and model repository."""
        from fastdecode.ops.triton import TritonServer

        old = self.server
        self.server = TritonServer(self.repo, self.run_dir, http_port=old.http_port, grpc_port=old.grpc_port,
                                   metrics_port=old.metrics_port).start(timeout=self.settings.startup_timeout_s)

    def log_size(self) -> int:
        try:
            return self.server.log_path.stat().st_size
        except OSError:
            return 0

    def engine_events(self, since: int, limit: int = 12) -> list[str]:
        """The engine's R-worker events (down, sequences lost) in tritonserver's log after byte `since`."""
        try:
            with open(self.server.log_path, "rb") as f:
                f.seek(since)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        events = [line.strip()[:300] for line in lines
                  if "R-worker" in line and (" down: " in line or "lost with R-worker" in line)]
        return events[:limit] + ([f"... {len(events) - limit} more"] if len(events) > limit else [])

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.fleet is not None:
            self.fleet.stop()


def worker_sequences(address: str) -> int:
    """Sequences an R-worker holds (all connections), from its Stats; -1 when it does not answer."""
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rpart.proto import rworker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            return pb_grpc.RWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5).sequences
        except grpc.RpcError:
            return -1


def serving(address: str) -> bool:
    from fastdecode.ops.fleet import health

    return health(address, timeout=2.0) == "SERVING"


# ---- malformed messages

def malformed_calls(shape: tuple[int, int, int], rng: random.Random) -> list[tuple[str, object, bool]]:
    """(label, Request, must be refused) in stream order. The stream first configures itself with
    the engine's KV shape (a reshape would be refused while the engine is connected) and opens
    sequence 1, so that the calls after those reach the shape and id checks."""
    import numpy as np

    from rpart.proto import rworker_pb2 as pb
    from rpart.wire import to_tensor

    layers, kvh, dim = shape

    def kv(rows: int) -> pb.Tensor:
        return to_tensor(np.zeros((rows, kvh, dim), np.float16))

    def q(rows: int, heads: int = kvh) -> pb.Tensor:
        return to_tensor(np.zeros((rows, heads, dim), np.float32))

    def prefill(ids, lens, k, v=None, layer: int = 0) -> pb.Request:
        return pb.Request(prefill=pb.Prefill(layer=layer, seq_ids=ids, lens=lens, k=k, v=kv(1) if v is None else v))

    def decode(ids, q_, rows: int) -> pb.Request:
        return pb.Request(decode=pb.Decode(layer=0, seq_ids=ids, q=q_, k=kv(rows), v=kv(rows)))

    def configure(layers_: int, kv_format: str = "fp16") -> pb.Request:
        return pb.Request(configure=pb.Configure(num_layers=layers_, num_kv_heads=kvh, head_dim=dim,
                                                 kv_format=kv_format))

    def raw(data: bytes, shape, dtype: str = "float16") -> pb.Tensor:
        return pb.Tensor(data=data, shape=shape, dtype=dtype)

    noise = bytes(rng.getrandbits(8) for _ in range(64))
    return [
        ("no operation", pb.Request(), True),
        ("prefill before configure", prefill([1], [1], kv(1)), True),
        ("configure absurd layers", configure(2**31 - 1), True),
        ("configure unknown kv format", configure(layers, "fp8"), True),
        ("configure", configure(layers), False),
        ("open", pb.Request(open=pb.Open(seq_ids=[1])), False),
        ("open again", pb.Request(open=pb.Open(seq_ids=[1])), True),
        ("open negative id", pb.Request(open=pb.Open(seq_ids=[-1])), True),
        ("open id out of range", pb.Request(open=pb.Open(seq_ids=[2**50])), True),
        ("prefill wrong shape", prefill([1], [2], kv(3), kv(3)), True),
        ("prefill absurd length", prefill([1], [2**31 - 1], kv(1)), True),
        ("prefill length over 2**31", prefill([1], [2**40], kv(1)), True),
        ("prefill negative length", prefill([1], [-5], kv(1)), True),
        ("prefill lengths != ids", prefill([1], [1, 1], kv(2), kv(2)), True),
        ("prefill layer out of range", prefill([1], [1], kv(1), layer=10**6), True),
        ("prefill bytes != shape", prefill([1], [1], raw(noise, [1, kvh, dim])), True),
        ("prefill shape overflowing int64", prefill([1], [1], raw(b"", [2**32, 2**32, 1])), True),
        ("prefill negative dimension", prefill([1], [1], raw(b"", [-1, kvh, dim])), True),
        ("prefill unknown dtype", prefill([1], [1], raw(noise, [64], "int8")), True),
        ("prefill unknown sequence id", prefill([777], [1], kv(1)), True),
        ("decode unknown sequence ids", decode([12345, 999], q(2), 2), True),
        # q's heads must be a multiple of the kv heads: kvh + 1 is not, unless kvh == 1
        ("decode q wrong heads", decode([1], q(1, kvh + 1), 1), kvh > 1),
        ("decode rows != ids", decode([1], q(3), 3), True),
        ("decode too many ids", decode(list(range(70_000)), q(1), 1), True),
        ("close unknown sequence id", pb.Request(close=pb.Close(seq_ids=[424242])), False),
    ]


def hostile_session(address: str, shape: tuple[int, int, int], rng: random.Random, timeout: float = 60.0) -> dict:
    """Send one R-worker the malformed calls, random bytes on streams and in a unary call, and a message
    over its size limit; returns how it answered. `unanswered` must stay empty: every call gets a
    reply or ends its stream with a status."""
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from rworker.server import SERVICE_NAME

    report = {"sent": 0, "refused": 0, "accepted": 0, "refused_unexpectedly": [], "accepted_unexpectedly": [],
              "unanswered": [], "stream_errors": {}}
    options = [("grpc.max_send_message_length", 128 << 20), ("grpc.enable_http_proxy", 0)]
    calls = malformed_calls(shape, rng)
    with grpc.insecure_channel(address, options=options) as ch:
        session = ch.stream_stream(f"/{SERVICE_NAME}/Session", request_serializer=pb.Request.SerializeToString,
                                   response_deserializer=pb.Reply.FromString)
        requests = []
        for n, (_, req, _) in enumerate(calls, start=1):
            req.call_id = n
            requests.append(req)
        replies = {}
        try:
            for reply in session(iter(requests), timeout=timeout):
                replies[reply.call_id] = reply
        except grpc.RpcError as e:
            report["stream_errors"]["malformed calls"] = f"{e.code().name}: {e.details()}"
        for n, (label, _, must_fail) in enumerate(calls, start=1):
            report["sent"] += 1
            reply = replies.get(n)
            if reply is None:
                report["unanswered"].append(label)
            elif reply.code:
                report["refused"] += 1
                if not must_fail and label in ("configure", "open"):
                    report["refused_unexpectedly"].append(f"{label}: {reply.message}")
            else:
                report["accepted"] += 1
                if must_fail:
                    report["accepted_unexpectedly"].append(label)

        raw = ch.stream_stream(f"/{SERVICE_NAME}/Session", request_serializer=None, response_deserializer=None)
        junk = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 4096))) for _ in range(8)]
        for label, payload in (("random bytes on a session", junk), ("oversized message", [os.urandom(65 << 20)])):
            report["sent"] += len(payload)
            try:
                for _ in raw(iter(payload), timeout=timeout):
                    pass
                report["stream_errors"][label] = "OK (no error)"
            except grpc.RpcError as e:
                report["stream_errors"][label] = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    report["unanswered"].append(label)
        stats = ch.unary_unary(f"/{SERVICE_NAME}/Stats", request_serializer=None, response_deserializer=None)
        report["sent"] += 1
        try:
            stats(bytes(rng.getrandbits(8) for _ in range(512)), timeout=timeout)
            report["stream_errors"]["random bytes as Stats"] = "OK (no error)"
        except grpc.RpcError as e:
            report["stream_errors"]["random bytes as Stats"] = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                report["unanswered"].append("random bytes as Stats")
    return report


# ---- network namespaces

def netns_hosts(count: int) -> tuple[list, str]:
    """`count` network namespaces, each joined to this one by a veth pair (tests/test_netns.py's
    layout); ([], why) where this machine cannot make them."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import test_netns as netns
    except ImportError as e:
        return [], f"tests/test_netns.py does not import: {e}"
    reason = netns.why_not()
    if reason:
        return [], reason
    netns.remove_stale()
    subnets = netns.free_subnets(count)
    if len(subnets) < count:
        return [], "no free /24 in 10.231.0.0/16"
    tag = f"fd{os.getpid()}"
    made = []
    try:
        for i, net in enumerate(subnets):
            outer_ip, inner_ip = (str(a) for a in list(net.hosts())[:2])
            h = netns.NetnsHost(ns=f"{tag}h{i}", outer=f"{tag}v{i}", outer_ip=outer_ip, ip=inner_ip)
            r = netns.ip("netns", "add", h.ns, check=False)
            if r.returncode != 0:
                netns.teardown(made)
                return [], f"cannot create a network namespace here: {r.stderr.strip()}"
            made.append(h)
            netns.ip("link", "add", h.outer, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            netns.ip("addr", "add", f"{outer_ip}/24", "dev", h.outer)
            netns.ip("link", "set", h.outer, "up")
            netns.ip("-n", h.ns, "addr", "add", f"{inner_ip}/24", "dev", "eth0")
            netns.ip("-n", h.ns, "link", "set", "eth0", "up")
            netns.ip("-n", h.ns, "link", "set", "lo", "up")
    except (RuntimeError, OSError) as e:
        netns.teardown(made)
        return [], f"setting up network namespaces failed: {e}"
    return made, ""


def netns_teardown(hosts: list) -> None:
    if hosts:
        import test_netns as netns

        netns.teardown(hosts)


# ---- the faults: each returns when the system should have recovered (the time to count "after" from)

def mid_generation(load: Load, s: Settings, info: dict, address: str | None = None) -> None:
    """Wait until half the clients' requests are streaming and, given `address`, that R-worker holds
    sequences; RuntimeError when that does not happen within the request deadline."""
    need = max(1, len(load.prompts) // 2)
    state = {}

    def ready() -> bool:
        state["streaming"] = load.num_streaming()
        if state["streaming"] < need:
            return False
        if address is not None:
            state["held"] = worker_sequences(address)
            return state["held"] > 0
        return True
    if not wait_for(ready, timeout=s.deadline_s, interval=0.02):
        raise RuntimeError(f"never {need} requests streaming{' and KV on ' + address if address else ''} "
                           f"within {s.deadline_s:g} s of load (last seen: {state})")
    info["requests_streaming_at_fault"] = state["streaming"]
    if address is not None:
        info["worker"] = address
        info["sequences_on_worker_at_fault"] = state["held"]


def fault_kill(dep: Deployment, load: Load, s: Settings, info: dict) -> float:
    address = dep.fleet.addresses[0]
    mid_generation(load, s, info, address)
    dep.fleet.kill(0)
    t = time.monotonic()
    dep.fleet.restart(0)
    info["restart_s"] = round(time.monotonic() - t, 2)
    recovered = time.monotonic()
    # the engine reconnects the restarted worker and places new sequences on it again
    info["restarted_worker_used_again"] = bool(wait_for(lambda: worker_sequences(address) > 0,
                                                        timeout=s.deadline_s, interval=0.05))
    return recovered


def fault_stall(dep: Deployment, load: Load, s: Settings, info: dict) -> float:
    address = dep.fleet.addresses[1]
    mid_generation(load, s, info, address)
    dep.fleet.kill(1, signal.SIGSTOP)
    time.sleep(s.stall_s)                # the fault is this long a stall
    dep.fleet.kill(1, signal.SIGCONT)
    recovered = time.monotonic()
    info["serving_after_sigcont"] = bool(wait_for(lambda: serving(address), timeout=60))
    return recovered


def fault_netns(dep: Deployment, load: Load, s: Settings, info: dict) -> float:
    import test_netns as netns

    host, address = dep.netns[0], dep.fleet.addresses[0]
    mid_generation(load, s, info, address)
    netns.ip("link", "set", host.outer, "down")
    try:
        info["unreachable_while_down"] = not serving(address)
        time.sleep(max(0.0, s.cut_s - 2.0))   # the fault is this long a cut (the probe above took up to 2 s)
    finally:
        netns.ip("link", "set", host.outer, "up")
    recovered = time.monotonic()
    info["serving_after_link_up"] = bool(wait_for(lambda: serving(address), timeout=60))
    info["worker_used_again"] = bool(wait_for(lambda: worker_sequences(address) > 0, timeout=s.deadline_s,
                                              interval=0.05))
    return recovered


def fault_malformed(dep: Deployment, load: Load, s: Settings, info: dict) -> float:
    mid_generation(load, s, info)
    rng = random.Random(s.seed)
    shape = model_kv_shape(s.model)
    rounds = []
    for r in range(s.malformed_rounds):
        address = dep.fleet.addresses[r % 2]
        report = hostile_session(address, shape, rng)
        report.update(worker=r % 2, requests_streaming=load.num_streaming(), serving_after=serving(address))
        rounds.append(report)
    info["rounds"] = rounds
    info["all_answered"] = all(not r["unanswered"] for r in rounds)
    info["malformed_all_refused"] = all(not r["accepted_unexpectedly"] and not r["refused_unexpectedly"]
                                        for r in rounds)
    info["workers_serving_after"] = all(r["serving_after"] for r in rounds)
    return time.monotonic()


def fault_restart(dep: Deployment, load: Load, s: Settings, info: dict) -> float:
    mid_generation(load, s, info)
    load.pause()
    info["requests_in_flight_at_fault"] = load.num_in_flight()
    dep.kill_server()
    t = time.monotonic()
    dep.start_server_again()
    info["server_restart_s"] = round(time.monotonic() - t, 2)
    reopened = time.monotonic()
    load.resume()
    return reopened


FAULTS = {"kill": fault_kill, "stall": fault_stall, "netns": fault_netns, "malformed": fault_malformed,
          "restart": fault_restart}
DESCRIPTIONS = {
    "kill": "SIGKILL R-worker 0 while it holds sequences, restart it on the same address",
    "stall": "SIGSTOP R-worker 1, SIGCONT after stall_s",
    "netns": "R-workers in their own network namespaces; worker 0's veth link down for cut_s, then up",
    "malformed": "malformed calls, random bytes and an oversized message to R-workers 0 and 1 in turn",
    "restart": "SIGKILL tritonserver (and its stub) mid-generation, start it again on the same ports",
}


# ---- a run

def fault_free(dep: Deployment, prompts: list[str], s: Settings) -> tuple[dict[int, str], dict]:
    """Every prompt once, all at once, with no fault: the expected texts."""
    t0 = time.monotonic()
    load = Load(dep.grpc_url, prompts, s.max_tokens, s.deadline_s, once=True).start()
    load.join()
    counts = {k: sum(o.kind == k for o in load.outcomes) for k in ("completed", "error", "lost")}
    summary = {**counts, "seconds": round(time.monotonic() - t0, 1),
               "error_samples": sorted({o.error[:300] for o in load.outcomes if o.kind != "completed"})[:5]}
    return {o.client: o.text for o in load.outcomes if o.kind == "completed"}, summary


def run_scenario(name: str, dep: Deployment, prompts: list[str], expected: dict[int, str], s: Settings) -> dict:
    info: dict = {"fault": DESCRIPTIONS[name]}
    log_from = dep.log_size()
    t0 = time.monotonic()
    load = Load(dep.grpc_url, prompts, s.max_tokens, s.deadline_s).start()
    failure = ""
    recovered = None
    try:
        recovered = FAULTS[name](dep, load, s, info)
        load.finish_after(recovered)
        everyone = wait_for(lambda: load.clients_done_since(recovered) >= len(prompts), timeout=s.deadline_s,
                            interval=0.2)
        info["every_client_completed_after_fault"] = bool(everyone)
    except Exception as e:  # noqa: BLE001 -- the scenario could not run as planned: recorded, fails the run
        failure = f"{type(e).__name__}: {e}"
    finally:
        load.stop()
    info["engine_events"] = dep.engine_events(log_from)
    result = {"skipped": False, "reason": None, **tally(load.outcomes, prompts, expected),
              "seconds": round(time.monotonic() - t0, 1), **info}
    if name == "restart" and recovered is not None:
        after = [o for o in load.outcomes if o.submitted >= recovered]
        result["accepted_after_restart"] = len(after)
        result["errors_after_restart"] = sum(o.kind == "error" for o in after)
    if failure:
        result["failure"] = failure
    return result


def verdict(name: str, r: dict) -> list[str]:
    """Why scenario `name` fails the run (empty: it passes)."""
    if r.get("skipped"):
        return []
    why = []
    if r.get("failure"):
        why.append(f"{name}: {r['failure']}")
    if r["lost"]:
        why.append(f"{name}: {r['lost']} request(s) lost")
    if name in ONE_WORKER_STAYS_UP and r["errors"]:
        why.append(f"{name}: {r['errors']} request(s) errored although one R-worker stayed up")
    if not r.get("failure") and not r.get("every_client_completed_after_fault"):
        why.append(f"{name}: not every client completed a request submitted after the fault")
    if name == "restart" and r.get("errors_after_restart", 0):
        why.append(f"restart: {r['errors_after_restart']} request(s) submitted after the restart errored")
    if name == "restart" and "errors_after_restart" not in r and not r.get("failure"):
        why.append("restart: the server was not restarted")
    return why


def run(settings: Settings, scenarios: list[str], run_dir: Path, log=print) -> dict:
    """The whole suite; the report chaos.json holds (report["ok"]: the run passes)."""
    unknown = [n for n in scenarios if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    prompts = [prompt_text(i) for i in range(settings.clients)]
    report = {"benchmark": "chaos", "cpu": cpu_model(), "cores": os.cpu_count(), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": {**asdict(settings), "rworkers": 2, "scenarios": scenarios,
                         "sampling": sampling(settings.max_tokens),
                         "prompts": "client i sends bench_peers.prompt_text(i), one request at a time",
                         "ports": "R-workers and tritonserver on free ports below the ephemeral range, kept "
                                  "across their restarts"},
              "scenarios": {}, "failures": []}
    t_run = time.monotonic()
    dep: Deployment | None = None
    hosts: list = []
    expected: dict[int, str] = {}
    try:
        for name in scenarios:
            if name == "netns" and not hosts:
                made, reason = netns_hosts(2)
                if not made:
                    log(f"chaos: netns: skipped ({reason})")
                    report["scenarios"][name] = {"skipped": True, "reason": reason, "accepted": 0,
                                                 "completed_correct": 0, "completed_incorrect": 0, "errors": 0,
                                                 "lost": 0, "seconds": 0.0}
                    continue
                hosts = made
                if dep is not None:
                    dep.stop()
                    dep = None
            if dep is None:
                kind = "netns" if name == "netns" else "loopback"
                log(f"chaos: starting 2 R-workers ({kind}) and tritonserver in {run_dir / kind} ...")
                t = time.monotonic()
                try:
                    dep = Deployment(settings, run_dir / kind, netns=hosts if name == "netns" else None).start()
                except Exception as e:  # noqa: BLE001 -- reported in the JSON, fails the run
                    report["failures"].append(f"{name}: the {kind} deployment did not start: {type(e).__name__}: "
                                              f"{str(e)[:2000]}")
                    break
                log(f"chaos: ready in {time.monotonic() - t:.0f} s; R-workers {', '.join(dep.fleet.addresses)}")
            if not expected:
                log(f"chaos: fault-free run of {len(prompts)} prompts ...")
                expected, summary = fault_free(dep, prompts, settings)
                report["fault_free"] = summary
                log(f"chaos: fault-free: {json.dumps(summary)}")
                if len(expected) != len(prompts):
                    report["failures"].append(f"the fault-free run did not complete every request: {summary}")
                    break
            log(f"chaos: {name}: {DESCRIPTIONS[name]}, {len(prompts)} clients ...")
            r = run_scenario(name, dep, prompts, expected, settings)
            report["scenarios"][name] = r
            keys = ("accepted", "completed_correct", "completed_incorrect", "errors", "lost", "seconds")
            log(f"chaos: {name}: " + ", ".join(f"{k} {r[k]}" for k in keys) + (f"; FAILURE {r['failure']}"
                                                                             if r.get("failure") else ""))
            report["failures"] += verdict(name, r)
    finally:
        if dep is not None:
            dep.stop()
        netns_teardown(hosts)
    report["seconds"] = round(time.monotonic() - t_run, 1)
    report["ok"] = not report["failures"]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Settings()
    p.add_argument("--model", default=d.model)
    p.add_argument("--clients", type=int, default=d.clients, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--dtype", default=d.dtype, help='model dtype parameter; "" = its default (auto)')
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, in order: {','.join(SCENARIOS)}")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s,
                   help="a request with no final response by then is lost")
    p.add_argument("--stall-s", type=float, default=d.stall_s)
    p.add_argument("--cut-s", type=float, default=d.cut_s)
    p.add_argument("--kv-capacity", default=d.kv_capacity, help="KV pool per R-worker")
    p.add_argument("--malformed-rounds", type=int, default=d.malformed_rounds)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    args = p.parse_args(argv)
    if args.clients < 1 or args.max_tokens < 1 or args.deadline_s <= 0:
        p.error("--clients, --max-tokens and --deadline-s must be positive")
    settings = Settings(model=args.model, clients=args.clients, max_tokens=args.max_tokens, dtype=args.dtype,
                        deadline_s=args.deadline_s, stall_s=args.stall_s, cut_s=args.cut_s,
                        kv_capacity=args.kv_capacity, malformed_rounds=args.malformed_rounds)
    scenarios = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        try:
            report = run(settings, scenarios, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True))
        except ValueError as e:
            p.error(str(e))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"chaos: {'PASS' if report['ok'] else 'FAIL'} in {report['seconds']:.0f} s; wrote {out}", file=sys.stderr)
    for why in report["failures"]:
        print(f"chaos: {why}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
