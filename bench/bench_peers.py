"""Tokens/s as a client sees them: fastdecode through Triton against the systems people run instead.

    make bench-peers                  # every peer, batches 1..512 then doubling at 128 tokens, 1..32 at 1024
    python bench/bench_peers.py --peers triton,hf --batches 32 --seq-lens 128 --out /tmp/p.json

One workload for every peer, run one after the other on this machine (never at once): B
requests submitted together; request i is the text f"Request {i}: write a short story about
{topic}." (no chat template), greedy, ignore_eos, and generates exactly seq_len - len(prompt)
tokens. tokens/s = generated tokens / wall time from the first submission to the last final
output. Every streamed output is timestamped: TTFT per request, and the gap between outputs
(split evenly over the tokens an output carries) as the inter-token latency (ITL).

  triton  `make serve`'s deployment at its defaults (tritonserver, the fastdecode model), one
          tritonclient gRPC stream per request, all open at once on one aio channel
  openai  the same Triton behind the OpenAI-compatible frontend (openai_frontend), one streamed
          /v1/completions request per request over httpx, at --openai-batches only
  engine  the same EngineConfig in this process (what Triton costs)
  hf      transformers generate() at its faster dtype here (probed), all cores, left padding
  vllm    vLLM's CPU build at its defaults in its own venv (bench/peers_vllm.py, `make vllm-venv`)

The peers stay up, idle, for the whole run, and each (seq_len, batch) runs on every peer in turn:
this VM's speed drifts by up to 1.5x over minutes, and peers compared at one batch are then
measured minutes apart at most. At the shortest length, batches up to --repeat-up-to (128) run
--repeats (3) rounds of every peer in turn, and each peer's row is its median run (its row lists
every run's tokens/s): one run at 32 moves by a quarter here. A peer whose run takes longer than
--run-timeout-s, or fails, stops growing its batch at that length. With --grow-to (make bench-peers: 4096), past the last
of --batches at the shortest length, each peer's batch doubles until a run fails, takes too
long, or adds under 5% tokens/s over the batch before: the largest batch each peer reached, and
why it stopped there, go in the JSON (`largest`). Writes bench/results/peers.json (ratios, CPU
model, memory bandwidth, commit) and peers.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOPICS = ["the sea", "a mountain", "bread", "a robot", "rain", "a library", "trains", "the moon"]
VLLM_PYTHON = REPO / "build" / "vllm-venv" / "bin" / "python"
COLORS = {"triton": "tab:blue", "openai": "tab:purple", "engine": "tab:cyan", "hf": "tab:green", "vllm": "tab:red"}


def prompt_text(i: int) -> str:
    return f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}."


class Timeline:
    """Streamed outputs of one run: per request, (time, new tokens) from submission at t0."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: dict[str, list[tuple[float, int]]] = {}
        self.lock = threading.Lock()

    def add(self, request: str, tokens: int) -> None:
        with self.lock:
            self.events.setdefault(request, []).append((time.perf_counter() - self.t0, tokens))

    def summary(self, batch: int, seq_len: int) -> dict:
        ttft, itl, tokens, end = [], [], 0, 0.0
        for ev in self.events.values():
            first = next((t for t, n in ev if n), None)
            if first is not None:
                ttft.append(first)
            prev = None
            for t, n in ev:
                tokens += n
                if n and prev is not None:
                    itl += [(t - prev) / n] * n
                if n:
                    prev = t
            end = max(end, ev[-1][0])
        return {"batch": batch, "seq_len": seq_len, "tokens": tokens, "wall_s": end,
                "tokens_per_s": tokens / end if end else 0.0, **latency(ttft, itl)}


def latency(ttft: list[float], itl: list[float]) -> dict:
    import numpy as np

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 5) if xs else None
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50),
            "itl_p99_s": pct(itl, 99)}


def workload(tokenizer, batch: int, seq_len: int) -> list[tuple[str, int]]:
    """(prompt text, new tokens) per request."""
    texts = [prompt_text(i) for i in range(batch)]
    return [(t, seq_len - len(tokenizer(t)["input_ids"])) for t in texts]


# ---- one run of one peer

def run_triton(server, work: list[tuple[str, int]], seq_len: int) -> dict:
    import tritonclient.grpc.aio as aioclient

    from fastdecode.ops.client import build_inputs

    async def one(c, i: int, text: str, new: int, line: Timeline) -> None:
        done = asyncio.Event()

        async def requests():
            yield {"model_name": "fastdecode", "request_id": f"r{i}", "inputs": build_inputs(
                text, {"max_tokens": new, "temperature": 0.0, "ignore_eos": True},
                extra={"return_num_output_tokens": True})}
            await done.wait()

        async for result, error in c.stream_infer(requests(), stream_timeout=3600):
            if error is not None:
                done.set()
                raise RuntimeError(f"request {i} failed: {error}")
            n = result.as_numpy("num_output_tokens")
            line.add(f"r{i}", int(n[0]) if n is not None else 0)
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()
                return

    async def run() -> dict:
        c = aioclient.InferenceServerClient(server.grpc_url)
        try:
            line = Timeline()
            await asyncio.gather(*(one(c, i, text, new, line) for i, (text, new) in enumerate(work)))
        finally:
            await c.close()
        return line.summary(len(work), seq_len)

    return asyncio.run(run())


def run_openai(url: str, model: str, work: list[tuple[str, int]], seq_len: int) -> dict:
    """Streamed /v1/completions with the usage so far on every chunk (`continuous_usage_stats`):
    a chunk counts the tokens its usage added, so that a chunk of several tokens spreads its gap
    over them as a Triton response does."""
    import httpx

    async def one(c, i: int, text: str, new: int, line: Timeline) -> None:
        body = {"model": model, "prompt": text, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        counted = 0
        async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for raw in r.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                usage = json.loads(raw[6:]).get("usage")
                if usage and usage["completion_tokens"] > counted:
                    line.add(f"r{i}", usage["completion_tokens"] - counted)
                    counted = usage["completion_tokens"]

    async def run() -> dict:
        limits = httpx.Limits(max_connections=len(work) + 8, max_keepalive_connections=len(work) + 8)
        key = os.environ.get("FASTDECODE_API_KEY")       # the frontend started beside Triton wants it too
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits, headers=headers) as c:
            line = Timeline()
            await asyncio.gather(*(one(c, i, text, new, line) for i, (text, new) in enumerate(work)))
        return line.summary(len(work), seq_len)

    return asyncio.run(run())


def run_engine(engine, work: list[tuple[str, int]], seq_len: int) -> dict:
    from fastdecode.engine import SamplingParams

    line, done, left = Timeline(), threading.Event(), [len(work)]

    def on_output(out):
        line.add(out.request_id, len(out.token_ids))
        if out.finished:
            with line.lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    for i, (text, new) in enumerate(work):
        engine.add_request(text, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
                           request_id=f"r{i}", on_output=on_output)
    done.wait()
    return line.summary(len(work), seq_len)


class HFStreamer:
    """generate()'s streamer: put() is called with the prompt, then with each step's tokens."""

    def __init__(self, line: Timeline, new: list[int]) -> None:
        self.line, self.new, self.step = line, new, -1

    def put(self, value) -> None:
        self.step += 1
        if self.step:
            for i, n in enumerate(self.new):
                if self.step <= n:
                    self.line.add(f"r{i}", 1)

    def end(self) -> None:
        pass


def run_hf(model, tokenizer, work: list[tuple[str, int]], seq_len: int) -> dict:
    import torch

    enc = tokenizer([t for t, _ in work], return_tensors="pt", padding=True)
    new = [n for _, n in work]
    line = Timeline()
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=max(new), min_new_tokens=max(new), do_sample=False,
                       pad_token_id=tokenizer.pad_token_id, streamer=HFStreamer(line, new))
    return line.summary(len(work), seq_len)


def hf_model(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return model, tok


# ---- the machine

def cpu_model() -> str:
    """The model name, with family/model/stepping (a VM may show only "AMD EPYC")."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name = info.get("model name") or platform.processor() or platform.machine()
    return f"{name} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}, " \
           f"stepping {info.get('stepping', '?')})"


def cpu_flags() -> list[str]:
    from fastdecode.model.dtype_choice import cpu_flags as all_flags

    return sorted(f for f in all_flags() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))


def stream_gbps() -> float:
    from rpart import _kernels

    buf = _kernels.StreamBuffer(1 << 30, hugepages=True)
    return round(statistics.median(buf.read(os.cpu_count() or 1) for _ in range(5)), 1)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- the peers: each stays up for the whole run, and runs one (seq_len, batch) at a time

class TritonPeer:
    name = "triton"

    def __init__(self, params: dict, tmp: Path) -> None:
        from fastdecode.ops.triton import TritonServer, write_model_repository

        repo = write_model_repository(tmp / "model_repository", params)
        self.server = TritonServer(repo, tmp / "triton", exit_timeout_s=10).__enter__()
        self.info = {"config": "make serve's defaults", "engine_log": engine_log_line(self.server.log_path)}

    def run(self, work, seq_len):
        return run_triton(self.server, work, seq_len)

    def close(self):
        self.server.__exit__(None, None, None)


def engine_log_line(log_path: Path) -> str:
    """The model's own line on what it runs (device, threads, dtype and why)."""
    from fastdecode.ops.procs import log_lines

    return next((line.split("] ", 1)[-1] for line in log_lines(log_path) or [] if "fastdecode: engine on" in line), "")


class OpenAIPeer:
    name = "openai"

    def __init__(self, triton: TritonPeer | None, model_dir: str, tmp: Path, batches: set[int]) -> None:
        from fastdecode.ops.procs import free_port
        from fastdecode.ops import openai_process

        if triton is None:
            raise RuntimeError("the openai peer runs in front of the triton peer: list triton before it")
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.batches, self.model = tmp, batches, Path(model_dir).name
        self.url = openai_process.start(tmp, triton.server.grpc_url, model_dir, "127.0.0.1", free_port())
        self.info = {"config": "the triton peer behind openai_frontend, streamed /v1/completions over httpx"}

    def runs(self, seq_len: int, batch: int, shortest: int) -> bool:
        return seq_len == shortest and batch in self.batches

    def run(self, work, seq_len):
        return run_openai(self.url, self.model, work, seq_len)

    def close(self):
        from fastdecode.ops import openai_process

        openai_process.stop(self.tmp)


class EnginePeer:
    """A fresh Engine per run, stopped after it: its loop thread's OpenMP pool must not outlive the
    run, or the HF peer in this process would run beside it with more OpenMP threads than cores
    (see fastdecode.engine.engine.on_a_thread_of_its_own)."""
    name = "engine"

    def __init__(self, config) -> None:
        self.config = config
        self.info = {"config": "the same EngineConfig in-process, a fresh Engine per run"}

    def run(self, work, seq_len):
        from fastdecode.engine import Engine

        engine = Engine(self.config)
        self.info["dtype"] = engine.dtype_choice
        engine.start()
        try:
            return {**run_engine(engine, work, seq_len), "dtype": engine.dtype}
        finally:
            engine.stop()

    def close(self):
        pass


class HFPeer:
    """transformers generate(); loading and every run on a thread that ends with it, so that this
    process's main thread never holds an OpenMP pool (the engine peer's runs go alike)."""
    name = "hf"

    def __init__(self, model_dir: str, dtype: str, probe_work) -> None:
        import torch

        from fastdecode.engine.engine import on_a_thread_of_its_own

        self.on_thread = on_a_thread_of_its_own
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        probe = {}
        if not dtype:
            for dt in ("float32", "bfloat16"):
                model, tok = self.on_thread(hf_model, model_dir, dt)
                self.on_thread(run_hf, model, tok, probe_work[:2], 0)
                probe[dt] = self.on_thread(run_hf, model, tok, probe_work, 0)["tokens_per_s"]
                del model
            dtype = max(probe, key=probe.get)
        self.model, self.tok = self.on_thread(hf_model, model_dir, dtype)
        self.info = {"dtype": dtype, "probe_b32_tokens_per_s": probe, "threads": torch.get_num_threads()}

    def run(self, work, seq_len):
        return self.on_thread(run_hf, self.model, self.tok, work, seq_len)

    def close(self):
        del self.model


class VLLMPeer:
    """bench/peers_vllm.py --serve in vLLM's venv: one JSON line in per batch, one row out. Between
    its runs its processes are stopped (SIGSTOP): idle, vLLM's workers poll their queues and would
    take the cores from the peer being measured."""
    name = "vllm"
    MARK = "PEERS_VLLM "

    def __init__(self, model_dir: str, timeout_s: float) -> None:
        if not VLLM_PYTHON.exists():
            raise RuntimeError(f"{VLLM_PYTHON} missing: run `make vllm-venv`")
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(REPO / "bench" / "peers_vllm.py"), "--serve",
                                      "--model", model_dir, "--timeout-s", str(int(timeout_s)),
                                      "--threads", str(len(os.sched_getaffinity(0)))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.info = {k: v for k, v in self._reply().items() if k not in ("ready", "results")}
        self._signal(signal.SIGSTOP)

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                return json.loads(line[len(self.MARK):])
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}) without an answer")

    def run(self, work, seq_len):
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"batch": len(work), "seq_len": seq_len}) + "\n")
            self.proc.stdin.flush()
            row = self._reply()
        finally:
            self._signal(signal.SIGSTOP)
        if "error" in row:
            raise RuntimeError(row["error"])
        return row

    def close(self):
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def timed_run(peer, work, seq_len: int, batch: int, timeout_s: float) -> dict:
    """One run; a failure or an over-long run is recorded and ends this peer's batches at seq_len."""
    t = time.perf_counter()
    try:
        row = peer.run(work, seq_len)
    except Exception as e:  # noqa: BLE001 -- recorded: why this peer stopped growing
        row = {"batch": batch, "seq_len": seq_len, "error": f"{type(e).__name__}: {e}"}
    took = time.perf_counter() - t
    if "error" not in row and took > timeout_s:
        row["stopped"] = f"this run took {took:.0f} s > --run-timeout-s {timeout_s:.0f}: no larger batch"
    print(f"{peer.name:6s} L{seq_len:<5d} B{batch:<5d} " + (row.get("error") or
          f"{row['tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.3f} s  ITL p50 "
          f"{row['itl_p50_s'] * 1e3:.1f} ms p99 {row['itl_p99_s'] * 1e3:.1f} ms"), flush=True)
    return row


GROWTH_MIN = 1.05    # a doubling of the batch that adds less tokens/s than this factor ends the growth


def run_stop(row: dict) -> str | None:
    """Why no larger batch runs after `row` at its length, whether the batch grows or not: it failed
    or took too long (None: neither)."""
    if "error" in row:
        return f"batch {row['batch']} failed: {row['error']}"
    return row.get("stopped")


def growth_stop(prev: dict | None, row: dict, grow_to: int) -> str | None:
    """Why a peer's batch stops doubling after `row` (None: it goes on). prev: its row at half the batch."""
    if (why := run_stop(row)) is not None:
        return why
    if prev is not None and "error" not in prev and row["tokens_per_s"] < GROWTH_MIN * prev["tokens_per_s"]:
        return (f"{row['tokens_per_s']:.0f} tok/s at batch {row['batch']} is under {GROWTH_MIN}x the "
                f"{prev['tokens_per_s']:.0f} at {prev['batch']}: a larger batch adds nothing")
    if row["batch"] * 2 > grow_to:
        return f"batch {row['batch'] * 2} would pass --grow-to {grow_to}"
    return None


def largest(rows: list[dict], seq_len: int, why: str) -> dict:
    """The largest batch a peer completed at seq_len, and why it went no further."""
    done = [r["batch"] for r in rows if r.get("seq_len") == seq_len and "error" not in r]
    return {"batch": max(done, default=None), "why": why}


def median_run(runs: list[dict]) -> dict:
    """One row for repeated runs of a peer at one (seq_len, batch): the run of median tokens/s (the
    lower of the two middle ones for an even count), with every run's tokens/s beside it; the first
    failed or over-long run instead, as no repeat runs after it."""
    bad = next((r for r in runs if run_stop(r) is not None), None)
    if bad is not None or len(runs) == 1:
        return bad or runs[0]
    tps = [r["tokens_per_s"] for r in runs]
    middle = statistics.median_low(tps)
    return {**runs[tps.index(middle)], "repeats_tokens_per_s": [round(t, 3) for t in tps]}


def run_plan(live: list, report: dict, plan: list[tuple[int, int]], grow_to: int, timeout_s: float,
             work, save, repeats: int = 1, repeat_up_to: int = 0) -> None:
    """Run every (seq_len, batch) of the plan on each live peer in turn. At the shortest length, a
    batch up to `repeat_up_to` runs `repeats` rounds of every peer in turn, and each peer's row is
    its median run (median_run). After the plan's last batch at the shortest length, each peer's
    batch doubles until growth_stop says why not; a peer whose run fails or takes too long stops at
    that length anyway. Records each peer's `largest` per length."""
    seq_lens = sorted({L for L, _ in plan})
    last = max(b for L, b in plan if L == seq_lens[0])
    stopped: dict[tuple[str, int], str] = {}     # (peer, seq_len) -> why its batch grows no more

    def runs(peer, seq_len: int, batch: int) -> bool:
        return (peer.name, seq_len) not in stopped and (
            not hasattr(peer, "runs") or peer.runs(seq_len, batch, seq_lens[0]))

    def run_all(seq_len: int, batch: int, growing: bool) -> None:
        rounds = repeats if seq_len == seq_lens[0] and batch <= repeat_up_to else 1
        done: dict[str, list[dict]] = {}
        for _ in range(rounds):
            for peer in live:
                if not runs(peer, seq_len, batch) or any(run_stop(r) for r in done.get(peer.name, [])):
                    continue
                done.setdefault(peer.name, []).append(timed_run(peer, work(seq_len, batch), seq_len, batch,
                                                                timeout_s))
        for peer in live:
            if peer.name not in done:
                continue
            rows = report["peers"][peer.name]["rows"]
            prev = next((r for r in rows if r.get("seq_len") == seq_len and r["batch"] == batch // 2), None)
            row = median_run(done[peer.name])
            rows.append(row)
            why = growth_stop(prev, row, grow_to) if growing else run_stop(row)
            if why is not None:
                stopped[(peer.name, seq_len)] = why
        report.update(ratios(report["peers"], seq_lens[0]))
        save()

    for seq_len, batch in plan:
        run_all(seq_len, batch, growing=False)
        if (seq_len, batch) == (seq_lens[0], last):
            while batch * 2 <= grow_to and any(runs(peer, seq_len, batch * 2) for peer in live):
                batch *= 2
                run_all(seq_len, batch, growing=True)

    def unstopped(peer, seq_len: int) -> str:      # the plan ended before the peer did
        if hasattr(peer, "runs"):
            return "the last batch this peer is given (--openai-batches)"
        if seq_len != seq_lens[0]:
            return "the last of --long-batches"
        return f"the last of --batches; --grow-to {grow_to} allows no doubling"

    for peer in live:
        info = report["peers"][peer.name]
        info["largest"] = {str(L): largest(info["rows"], L, stopped.get((peer.name, L)) or unstopped(peer, L))
                           for L in seq_lens}
    save()


# ---- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--peers", default="triton,openai,engine,hf,vllm")
    p.add_argument("--openai-batches", default="32,128", help="the openai peer's batches (shortest length)")
    p.add_argument("--seq-lens", default="128,1024")
    p.add_argument("--batches", default="1,8,32,128,512", help="at the shortest sequence length")
    p.add_argument("--long-batches", default="1,8,32", help="at the other sequence lengths")
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--grow-to", type=int, default=0,
                   help="past the last of --batches, double each peer's batch up to this (0: no growth; "
                        "make bench-peers: 4096)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of every peer at each batch up to --repeat-up-to (shortest length); "
                        "each peer's row is its median run")
    p.add_argument("--repeat-up-to", type=int, default=128, help="the largest batch that is repeated")
    p.add_argument("--hf-dtype", default="", help="float32 | bfloat16; default: the faster in a probe")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="EngineConfig setting for triton and engine (default: none, as `make serve`)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "peers.json"))
    a = p.parse_args(argv)
    try:
        seq_lens = sorted({int(s) for s in a.seq_lens.split(",")})
        batches = [int(b) for b in a.batches.split(",")]
        long_batches = [int(b) for b in a.long_batches.split(",")]
        openai_batches = {int(b) for b in a.openai_batches.split(",") if b}
    except ValueError as e:
        p.error(f"--seq-lens, --batches, --long-batches and --openai-batches are comma-separated integers ({e})")
    if min([*seq_lens, *batches, *long_batches, *openai_batches]) < 1:
        p.error("sequence lengths and batches must be >= 1")
    if a.grow_to < 0:
        p.error(f"--grow-to must be >= 0, got {a.grow_to}")
    if a.repeats < 1 or a.repeat_up_to < 0:
        p.error(f"--repeats must be >= 1 and --repeat-up-to >= 0, got {a.repeats} and {a.repeat_up_to}")
    plan = [(seq_lens[0], b) for b in batches]
    plan += [(s, b) for s in seq_lens[1:] for b in long_batches]

    from transformers import AutoTokenizer

    from fastdecode.config import EngineConfig
    from fastdecode.config import resolve_path

    model_dir = resolve_path(a.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = {"model": model_dir, **dict(kv.split("=", 1) for kv in a.param)}
    config = EngineConfig.from_dict(params)
    report = {"benchmark": "peers", "model": a.model, "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
              "cores": len(os.sched_getaffinity(0)), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
                                                                          os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
              "stream_read_gbps": stream_gbps(), "commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "engine_config": {k: v for k, v in vars(config).items() if k != "rworker_token"},
              "workload": "B requests at once; 'Request i: write a short story about <topic>.'; greedy, "
                          "ignore_eos, seq_len - prompt tokens new tokens each",
              "order": "per (seq_len, batch), every peer in turn (all stay up, idle, between their runs); "
                       f"{a.repeats} rounds of that at the shortest length up to batch {a.repeat_up_to}, "
                       "each peer's row its median run",
              "peers": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def work(seq_len, batch):
        return workload(tokenizer, batch, seq_len)

    def triton_peer():
        return next((peer for peer in peers if peer.name == "triton"), None)

    makers = {"triton": lambda tmp: TritonPeer(params, tmp), "engine": lambda tmp: EnginePeer(config),
              "openai": lambda tmp: OpenAIPeer(triton_peer(), model_dir, tmp, openai_batches),
              "hf": lambda tmp: HFPeer(model_dir, a.hf_dtype, work(48, 32)),
              "vllm": lambda tmp: VLLMPeer(model_dir, a.run_timeout_s)}
    peers = []
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        try:
            for name in a.peers.split(","):
                if name not in makers:
                    raise SystemExit(f"unknown peer {name!r}")
                try:
                    peer = makers[name](Path(tmp) / name)
                    peers.append(peer)
                    peer.run(work(seq_lens[0], 2), seq_lens[0])                      # warm up
                except Exception as e:  # noqa: BLE001 -- recorded; the other peers still run
                    report["peers"][name] = {"error": f"{type(e).__name__}: {e}", "rows": []}
                    print(f"{name}: could not start: {e}", flush=True)
                    continue
                report["peers"][name] = {**peer.info, "rows": []}
            live = [peer for peer in peers if "error" not in report["peers"][peer.name]]
            run_plan(live, report, plan, a.grow_to, a.run_timeout_s, work,
                     save=lambda: out.write_text(json.dumps(report, indent=1) + "\n"),
                     repeats=a.repeats, repeat_up_to=a.repeat_up_to)
        finally:
            for peer in peers:
                peer.close()
    plot(report, out.with_suffix(".png"), seq_lens)
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("triton_over", "openai_over"))}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def ratios(peers: dict, seq_len: int) -> dict:
    def tps(peer: str, batch: int | None = None) -> float | None:
        rows = [r for r in peers.get(peer, {}).get("rows", [])
                if r.get("seq_len") == seq_len and "error" not in r and (batch is None or r["batch"] == batch)]
        return max((r["tokens_per_s"] for r in rows), default=None)

    out = {}
    for b in (1, 8, 32, 128, 512):
        t, h = tps("triton", b), tps("hf", b)
        if t and h:
            out[f"triton_over_hf_b{b}"] = round(t / h, 3)
        v = tps("vllm", b)
        if t and v:
            out[f"triton_over_vllm_b{b}"] = round(t / v, 3)
    t, v, e = tps("triton"), tps("vllm"), tps("engine", 128)
    if t and v:
        out["triton_over_vllm_best"] = round(t / v, 3)
    if tps("triton", 128) and e:
        out["triton_over_engine_b128"] = round(tps("triton", 128) / e, 3)
    for b in (32, 128):
        if tps("openai", b) and tps("triton", b):
            out[f"openai_over_triton_b{b}"] = round(tps("openai", b) / tps("triton", b), 3)
    return out


def plot(report: dict, path: Path, seq_lens: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(seq_lens), 2, figsize=(11, 4 * len(seq_lens)), squeeze=False)
    for row_axes, seq_len in zip(axes, seq_lens):
        for name, peer in report["peers"].items():
            rows = [r for r in peer.get("rows", []) if r.get("seq_len") == seq_len and "error" not in r]
            if not rows:
                continue
            b, color = [r["batch"] for r in rows], COLORS.get(name)
            row_axes[0].plot(b, [r["tokens_per_s"] for r in rows], "o-", color=color, label=name)
            row_axes[1].plot(b, [r["itl_p50_s"] * 1e3 for r in rows], "o-", color=color, label=f"{name} p50")
            row_axes[1].plot(b, [r["itl_p99_s"] * 1e3 for r in rows], "x:", color=color, label=f"{name} p99")
        for ax, what in zip(row_axes, ("tokens/s", "inter-token latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(what)
            ax.set_title(f"{what}, sequence length {seq_len}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        row_axes[1].set_yscale("log")
    fig.suptitle(f"{report['model']} on {report['cpu_model']}, {report['cores']} cores "
                 f"(STREAM {report['stream_read_gbps']} GB/s), {report['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
