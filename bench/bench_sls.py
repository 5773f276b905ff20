"""SLS versus FCFS on the real engine (the paper's Figure 11, docs/design.md), and the perf model checked
against measured step times.

    make bench-sls          # or: python bench/bench_sls.py [--quick] [--configs default rheavy 7b] [--repeats N]

For each configuration: the same workload (2*B + 1 requests of `prompt` tokens generating
exactly `gen` tokens, ignore_eos, all queued at once) runs under fcfs and under sls, on two
engines stepped in turn (background load on this shared 2-core machine hits both alike;
each engine has its own R-workers). From the per-step traces:
  - steady state: the steps after the first `gen` (ramp-up) while requests are still
    queued (the system is saturated), cut to the same length for both policies. FCFS's
    cohort grows together, SLS's micro-batches are staggered;
  - steady_max_step_latency_ratio = sls / fcfs of the steady max step latency, robust to
    the noise of this shared machine: the median FCFS step time over its steady decode
    steps at >= 90% of its peak context, at least its 32 highest-context steps (its
    load-bound slowest steps), against the median
    of the SLS steps run right beside those (the engines alternate steps; SLS's context is
    flat near its peak). Beside it: the unpaired version (each policy's median at >= 90% of
    its own peak context), and the raw max, p99 and max-of-rolling-median ratios;
  - throughput_ratio = steady tokens/s (sls) / steady tokens/s (fcfs).
Then the perf model (fastdecode.perfmodel: T(B), H(B) from micro-benchmarks of the model's
layer code, R through the same backend) predicts the step time of engine decode steps at
B in {32, 128, 512}, as `plan` predicts it (pipelined: max(S, R) per layer); model_error_max =
max |predicted - measured| / measured (medians) over every configuration, model_error_max_serial
for the serial sum S + R, and model_error_max_floor for the fastest repeats on both sides.

Configurations:
  default  models/smollm2-135m-instruct, the remote backend with 2 local R-workers (1 kernel
           thread each) when rworker is available, else the in-process backend (recorded).
  rheavy   a random 2-layer Llama with hidden 256 (4 heads of 64) on the in-process kernel (one
           thread beside the S-Part's one): R-Part time grows with the context as in the paper
           (R-workers > 75% busy), where the remote backend on this loaded 2-core machine spends
           most of each call in gRPC. Its S-Part is cheap next to its R-Part, the balance a GPU
           S-worker has (docs/design.md) but this CPU-only machine cannot give the default model at
           lengths a 10-minute run affords.
  7b       Llama-7B layer shapes (hidden 4096, 32 heads, 11008 MLP), 2 layers, random weights:
           perf model + model check at one batch, if memory allows.
S-Part torch threads: 1 (the other core is the R-workers'); recorded in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdecode.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from fastdecode.perf_measure import build_perf_model  # noqa: E402
from fastdecode.perfmodel import PerfModel, floor_model  # noqa: E402
from fastdecode.trace import summarize  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SMOOTH = 9              # steps of the rolling median in the plot and the secondary max
PEAK_FRACTION = 0.9     # steady max = median step time at >= 90% of the peak context
MIN_PAIRS = 32          # ... or over the 32 highest-context steps when that is more
PAPER = {"steady_max_step_latency_ratio": [0.66, 0.70], "throughput_gain": [0.08, 0.11]}
TARGETS = {"steady_max_step_latency_ratio": 0.75, "throughput_ratio": 1.05, "model_error_max": 0.20}
CHECK_BATCHES = (32, 128, 512)


def peak_load_step(steady: list[dict], frac: float = PEAK_FRACTION) -> float | None:
    """The steady max step latency, robust to noise: the median step time over the
    steady steps whose context is within `frac` of the run's steady peak context. Step
    time follows the context in flight; single steps stalled by other processes on this
    shared machine do not decide it."""
    decode = sorted((r for r in steady if not r["num_prefill"]), key=lambda r: -r["context_tokens"])
    if not decode:
        return None
    top = [r for r in decode if r["context_tokens"] >= frac * decode[0]["context_tokens"]]
    return statistics.median(r["step_time"] for r in (top if len(top) >= MIN_PAIRS else decode[:MIN_PAIRS]))


TRACE_COLUMNS = ("batch_size", "num_prefill", "context_tokens", "step_time", "s_time", "r_time", "s_wait")


def compact(trace: list[dict]) -> dict:
    """The per-step trace as columns (times in ms, 3 decimals): small enough to commit."""
    return {k: [round(r[k] * 1e3, 3) if k.endswith(("time", "wait")) else r[k] for r in trace]
            for k in TRACE_COLUMNS} | {"time_unit": "ms"}


def paired_peak_ratio(fcfs: list[dict], sls: list[dict], wf: list[int], ws: list[int],
                      frac: float = PEAK_FRACTION) -> float | None:
    """Median SLS step time / median FCFS step time over the same moments: the FCFS
    steady steps at >= `frac` of its peak context (its slowest, load-bound steps), and
    the SLS steps run right beside them (the engines alternate steps; SLS's context is
    flat near its own peak in steady state). Background load hits both sides alike."""
    f_steady = fcfs[wf[0]:wf[1]]
    decode = sorted((i for i, r in enumerate(f_steady) if not r["num_prefill"]),
                    key=lambda i: -f_steady[i]["context_tokens"])
    if not decode:
        return None
    top = f_steady[decode[0]]["context_tokens"]
    idx = [i for i in decode if f_steady[i]["context_tokens"] >= frac * top]
    idx = idx if len(idx) >= MIN_PAIRS else decode[:MIN_PAIRS]
    pairs = [(f_steady[i]["step_time"], sls[ws[0] + i]["step_time"]) for i in idx if ws[0] + i < ws[1]]
    if not pairs:
        return None
    return statistics.median(b for _, b in pairs) / statistics.median(a for a, _ in pairs)


def rolling_median(xs: list[float], k: int = 5) -> list[float]:
    h = k // 2
    return [statistics.median(xs[max(0, i - h): i + h + 1]) for i in range(len(xs))]


def start_backend(stack: ExitStack, kind: str, workers: int, kv_bytes: int) -> tuple[dict, str]:
    """EngineConfig fields for the R-Part, and a description."""
    if kind == "remote":
        try:
            from fastdecode.ops.testing import local_fleet
            fleet = stack.enter_context(local_fleet(workers, tempfile.mkdtemp(prefix="bench_sls_"),
                                                    kv_capacity=kv_bytes // workers + (64 << 20), threads=1))
            return ({"attention": "remote", "rworkers": fleet.addresses, "rworker_timeout_s": 120.0},
                    f"remote: {workers} local R-worker processes, 1 kernel thread each")
        except Exception as e:  # noqa: BLE001 - fall back, and say so in the JSON
            print(f"R-worker fleet unavailable ({type(e).__name__}: {e}); using the local backend", flush=True)
    return {"attention": "local", "kernel_threads": 1, "kv_capacity_bytes": kv_bytes}, \
        "local: in-process kernel, 1 thread"


def add_workload(engine, n: int, prompt: int, gen: int) -> None:
    from fastdecode.engine import SamplingParams

    vocab = engine.args.vocab_size
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.add_request([(17 * i + 31 * j) % (vocab - 1) + 1 for j in range(prompt)], params)


def start_backends(stack: ExitStack, kind: str, workers: int, kv_bytes: int) -> tuple[dict, str]:
    """One R-Part per policy (two engines run side by side; R-workers key KV by sequence id)."""
    fcfs, desc = start_backend(stack, kind, workers, kv_bytes)
    sls, _ = start_backend(stack, kind if fcfs["attention"] == "remote" else "local", workers, kv_bytes)
    return {"fcfs": fcfs, "sls": sls}, desc + " (one such set per policy)"


def run_workload(config: EngineConfig, n: int, prompt: int, gen: int) -> list[dict]:
    from fastdecode.engine import Engine

    engine = Engine(config)
    try:
        add_workload(engine, n, prompt, gen)
        while engine.has_unfinished():
            engine.step()
        return list(engine.trace)
    finally:
        engine.stop()


def run_interleaved(configs: dict[str, EngineConfig], n: int, prompt: int, gen: int) -> dict[str, list[dict]]:
    """The same workload on one engine per config, stepped in turn: background load on
    this shared machine hits every policy alike."""
    from fastdecode.engine import Engine

    engines = {}
    try:
        for name, cfg in configs.items():
            engines[name] = Engine(cfg)
            add_workload(engines[name], n, prompt, gen)
        while any(e.has_unfinished() for e in engines.values()):
            for e in engines.values():
                if e.has_unfinished():
                    e.step()
        return {name: list(e.trace) for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.stop()


def steady_window(trace: list[dict], n: int, gen: int) -> tuple[int, int]:
    """[first, last) step indices: after the first `gen` steps, while requests still queue."""
    admitted, last = 0, 0
    for i, r in enumerate(trace):
        admitted += r["num_prefill"]
        if admitted < n:
            last = i + 1
    return min(gen, last), max(last, min(gen, last))


def compare(name: str, backends: dict[str, dict], base: EngineConfig, n: int, prompt: int, gen: int, f: int) -> dict:
    """FCFS and SLS interleaved on the same workload. Steady windows are cut to the same
    length (the shorter of the two), so neither max is taken over more steps."""
    t = time.perf_counter()
    configs = {p: base.replace(scheduler=p, sls_f=f, **backends[p]) for p in ("fcfs", "sls")}
    traces = run_interleaved(configs, n, prompt, gen)
    wall = time.perf_counter() - t
    windows = {p: steady_window(traces[p], n, gen) for p in traces}
    length = min(b - a for a, b in windows.values())
    runs = {}
    for policy, trace in traces.items():
        first = windows[policy][0]
        last = first + length
        s = summarize(trace, warmup=first, cooldown=len(trace) - last)
        steady = trace[first:last]
        smooth = rolling_median([r["step_time"] for r in steady], SMOOTH)
        runs[policy] = {"summary": s, "steady_window": [first, last],
                        "steady_max_step_s_smoothed": max(smooth) if smooth else None,
                        "steady_peak_load_step_s": peak_load_step(steady),
                        "trace": compact(trace)}
        st = s.get("steady", {})
        print(f"[{name}] {policy}: {len(trace)} steps; steady {first}..{last}: "
              f"max step {st.get('max_step_time_s', 0) * 1e3:.1f} ms (rolling median "
              f"{(runs[policy]['steady_max_step_s_smoothed'] or 0) * 1e3:.1f}, at peak load "
              f"{(runs[policy]['steady_peak_load_step_s'] or 0) * 1e3:.1f}), p50 "
              f"{st.get('p50_step_time_s', 0) * 1e3:.1f} ms, {st.get('throughput_tok_s', 0):.1f} tok/s, "
              f"max context {st.get('max_context_tokens')}", flush=True)
    f_s, s_s = runs["fcfs"]["summary"].get("steady"), runs["sls"]["summary"].get("steady")
    out = {"workload": {"requests": n, "prompt_tokens": prompt, "gen_tokens": gen, "sls_f": f,
                        "max_running": base.max_running}, "wall_s": wall, "runs": runs}
    if f_s and s_s:
        paired = paired_peak_ratio(traces["fcfs"], traces["sls"], runs["fcfs"]["steady_window"],
                                   runs["sls"]["steady_window"])
        out.update(
            steady_max_step_latency_ratio=paired,
            steady_max_step_latency_ratio_unpaired=runs["sls"]["steady_peak_load_step_s"]
            / runs["fcfs"]["steady_peak_load_step_s"],
            steady_max_step_latency_ratio_rolling_median=runs["sls"]["steady_max_step_s_smoothed"]
            / runs["fcfs"]["steady_max_step_s_smoothed"],
            steady_max_step_latency_ratio_raw=s_s["max_step_time_s"] / f_s["max_step_time_s"],
            steady_p99_step_latency_ratio=s_s["p99_step_time_s"] / f_s["p99_step_time_s"],
            steady_p50_step_latency_ratio=s_s["p50_step_time_s"] / f_s["p50_step_time_s"],
            throughput_ratio=s_s["throughput_tok_s"] / f_s["throughput_tok_s"],
            whole_run_throughput_ratio=runs["sls"]["summary"]["throughput_tok_s"]
            / runs["fcfs"]["summary"]["throughput_tok_s"],
            steady_max_context_ratio=s_s["max_context_tokens"] / f_s["max_context_tokens"])
        print(f"[{name}] sls/fcfs: steady max step {out['steady_max_step_latency_ratio']:.3f} "
              f"(unpaired {out['steady_max_step_latency_ratio_unpaired']:.3f}, raw {out['steady_max_step_latency_ratio_raw']:.3f}, p99 {out['steady_p99_step_latency_ratio']:.3f}, "
              f"max rolling median {out['steady_max_step_latency_ratio_rolling_median']:.3f}), "
              f"throughput {out['throughput_ratio']:.3f}, max context {out['steady_max_context_ratio']:.3f}", flush=True)
    return out


RATIOS = ("steady_max_step_latency_ratio", "steady_max_step_latency_ratio_unpaired", "throughput_ratio",
          "steady_max_step_latency_ratio_rolling_median")


def compare_repeated(name: str, repeats: int, *args) -> dict:
    """compare() `repeats` times: the first run's traces, the medians of the ratios."""
    runs = [compare(name if repeats == 1 else f"{name} #{i + 1}", *args) for i in range(repeats)]
    out = runs[0]
    if repeats > 1:
        out["repeats"] = [{k: r.get(k) for k in RATIOS} for r in runs]
        for k in RATIOS:
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals else None
        print(f"[{name}] median of {repeats}: steady max step {out['steady_max_step_latency_ratio']:.3f}, "
              f"throughput {out['throughput_ratio']:.3f}", flush=True)
    return out


def perf_model_for(model: str, base: EngineConfig, batches, contexts, repeats: int) -> PerfModel:
    """T(B), H(B) from the model's layer code; R through the same backend the engine uses
    (for the remote one: gRPC transport to both R-workers included)."""
    from fastdecode.attention import KVSpec, create_backend
    from fastdecode.model.llama import ModelArgs
    from transformers import AutoConfig

    a = ModelArgs.from_hf(AutoConfig.from_pretrained(model))
    backend = create_backend(base, KVSpec(a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim))
    try:
        return build_perf_model(model, "cpu", "float32", batches=batches, contexts=contexts, repeats=repeats,
                                backend=backend)
    finally:
        backend.shutdown()


def model_check(pm: PerfModel, base: EngineConfig, batches: list[int], prompt: int, gen: int) -> dict:
    """Engine decode steps at full batch B vs pm.step_time(B, context) as `plan` predicts it:
    pipelined, max(S, R) per layer over the mini-batches (the serial sum S + R, what a step
    costs when S- and R-Part cannot overlap at all, is reported beside it: on this machine
    both share two cores that other processes also use). R was measured through the whole
    backend (workers=1).
    Two comparisons: the model's medians vs the median engine step (model_error_max), and
    the floor model (fastest micro-benchmark repeats) vs the fastest engine step
    (model_error_max_floor): the same estimator on both sides, least hit by other work."""
    floor = floor_model(pm)
    out = {}
    for b in batches:
        cfg = base.replace(scheduler="fcfs", max_running=b, max_prefill_tokens=max(4096, b * prompt))
        trace = run_workload(cfg, b, prompt, gen)
        decode = [r for r in trace if r["num_prefill"] == 0 and r["batch_size"] == b]
        if not decode:
            out[str(b)] = {"error": "no full-batch decode step"}
            continue
        times = sorted(r["step_time"] for r in decode)
        measured, fastest = statistics.median(times), times[0]
        ctx = statistics.median(r["context_tokens"] for r in decode)
        predicted = pm.step_time(b, ctx, 1, cfg.num_minibatches, overlap=True)
        predicted_floor = floor.step_time(b, ctx, 1, cfg.num_minibatches, overlap=True)
        serial = pm.step_time(b, ctx, 1, cfg.num_minibatches, overlap=False)
        out[str(b)] = {"measured_step_s": measured, "predicted_step_s": predicted,
                       "predicted_serial_step_s": serial,
                       "measured_min_step_s": fastest, "predicted_floor_step_s": predicted_floor,
                       "context_tokens": ctx, "steps": len(decode),
                       "rel_error": abs(predicted - measured) / measured,
                       "rel_error_serial": abs(serial - measured) / measured,
                       "rel_error_floor": abs(predicted_floor - fastest) / fastest}
        print(f"model check B={b}: measured {measured * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms "
              f"(error {out[str(b)]['rel_error']:.1%}); fastest {fastest * 1e3:.1f} ms vs floor model "
              f"{predicted_floor * 1e3:.1f} ms (error {out[str(b)]['rel_error_floor']:.1%})", flush=True)
    ok = [v for v in out.values() if "rel_error" in v]
    return {"batches": out, "model_error_max": max((v["rel_error"] for v in ok), default=None),
            "model_error_max_serial": max((v["rel_error_serial"] for v in ok), default=None),
            "model_error_max_floor": max((v["rel_error_floor"] for v in ok), default=None)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in results.items() if isinstance(v, dict) and "runs" in v]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 3.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        res = results[name]
        ctx_ax = ax.twinx()
        top = 0.0
        for policy, color in (("fcfs", "tab:red"), ("sls", "tab:blue")):
            run = res["runs"][policy]
            lat = run["trace"]["step_time"]
            steps = list(range(len(lat)))
            smooth = rolling_median(lat, SMOOTH)
            ax.plot(steps, lat, color=color, lw=0.6, alpha=0.3)
            ax.plot(steps, smooth, color=color, lw=1.4, label=f"{policy} step latency (rolling median {SMOOTH})")
            top = max(top, max(smooth))
            ctx_ax.plot(steps, run["trace"]["context_tokens"], color=color, lw=0.8, ls="--",
                        label=f"{policy} context in flight")
            a, b = run["steady_window"]
            ax.axvspan(a, b, color=color, alpha=0.05)
        ratio = res.get("steady_max_step_latency_ratio")
        ax.set_title(f"{name}: per-step latency (steady max ratio sls/fcfs = "
                     f"{ratio:.2f})" if ratio else name, fontsize=10)
        ax.set_ylim(0, 1.5 * top)
        ax.set_xlabel("engine step")
        ax.set_ylabel("step latency (ms)")
        ctx_ax.set_ylabel("context tokens in flight")
        ctx_ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
        ctx_ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kv_bytes(num_layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    return int(2 * num_layers * kv_heads * head_dim * 2 * tokens * 1.3) + (64 << 20)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["default", "rheavy", "7b"], choices=["default", "rheavy", "7b"])
    p.add_argument("--backend", choices=("remote", "local"), default="remote")
    p.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run, not a result)")
    p.add_argument("--out", default=str(RESULTS / "sls.json"))
    p.add_argument("--repeats", type=int, default=1, help="fcfs-vs-sls runs per configuration (ratios: medians)")
    p.add_argument("--budget-s", type=float, default=400.0, help="skip the 7b part when this much time is spent")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q = args.quick
    t_start = time.perf_counter()
    results: dict = {"bench": "sls", "host": platform.node(), "cpus": os.cpu_count(), "torch_threads": 1,
                     "paper": PAPER, "targets": TARGETS, "quick": q}
    tmp = Path(tempfile.mkdtemp(prefix="bench_sls_models_"))
    workers = 2
    with ExitStack() as stack:
        if "default" in args.configs:
            model = str(DEFAULT_MODEL_DIR)
            B, prompt, gen, f = (16, 16, 48, 8) if q else (32, 16, 64, 8)
            kvb = kv_bytes(30, 3, 64, max(512 * 16, (2 * B + 1) * (prompt + gen + 8)) + 65536 // 30)
            backends, desc = start_backends(stack, args.backend, workers, kvb)
            base = EngineConfig(model=model, max_running=B, max_prefill_tokens=B * prompt, **backends["fcfs"])
            res = results["default"] = {"model": "smollm2-135m-instruct", "backend": desc}
            res.update(compare_repeated("default", args.repeats, backends, base, 2 * B + 1, prompt, gen, f))
            pm = perf_model_for(model, base, (8, 32, 128, 512), (4096, 16384, 65536), 3 if q else 5)
            pm.save(RESULTS / "perfmodel_default.json")
            res["perf_model"] = "bench/results/perfmodel_default.json"
            res["model_check"] = model_check(pm, base, [32, 128] if q else [32, 128, 512], 4, 8)
            res["predicted_steady_max_step_latency_ratio"] = predicted_ratio(pm, res)
        if "rheavy" in args.configs:
            from fastdecode.testing import make_tiny_llama
            model = str(make_tiny_llama(tmp / "rheavy", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
                                        intermediate_size=512, max_position_embeddings=2048))
            B, prompt, gen, f = (32, 16, 128, 8) if q else (128, 32, 1024, 32)
            kvb = kv_bytes(2, 4, 64, max((2 * B + 1) * (prompt + gen + 8), 512 * 72) + 65536 // 2)
            backends, desc = start_backends(stack, "local", workers, kvb)
            base = EngineConfig(model=model, max_running=B, max_prefill_tokens=B * prompt, **backends["fcfs"])
            res = results["rheavy"] = {"model": "random Llama: hidden 256, 2 layers, 4 heads x 64, MLP 512",
                                       "backend": desc}
            res.update(compare_repeated("rheavy", args.repeats, backends, base, 2 * B + 1, prompt, gen, f))
            pm = perf_model_for(model, base, (8, 32, 128, 512), (4096, 16384, 65536), 5)
            pm.save(RESULTS / "perfmodel_rheavy.json")
            res["perf_model"] = "bench/results/perfmodel_rheavy.json"
            res["model_check"] = model_check(pm, base, [32, 128, 512], 64, 16)
            res["predicted_steady_max_step_latency_ratio"] = predicted_ratio(pm, res)
        if "7b" in args.configs:
            spent = time.perf_counter() - t_start
            if spent > args.budget_s:
                results["7b"] = {"skipped": f"time budget: {spent:.0f} s spent of {args.budget_s:.0f} s"}
            else:
                results["7b"] = run_7b(stack, tmp, args.backend, workers, q)
    # Top level: the default model (the configuration) when it ran, else rheavy;
    # every configuration's figures side by side under "by_config".
    results["by_config"] = {
        n: {k: results[n].get(k) for k in ("backend", "steady_max_step_latency_ratio",
                                           "steady_max_step_latency_ratio_unpaired", "throughput_ratio",
                                           "predicted_steady_max_step_latency_ratio")}
        | {k: results[n].get("model_check", {}).get(k)
           for k in ("model_error_max", "model_error_max_serial", "model_error_max_floor")}
        for n in ("default", "rheavy", "7b") if n in results and isinstance(results[n], dict)}
    head = next((n for n in ("default", "rheavy") if "steady_max_step_latency_ratio" in results.get(n, {})), None)
    results["headline_config"] = head
    for key in ("steady_max_step_latency_ratio", "throughput_ratio"):
        results[key] = results[head][key] if head else None
    # The model's error: the worst over every configuration checked, at the B in {32, 128, 512}.
    checked = [(n, b, v) for n in ("default", "rheavy", "7b") for b, v in
               results.get(n, {}).get("model_check", {}).get("batches", {}).items()
               if int(b) in CHECK_BATCHES and "rel_error" in v]
    for key in ("rel_error", "rel_error_serial", "rel_error_floor"):
        worst = max(checked, key=lambda c: c[2][key], default=None)
        name = "model_error_max" + key[len("rel_error"):]
        results[name] = worst[2][key] if worst else None
        results[name + "_at"] = f"{worst[0]} B={worst[1]}" if worst else None
    results["wall_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(results, png)
    results["plot"] = str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=1))
    print(f"wrote {out} and {png} in {results['wall_s']:.0f} s")
    return 0


def predicted_ratio(pm: PerfModel, res: dict) -> float | None:
    """What the perf model says the steady max step ratio should be, at the measured peak contexts."""
    try:
        b = res["workload"]["max_running"]
        f_ctx = res["runs"]["fcfs"]["summary"]["steady"]["max_context_tokens"]
        s_ctx = res["runs"]["sls"]["summary"]["steady"]["max_context_tokens"]
    except KeyError:
        return None
    return pm.step_time(b, s_ctx, 1, 2, overlap=True) / pm.step_time(b, f_ctx, 1, 2, overlap=True)


def run_7b(stack: ExitStack, tmp: Path, backend_kind: str, workers: int, quick: bool) -> dict:
    """7B layer shapes, 2 layers: perf model and a model check, if this machine holds it."""
    import psutil

    need = 2 * 202_000_000 * 4 * 2 + (1 << 30)          # 2 layers fp32, twice (model + perf model) + slack
    free = psutil.virtual_memory().available
    if free < need:
        return {"skipped": f"needs ~{need >> 20} MiB free, {free >> 20} MiB available"}
    from fastdecode.testing import make_tiny_llama
    t = time.perf_counter()
    model = str(make_tiny_llama(tmp / "llama7b2", hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=32,
                                intermediate_size=11008, max_position_embeddings=2048))
    kvb = kv_bytes(2, 32, 128, 32 * 16 + 16384 + 1024)
    backend, desc = start_backend(stack, backend_kind, workers, kvb)
    base = EngineConfig(model=model, max_running=32, **backend)
    pm = perf_model_for(model, base, (1, 8, 32) if quick else (1, 8, 32, 128), (2048, 16384), 3)
    pm.save(RESULTS / "perfmodel_7b2.json")
    check = model_check(pm, base, [8, 32], 4, 6)
    return {"model": "Llama-7B shapes (hidden 4096, 32 heads, MLP 11008), 2 layers, random weights",
            "backend": desc, "perf_model": "bench/results/perfmodel_7b2.json", "model_check": check,
            "T_ms_per_layer": {str(int(x)): y * 1e3 for x, y in zip(pm.s_layer.xs, pm.s_layer.ys)},
            "R_ns_per_token_layer": pm.r_per_token * 1e9, "wall_s": time.perf_counter() - t}


if __name__ == "__main__":
    sys.exit(main())
