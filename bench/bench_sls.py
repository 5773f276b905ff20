"""SLS versus FCFS on the real engine (PAPER.md Figure 11), and the perf model checked
against measured step times.

    make bench-sls          # or: python bench/bench_sls.py [--quick] [--configs default rheavy 7b]

For each configuration: the same workload (n = cohorts * B requests of `prompt` tokens
generating exactly `gen` tokens, ignore_eos, all queued at once) runs under fcfs and
under sls on one engine configuration; the per-step trace gives
  - steady state: the steps after the first `gen` (ramp-up) while requests are still
    queued (the system is saturated). FCFS's cohorts grow together, SLS's micro-batches
    are staggered;
  - steady_max_step_latency_ratio = max step time (sls) / max step time (fcfs) in steady
    state; the max is taken over a rolling median of 5 steps so that one descheduled
    step on this shared machine is not "the max" (the raw max ratio is reported too);
  - throughput_ratio = steady tokens/s (sls) / steady tokens/s (fcfs).
Then the perf model (fastdecode.perfmodel: T(B), H(B), R measured by micro-benchmarks in
this run) predicts the step time of engine decode steps at B in {32, 128, 512};
model_error_max = max |predicted - measured| / measured.

Configurations:
  default  models/smollm2-135m-instruct, the remote backend with 2 local R-workers (1 kernel
           thread each) when rworker is available, else the in-process backend (recorded).
  rheavy   a random 4-layer Llama with hidden 256 (4 heads of 64): its S-Part is cheap next to
           its R-Part, the balance a GPU S-worker has (PAPER.md) but this CPU-only machine
           cannot give the default model at lengths a 10-minute run affords.
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
from fastdecode.perfmodel import PerfModel, build_perf_model  # noqa: E402
from fastdecode.trace import summarize  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAPER = {"steady_max_step_latency_ratio": [0.66, 0.70], "throughput_gain": [0.08, 0.11]}
TARGETS = {"steady_max_step_latency_ratio": 0.75, "throughput_ratio": 1.05, "model_error_max": 0.20}


def rolling_median(xs: list[float], k: int = 5) -> list[float]:
    h = k // 2
    return [statistics.median(xs[max(0, i - h): i + h + 1]) for i in range(len(xs))]


def start_backend(stack: ExitStack, kind: str, workers: int, kv_bytes: int) -> tuple[dict, str]:
    """EngineConfig fields for the R-Part, and a description."""
    if kind == "remote":
        try:
            from rworker.testing import local_fleet
            fleet = stack.enter_context(local_fleet(workers, tempfile.mkdtemp(prefix="bench_sls_"),
                                                    kv_capacity=kv_bytes // workers + (64 << 20), threads=1))
            return ({"attention": "remote", "rworkers": fleet.addresses, "rworker_timeout_s": 120.0},
                    f"remote: {workers} local R-worker processes, 1 kernel thread each")
        except Exception as e:  # noqa: BLE001 - fall back, and say so in the JSON
            print(f"R-worker fleet unavailable ({type(e).__name__}: {e}); using the local backend", flush=True)
    return {"attention": "local", "kernel_threads": 1, "kv_capacity_bytes": kv_bytes}, \
        "local: in-process kernel, 1 thread"


def run_workload(config: EngineConfig, n: int, prompt: int, gen: int) -> list[dict]:
    from fastdecode.engine import Engine, SamplingParams

    engine = Engine(config)
    try:
        vocab = engine.args.vocab_size
        params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        for i in range(n):
            engine.add_request([(17 * i + 31 * j) % (vocab - 1) + 1 for j in range(prompt)], params)
        while engine.has_unfinished():
            engine.step()
        return list(engine.trace)
    finally:
        engine.stop()


def steady_window(trace: list[dict], n: int, gen: int) -> tuple[int, int]:
    """[first, last) step indices: after the first `gen` steps, while requests still queue."""
    admitted, last = 0, 0
    for i, r in enumerate(trace):
        admitted += r["num_prefill"]
        if admitted < n:
            last = i + 1
    return min(gen, last), max(last, min(gen, last))


def compare(name: str, base: EngineConfig, n: int, prompt: int, gen: int, f: int) -> dict:
    runs = {}
    for policy in ("fcfs", "sls"):
        cfg = base.replace(scheduler=policy, sls_f=f)
        t = time.perf_counter()
        trace = run_workload(cfg, n, prompt, gen)
        first, last = steady_window(trace, n, gen)
        s = summarize(trace, warmup=first, cooldown=len(trace) - last)
        steady = [r["step_time"] for r in trace[first:last]]
        smooth = rolling_median(steady)
        runs[policy] = {"summary": s, "steady_window": [first, last],
                        "steady_max_step_s_smoothed": max(smooth) if smooth else None,
                        "wall_s": time.perf_counter() - t,
                        "trace": [{k: r[k] for k in ("step", "batch_size", "num_prefill", "context_tokens",
                                                     "step_time", "s_time", "r_time", "s_wait")}
                                  for r in trace]}
        st = s.get("steady", {})
        print(f"[{name}] {policy}: {len(trace)} steps in {runs[policy]['wall_s']:.0f} s; steady {first}..{last}: "
              f"max step {st.get('max_step_time_s', 0) * 1e3:.1f} ms (smoothed "
              f"{(runs[policy]['steady_max_step_s_smoothed'] or 0) * 1e3:.1f}), "
              f"{st.get('throughput_tok_s', 0):.1f} tok/s, max context {st.get('max_context_tokens')}", flush=True)
    f_s, s_s = runs["fcfs"]["summary"].get("steady"), runs["sls"]["summary"].get("steady")
    out = {"workload": {"requests": n, "prompt_tokens": prompt, "gen_tokens": gen, "sls_f": f,
                        "max_running": base.max_running}, "runs": runs}
    if f_s and s_s:
        out.update(
            steady_max_step_latency_ratio=runs["sls"]["steady_max_step_s_smoothed"]
            / runs["fcfs"]["steady_max_step_s_smoothed"],
            steady_max_step_latency_ratio_raw=s_s["max_step_time_s"] / f_s["max_step_time_s"],
            steady_p50_step_latency_ratio=s_s["p50_step_time_s"] / f_s["p50_step_time_s"],
            throughput_ratio=s_s["throughput_tok_s"] / f_s["throughput_tok_s"],
            whole_run_throughput_ratio=runs["sls"]["summary"]["throughput_tok_s"]
            / runs["fcfs"]["summary"]["throughput_tok_s"],
            steady_max_context_ratio=s_s["max_context_tokens"] / f_s["max_context_tokens"])
        print(f"[{name}] sls/fcfs: steady max step {out['steady_max_step_latency_ratio']:.3f} "
              f"(raw {out['steady_max_step_latency_ratio_raw']:.3f}), throughput {out['throughput_ratio']:.3f}, "
              f"max context {out['steady_max_context_ratio']:.3f}", flush=True)
    return out


def model_check(pm: PerfModel, base: EngineConfig, batches: list[int], prompt: int, gen: int,
                workers: int) -> dict:
    """Engine decode steps at full batch B vs pm.step_time(B, context) (S and R share the cores)."""
    out = {}
    for b in batches:
        cfg = base.replace(scheduler="fcfs", max_running=b, max_prefill_tokens=max(4096, b * prompt))
        trace = run_workload(cfg, b, prompt, gen)
        decode = [r for r in trace if r["num_prefill"] == 0 and r["batch_size"] == b]
        if not decode:
            out[str(b)] = {"error": "no full-batch decode step"}
            continue
        measured = statistics.median(r["step_time"] for r in decode)
        ctx = statistics.median(r["context_tokens"] for r in decode)
        predicted = pm.step_time(b, ctx, workers, cfg.num_minibatches, overlap=False)
        out[str(b)] = {"measured_step_s": measured, "predicted_step_s": predicted, "context_tokens": ctx,
                       "steps": len(decode), "rel_error": abs(predicted - measured) / measured}
        print(f"model check B={b}: measured {measured * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms "
              f"(error {out[str(b)]['rel_error']:.1%})", flush=True)
    errs = [v["rel_error"] for v in out.values() if "rel_error" in v]
    return {"batches": out, "model_error_max": max(errs) if errs else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in results.items() if isinstance(v, dict) and "runs" in v]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 3.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        res = results[name]
        for policy, color in (("fcfs", "tab:red"), ("sls", "tab:blue")):
            run = res["runs"][policy]
            steps = [r["step"] - run["trace"][0]["step"] for r in run["trace"]]
            lat = [r["step_time"] * 1e3 for r in run["trace"]]
            ax.plot(steps, lat, color=color, lw=0.6, alpha=0.35)
            ax.plot(steps, rolling_median([x for x in lat]), color=color, lw=1.4, label=f"{policy}")
            a, b = run["steady_window"]
            ax.axvspan(a, b, color=color, alpha=0.05)
        ratio = res.get("steady_max_step_latency_ratio")
        ax.set_title(f"{name}: per-step latency (steady max ratio sls/fcfs = "
                     f"{ratio:.2f})" if ratio else name, fontsize=10)
        ax.set_xlabel("engine step")
        ax.set_ylabel("step latency (ms)")
        ax.legend(loc="upper left")
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
            B, prompt, gen, f = (16, 16, 48, 8) if q else (32, 32, 192, 16)
            kvb = kv_bytes(30, 3, 64, max(512, 3 * B) * (prompt + gen + 8) + 512 * 16)
            backend, desc = start_backend(stack, args.backend, workers, kvb)
            base = EngineConfig(model=model, max_running=B, max_prefill_tokens=B * prompt, **backend)
            res = results["default"] = {"model": "smollm2-135m-instruct", "backend": desc}
            res.update(compare("default", base, 3 * B, prompt, gen, f))
            pm = build_perf_model(model, "cpu", "float32", batches=(8, 32, 128, 512),
                                  threads=1, repeats=3 if q else 5)
            pm.save(RESULTS / "perfmodel_default.json")
            res["perf_model"] = "bench/results/perfmodel_default.json"
            res["model_check"] = model_check(pm, base, [32, 128] if q else [32, 128, 512], 4, 4,
                                             workers if base.attention == "remote" else 1)
            res["predicted_steady_max_step_latency_ratio"] = predicted_ratio(pm, res, workers if base.attention ==
                                                                             "remote" else 1)
        if "rheavy" in args.configs:
            from fastdecode.testing import make_tiny_llama
            model = str(make_tiny_llama(tmp / "rheavy", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                                        intermediate_size=512, max_position_embeddings=2048))
            B, prompt, gen, f = (32, 16, 128, 8) if q else (64, 32, 512, 16)
            kvb = kv_bytes(4, 4, 64, 3 * B * (prompt + gen + 8))
            backend, desc = start_backend(stack, args.backend, workers, kvb)
            base = EngineConfig(model=model, max_running=B, max_prefill_tokens=B * prompt, **backend)
            res = results["rheavy"] = {"model": "random Llama: hidden 256, 4 layers, 4 heads x 64, MLP 512",
                                       "backend": desc}
            res.update(compare("rheavy", base, 3 * B, prompt, gen, f))
            pm = build_perf_model(model, "cpu", "float32", batches=(8, 32, 128, 512), threads=1, repeats=5)
            pm.save(RESULTS / "perfmodel_rheavy.json")
            res["perf_model"] = "bench/results/perfmodel_rheavy.json"
            res["model_check"] = model_check(pm, base, [32, 128, 512], 64, 8,
                                             workers if base.attention == "remote" else 1)
            res["predicted_steady_max_step_latency_ratio"] = predicted_ratio(pm, res, workers if base.attention ==
                                                                             "remote" else 1)
        if "7b" in args.configs:
            results["7b"] = run_7b(stack, tmp, args.backend, workers, q)
    for name in ("default", "rheavy"):
        if name in results and "steady_max_step_latency_ratio" in results[name]:
            for key in ("steady_max_step_latency_ratio", "throughput_ratio"):
                results.setdefault(key, results[name][key])
            results.setdefault("headline_config", name)
    errs = [results[n]["model_check"]["model_error_max"] for n in ("default", "rheavy", "7b")
            if n in results and results[n].get("model_check", {}).get("model_error_max") is not None]
    results["model_error_max"] = max(errs) if errs else None
    results["model_error_max_default_model"] = results.get("default", {}).get("model_check", {}).get("model_error_max")
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


def predicted_ratio(pm: PerfModel, res: dict, workers: int) -> float | None:
    """What the perf model says the steady max step ratio should be, at the measured peak contexts."""
    try:
        b = res["workload"]["max_running"]
        f_ctx = res["runs"]["fcfs"]["summary"]["steady"]["max_context_tokens"]
        s_ctx = res["runs"]["sls"]["summary"]["steady"]["max_context_tokens"]
    except KeyError:
        return None
    return pm.step_time(b, s_ctx, workers, 2, overlap=False) / pm.step_time(b, f_ctx, workers, 2, overlap=False)


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
    pm = build_perf_model(model, "cpu", "float32", batches=(1, 8, 32) if quick else (1, 8, 32, 128),
                          contexts=(4096, 16384, 65536), threads=1, repeats=3)
    pm.save(RESULTS / "perfmodel_7b2.json")
    kvb = kv_bytes(2, 32, 128, 128 * 80)
    backend, desc = start_backend(stack, backend_kind, workers, kvb)
    base = EngineConfig(model=model, max_running=32, **backend)
    check = model_check(pm, base, [8, 32] if quick else [32, 128], 64, 4,
                        workers if base.attention == "remote" else 1)
    return {"model": "Llama-7B shapes (hidden 4096, 32 heads, MLP 11008), 2 layers, random weights",
            "backend": desc, "perf_model": "bench/results/perfmodel_7b2.json", "model_check": check,
            "T_ms_per_layer": {str(int(x)): y * 1e3 for x, y in zip(pm.s_layer.xs, pm.s_layer.ys)},
            "R_ns_per_token_layer": pm.r_per_token * 1e9, "wall_s": time.perf_counter() - t}


if __name__ == "__main__":
    sys.exit(main())
