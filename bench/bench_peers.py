"""Tokens/s as a client sees them: fastdecode through Triton against the systems people run instead.

    make bench-peers                  # every peer, batches 1..512 at 128 tokens, 1..128 at 1024
    python bench/bench_peers.py --peers triton,hf --batches 32 --seq-lens 128 --out /tmp/p.json

One workload for every peer, run one after the other on this machine (never at once): B
requests submitted together; request i is the text f"Request {i}: write a short story about
{topic}." (no chat template), greedy, ignore_eos, and generates exactly seq_len - len(prompt)
tokens. tokens/s = generated tokens / wall time from the first submission to the last final
output. Every streamed output is timestamped: TTFT per request, and the gap between outputs
(split evenly over the tokens an output carries) as the inter-token latency (ITL).

  triton  `make serve`'s deployment at its defaults (tritonserver, the fastdecode model), one
          tritonclient gRPC stream per request, all open at once on one aio channel
  engine  the same EngineConfig in this process (what Triton costs)
  hf      transformers generate() at its faster dtype here (probed), all cores, left padding
  vllm    vLLM's CPU build at its defaults in its own venv (bench/peers_vllm.py, `make vllm-venv`)

A peer whose run takes longer than --run-timeout-s, or fails, stops there: larger batches are
not tried for it, and the JSON says why. Writes bench/results/peers.json (ratios, CPU model,
memory bandwidth, commit) and peers.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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


# ---- peers: each runs the batches in order and stops at the first failure or timeout

def run_triton(server, work: list[tuple[str, int]], seq_len: int) -> dict:
    import tritonclient.grpc.aio as aioclient

    from fastdecode.client import build_inputs

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


def sweep(name: str, plan: list[tuple[int, int]], run_one, timeout_s: float) -> list[dict]:
    """Run (seq_len, batch) in order; a seq_len stops at its first error or over-long run."""
    rows, stopped = [], set()
    for seq_len, batch in plan:
        if seq_len in stopped:
            continue
        t = time.perf_counter()
        try:
            row = run_one(seq_len, batch)
        except Exception as e:  # noqa: BLE001 -- recorded: why this peer stopped growing
            row = {"batch": batch, "seq_len": seq_len, "error": f"{type(e).__name__}: {e}"}
        took = time.perf_counter() - t
        if "error" not in row and took > timeout_s:
            row["stopped"] = f"this run took {took:.0f} s > --run-timeout-s {timeout_s:.0f}: no larger batch"
        if "error" in row or "stopped" in row:
            stopped.add(seq_len)
        rows.append(row)
        print(f"{name:6s} L{seq_len:<5d} B{batch:<5d} " + (row.get("error") or
              f"{row['tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.3f} s  ITL p50 "
              f"{row['itl_p50_s'] * 1e3:.1f} ms p99 {row['itl_p99_s'] * 1e3:.1f} ms"), flush=True)
    return rows


# ---- the machine

def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2")))
    return []


def stream_gbps() -> float:
    from fastdecode import _kernels

    buf = _kernels.StreamBuffer(1 << 30, hugepages=True)
    return round(statistics.median(buf.read(os.cpu_count() or 1) for _ in range(5)), 1)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--peers", default="triton,engine,hf,vllm")
    p.add_argument("--seq-lens", default="128,1024")
    p.add_argument("--batches", default="1,8,32,128,512", help="at the shortest sequence length")
    p.add_argument("--long-batches", default="1,8,32,128", help="at the other sequence lengths")
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--hf-dtype", default="", help="float32 | bfloat16; default: the faster in a probe")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="EngineConfig setting for triton and engine (default: none, as `make serve`)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "peers.json"))
    a = p.parse_args(argv)
    peers = a.peers.split(",")
    seq_lens = sorted(int(s) for s in a.seq_lens.split(","))
    plan = [(seq_lens[0], int(b)) for b in a.batches.split(",")]
    plan += [(s, int(b)) for s in seq_lens[1:] for b in a.long_batches.split(",")]

    import torch
    from transformers import AutoTokenizer

    from fastdecode.config import EngineConfig
    from python_backend.config import resolve_path

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
                          "ignore_eos, seq_len - prompt tokens new tokens each", "peers": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report.update(ratios(report["peers"], seq_lens[0]))
        out.write_text(json.dumps(report, indent=1) + "\n")

    def work(seq_len, batch):
        return workload(tokenizer, batch, seq_len)

    for peer in peers:
        if peer == "triton":
            from fastdecode.serve import TritonServer, write_model_repository

            with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
                repo = write_model_repository(Path(tmp) / "model_repository", params)
                with TritonServer(repo, Path(tmp) / "triton", exit_timeout_s=10) as server:
                    run_triton(server, work(seq_lens[0], 2), seq_lens[0])               # warm up
                    rows = sweep(peer, plan, lambda s, b: run_triton(server, work(s, b), s), a.run_timeout_s)
            report["peers"]["triton"] = {"config": "make serve's defaults", "rows": rows}
        elif peer == "engine":
            from fastdecode.engine import Engine

            engine = Engine(config)
            engine.start()
            try:
                run_engine(engine, work(seq_lens[0], 2), seq_lens[0])
                rows = sweep(peer, plan, lambda s, b: run_engine(engine, work(s, b), s), a.run_timeout_s)
            finally:
                engine.stop()
            report["peers"]["engine"] = {"config": "the same EngineConfig in-process", "dtype": config.dtype,
                                         "rows": rows}
        elif peer == "hf":
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            probe = {}
            if a.hf_dtype:
                dtype = a.hf_dtype
            else:
                for dt in ("float32", "bfloat16"):
                    model, tok = hf_model(model_dir, dt)
                    run_hf(model, tok, work(seq_lens[0], 2)[:2], 24)
                    probe[dt] = run_hf(model, tok, work(seq_lens[0], 32), 48)["tokens_per_s"]
                    del model
                dtype = max(probe, key=probe.get)
            model, tok = hf_model(model_dir, dtype)
            run_hf(model, tok, work(seq_lens[0], 2), 24)
            rows = sweep(peer, plan, lambda s, b: run_hf(model, tok, work(s, b), s), a.run_timeout_s)
            del model
            report["peers"]["hf"] = {"dtype": dtype, "probe_b32_tokens_per_s": probe,
                                     "threads": torch.get_num_threads(), "rows": rows}
        elif peer == "vllm":
            report["peers"]["vllm"] = run_vllm(model_dir, plan, a.run_timeout_s)
        else:
            raise SystemExit(f"unknown peer {peer!r}")
        save()
    plot(report, out.with_suffix(".png"), seq_lens)
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("triton_over", "openai"))}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def run_vllm(model_dir: str, plan: list[tuple[int, int]], timeout_s: float) -> dict:
    if not VLLM_PYTHON.exists():
        return {"error": f"{VLLM_PYTHON} missing: run `make vllm-venv`", "rows": []}
    rows, info = [], {}
    for seq_len in sorted({s for s, _ in plan}):
        batches = ",".join(str(b) for s, b in plan if s == seq_len)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [str(VLLM_PYTHON), str(REPO / "bench" / "peers_vllm.py"), "--model", model_dir, "--batches",
                   batches, "--seq-len", str(seq_len), "--out", f.name, "--timeout-s", str(int(timeout_s)),
                   "--threads", str(len(os.sched_getaffinity(0)))]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                rows.append({"seq_len": seq_len, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"})
                continue
            result = json.loads(Path(f.name).read_text())
        info = {k: v for k, v in result.items() if k != "results"}
        for row in result["results"]:
            rows.append(row)
            print(f"vllm   L{seq_len:<5d} B{row['batch']:<5d} " + (row.get("error") or
                  f"{row['tokens_per_s']:8.1f} tok/s  ITL p50 {row['itl_p50_s'] * 1e3:.1f} ms"), flush=True)
    return {**info, "rows": rows}


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
            b = [r["batch"] for r in rows]
            row_axes[0].plot(b, [r["tokens_per_s"] for r in rows], "o-", label=name)
            row_axes[1].plot(b, [r["itl_p50_s"] * 1e3 for r in rows], "o-", label=f"{name} p50")
            row_axes[1].plot(b, [r["itl_p99_s"] * 1e3 for r in rows], "x:", label=f"{name} p99")
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
