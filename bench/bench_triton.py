"""Throughput through Triton vs the same workload on the engine in-process (`make bench-triton`).

    python bench/bench_triton.py [--model models/smollm2-135m-instruct] [--streams 128]
                                 [--max-tokens 64] [--repeats 3] [--rworkers 0] [--out bench/results/triton.json]

Workload: `--streams` greedy requests with distinct prompts, each generating exactly
`--max-tokens` tokens (ignore_eos), all submitted at once. Tokens/s = generated tokens / wall time
from the first submission to the last final response.
  engine:  Engine(config).start(); add_request(..., on_output=...) in this process
  triton:  tritonserver with the same EngineConfig; one tritonclient gRPC stream per request
           (stream=True), all open at once on one tritonclient.grpc.aio channel
The two run one after the other (never at once: they would share the cores), `--repeats` times
each, alternating; the JSON holds the medians and triton_over_engine_throughput (target >= 0.9).

On a machine shared with other work, wall-clock tokens/s favours the side with more runnable
threads (tritonserver + stub + client get more of a contended CPU than one process), so the JSON
also gives tokens per CPU-second of all processes involved (this one, and for Triton the server
and its stub) and their ratio, triton_over_engine_cpu_efficiency.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fastdecode.config import EngineConfig  # noqa: E402


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a mountain", "bread", "a robot", "rain", "a library", "trains", "the moon"]
    return [f"Request {i}: write a short story about {topics[i % len(topics)]}." for i in range(n)]


def sampling(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def cpu_seconds(pids=()) -> float:
    """CPU time (user + system) of this process and of the processes `pids` with their children."""
    import psutil

    t = time.process_time()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                c = p.cpu_times()
                t += c.user + c.system
        except psutil.Error:
            pass
    return t


def run_engine(config: EngineConfig, texts: list[str], max_tokens: int) -> dict:
    from fastdecode.engine import Engine, SamplingParams

    engine = Engine(config)
    engine.start()
    try:
        list(engine.generate("warm up", SamplingParams.from_dict(sampling(4))))
        done = threading.Event()
        lock = threading.Lock()
        state = {"tokens": 0, "finished": 0, "first": {}}
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()

        def on_output(out):
            with lock:
                state["tokens"] += len(out.token_ids)
                state["first"].setdefault(out.request_id, time.perf_counter() - t0)
                if out.finished:
                    state["finished"] += 1
                    if state["finished"] == len(texts):
                        done.set()

        for i, text in enumerate(texts):
            engine.add_request(text, SamplingParams.from_dict(sampling(max_tokens)), request_id=f"b{i}",
                               on_output=on_output)
        if not done.wait(1800):
            raise RuntimeError("engine run did not finish in 30 minutes")
        wall = time.perf_counter() - t0
        cpu = cpu_seconds() - cpu0
    finally:
        engine.stop()
    return {"tokens": state["tokens"], "wall_s": wall, "tokens_per_s": state["tokens"] / wall, "cpu_s": cpu,
            "tokens_per_cpu_s": state["tokens"] / cpu, "ttft_median_s": statistics.median(state["first"].values())}


def run_triton(server, texts: list[str], max_tokens: int) -> dict:
    """One gRPC stream per request, all open at once (as `len(texts)` users would be), on one
    tritonclient.grpc.aio channel; each stream stays open until its final response."""
    import asyncio

    import tritonclient.grpc.aio as aioclient

    from fastdecode.ops import client

    async def one(c, text: str, request_id: str, t0: float, state: dict) -> None:
        done = asyncio.Event()

        async def requests():
            yield {"model_name": "fastdecode", "request_id": request_id, "inputs": client.build_inputs(
                text, sampling(max_tokens if request_id != "warm" else 4), extra={"return_num_output_tokens": True})}
            await done.wait()                       # half-closing early would end the stream

        async for result, error in c.stream_infer(requests(), stream_timeout=1800):
            if error is not None:
                done.set()
                raise RuntimeError(f"request {request_id} failed: {error}")
            n = result.as_numpy("num_output_tokens")
            state["tokens"] += int(n[0]) if n is not None else 0
            state["first"].setdefault(request_id, time.perf_counter() - t0)
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()
                break

    async def run() -> dict:
        c = aioclient.InferenceServerClient(server.grpc_url)
        try:
            await one(c, "warm up", "warm", time.perf_counter(), {"tokens": 0, "first": {}})
            pids = [server.proc.pid]
            state = {"tokens": 0, "first": {}}
            cpu0 = cpu_seconds(pids)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(c, text, f"b{i}", t0, state) for i, text in enumerate(texts)))
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(pids) - cpu0
        finally:
            await c.close()
        tokens = state["tokens"]
        return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu,
                "tokens_per_cpu_s": tokens / cpu, "ttft_median_s": statistics.median(state["first"].values())}

    return asyncio.run(run())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rworkers", type=int, default=0, help="local R-workers for both runs; 0 = in-process kernel")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="more EngineConfig settings")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "triton.json"))
    args = p.parse_args(argv)

    from fastdecode.ops.triton import TritonServer, write_model_repository
    from fastdecode.config import resolve_path

    params = {"model": resolve_path(args.model), "max_running": str(max(args.streams, 1))}
    params.update(dict(item.split("=", 1) for item in args.param))
    texts = prompts(args.streams)
    results = {"engine": [], "triton": []}
    with tempfile.TemporaryDirectory(prefix="bench_triton_") as tmp:
        fleet = None
        if args.rworkers:
            from fastdecode.ops.fleet import LocalFleet

            fleet = LocalFleet(args.rworkers, Path(tmp) / "rworkers", kv_capacity="2G").start()
            params["rworkers"] = ",".join(fleet.addresses)
        try:
            config = EngineConfig.from_dict({**params, "attention": "remote" if fleet else "local"})
            repo = write_model_repository(Path(tmp) / "model_repository", params)
            for rep in range(args.repeats):
                r = run_engine(config, texts, args.max_tokens)
                print(f"engine  #{rep}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tokens_per_s']:.1f} tok/s, "
                      f"{r['tokens_per_cpu_s']:.1f} tok/CPU-s", file=sys.stderr)
                results["engine"].append(r)
                with TritonServer(repo, Path(tmp) / f"triton{rep}", exit_timeout_s=5) as server:
                    r = run_triton(server, texts, args.max_tokens)
                print(f"triton  #{rep}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tokens_per_s']:.1f} tok/s, "
                      f"{r['tokens_per_cpu_s']:.1f} tok/CPU-s", file=sys.stderr)
                results["triton"].append(r)
        finally:
            if fleet is not None:
                fleet.stop()
    expected = args.streams * args.max_tokens
    for name, runs in results.items():
        for r in runs:
            if r["tokens"] != expected:
                raise SystemExit(f"{name} generated {r['tokens']} tokens, expected {expected}")
    engine_tps = statistics.median(r["tokens_per_s"] for r in results["engine"])
    triton_tps = statistics.median(r["tokens_per_s"] for r in results["triton"])
    engine_eff = statistics.median(r["tokens_per_cpu_s"] for r in results["engine"])
    triton_eff = statistics.median(r["tokens_per_cpu_s"] for r in results["triton"])
    report = {
        "benchmark": "triton", "model": args.model, "streams": args.streams, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "attention": "remote" if args.rworkers else "local", "rworkers": args.rworkers,
        "engine_tokens_per_s": round(engine_tps, 2), "triton_tokens_per_s": round(triton_tps, 2),
        "triton_over_engine_throughput": round(triton_tps / engine_tps, 4), "target": 0.9,
        "engine_tokens_per_cpu_s": round(engine_eff, 2), "triton_tokens_per_cpu_s": round(triton_eff, 2),
        "triton_over_engine_cpu_efficiency": round(triton_eff / engine_eff, 4),
        "load_average_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "engine_ttft_median_s": round(statistics.median(r["ttft_median_s"] for r in results["engine"]), 4),
        "triton_ttft_median_s": round(statistics.median(r["ttft_median_s"] for r in results["triton"]), 4),
        "runs": results, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"engine {engine_tps:.1f} tok/s, triton {triton_tps:.1f} tok/s, "
          f"triton/engine = {triton_tps / engine_tps:.3f} (target >= 0.9); per CPU-second: engine {engine_eff:.1f}, "
          f"triton {triton_eff:.1f}, ratio {triton_eff / engine_eff:.3f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
