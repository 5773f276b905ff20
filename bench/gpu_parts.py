"""The measurements of bench/gpu_check.py, one function per part.

Each part is `part(ctx, budget) -> dict`: it reads what earlier parts left in `ctx`
(a Context), stops early when `budget.expired()`, and returns its figures for the
JSON. Sizes come from ctx.profile (gpu_check.Profile): the GPU run and the CPU smoke
run share every line of code here.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
# What CUDA libraries raise at the memory limit besides torch.OutOfMemoryError.
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class Budget:
    """A part's time: its own cap and the run's global deadline, whichever comes first."""

    def __init__(self, seconds: float, global_deadline: float) -> None:
        self.start = time.monotonic()
        self.deadline = min(self.start + seconds, global_deadline)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def spent(self) -> float:
        return time.monotonic() - self.start

    def less(self, reserve: float) -> "Budget":
        """The same budget ending `reserve` seconds earlier: time kept for what follows."""
        inner = copy.copy(self)
        inner.deadline -= reserve
        return inner


@dataclass
class Context:
    profile: object                       # gpu_check.Profile
    work_dir: Path
    fleets: list = field(default_factory=list)          # R-worker fleets now running (the watchdog kills them)
    models: dict = field(default_factory=dict)          # config name -> {"dir", "source"}
    s_points: dict = field(default_factory=dict)        # config name -> (T points, H points, shape)


# --- helpers ---------------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def rworker_threads(profile) -> int:
    """Kernel threads per R-worker: the host's cores less the S-worker's, split over the workers."""
    if profile.rworker_threads:
        return profile.rworker_threads
    cores = len(os.sched_getaffinity(0))
    return max(1, (cores - profile.s_worker_cores) // profile.rworkers)


def kv_bytes_per_token(shape: dict) -> int:
    """fp16 K and V of one token over all layers."""
    return 2 * 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"]


@contextlib.contextmanager
def rworker_fleet(ctx: Context, tokens: int, shape: dict):
    """2 (profile.rworkers) local R-worker processes holding `tokens` tokens of KV between them."""
    from fastdecode.ops.testing import local_fleet

    p = ctx.profile
    capacity = int(1.5 * tokens * kv_bytes_per_token(shape)) // p.rworkers + (64 << 20)
    fleet = local_fleet(p.rworkers, tempfile.mkdtemp(prefix="fleet_", dir=ctx.work_dir), kv_capacity=capacity,
                        threads=rworker_threads(p))
    with fleet:
        ctx.fleets.append(fleet)
        try:
            yield fleet
        finally:
            ctx.fleets.remove(fleet)


def engine_config(ctx: Context, model_dir: str, fleet, **changes):
    from fastdecode.config import EngineConfig

    p = ctx.profile
    return EngineConfig(model=model_dir, device=p.device, dtype=p.dtype, attention="remote",
                        rworkers=fleet.addresses, rworker_timeout_s=120.0, **changes)


def comm_share(before: dict, after: dict) -> dict:
    """1 - kernel/wall over the decode calls between two backend.stats() (bench/bench_rworker.py)."""
    calls = after.get("decode_calls", 0) - before.get("decode_calls", 0)
    wall = after.get("decode_wall_s", 0.0) - before.get("decode_wall_s", 0.0)
    kernel = after.get("decode_kernel_s", 0.0) - before.get("decode_kernel_s", 0.0)
    if not calls or wall <= 0:
        return {"comm_share": None, "decode_calls": calls}
    return {"comm_share": 1.0 - kernel / wall, "decode_calls": calls, "call_ms": 1e3 * wall / calls,
            "kernel_ms": 1e3 * kernel / calls}


def perf_model_of(s_points: tuple, r_points: dict, meta: dict):
    """A PerfModel from measured T(B), H(B) and R points (medians), as build_perf_model fits them."""
    from fastdecode.perfmodel import Curve, PerfModel, fit_line

    t_pts, h_pts, shape = s_points
    r0, r = fit_line(list(r_points), [v[0] for v in r_points.values()])
    note = None
    if r <= 0:
        note = f"R did not grow with context ({r_points}): slope clamped"
        r = 1e-12
    pm = PerfModel(shape["num_layers"], Curve.of({b: v[0] for b, v in t_pts.items()}),
                   Curve.of({b: v[0] for b, v in h_pts.items()}), r, max(r0, 0.0), meta)
    return pm, note


def check_steps(pm, trace: list[dict], batch: int, minibatches: int = 2) -> dict:
    """Full-batch decode steps of a trace against pm.step_time as `plan` predicts it (pipelined)."""
    decode = [r for r in trace if not r["num_prefill"] and r["batch_size"] == batch]
    if not decode:
        return {"error": f"no full-batch (B={batch}) decode step"}
    measured = statistics.median(r["step_time"] for r in decode)
    ctx_tokens = statistics.median(r["context_tokens"] for r in decode)
    predicted = pm.step_time(batch, ctx_tokens, 1, minibatches, overlap=True)
    serial = pm.step_time(batch, ctx_tokens, 1, minibatches, overlap=False)
    return {"measured_step_ms": 1e3 * measured, "predicted_step_ms": 1e3 * predicted,
            "predicted_serial_step_ms": 1e3 * serial, "context_tokens": ctx_tokens, "steps": len(decode),
            "rel_error": abs(predicted - measured) / measured}


def r_points_through(backend, batch: int, prompt: int, gen: int, repeats: int) -> dict:
    """R-Part seconds (median, min) of one call through a live backend (all its R-workers as one)
    for a mini-batch of a `batch` run: batch/2 sequences at the contexts of its first, middle and
    last decode steps (a call's fixed cost grows with its sequences: measured where it is used)."""
    from fastdecode.perf_measure import measure_r_backend

    seqs = max(1, batch // 2)
    contexts = sorted({seqs * prompt, seqs * (prompt + gen // 2), seqs * (prompt + gen)})
    return measure_r_backend(backend, contexts, num_seqs=seqs, repeats=repeats)


def ms_points(points: dict) -> dict:
    return {str(int(k)): round(v[0] * 1e3, 4) for k, v in points.items()}


# --- part: models ----------------------------------------------------------------------------------

def write_tokenizer(out: Path, source: Path | None) -> None:
    """The default model's tokenizer files when they are here, else the tiny test tokenizer
    (ids past its vocabulary decode to nothing: only timing is measured)."""
    if source is not None and (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
        return
    from fastdecode.testing import make_tokenizer

    make_tokenizer().save_pretrained(out)


def random_llama(out: Path, device: str, tokenizer_from: Path | None, **shape) -> Path:
    """A Llama checkpoint of the given shape with random bf16 weights (initialised on `device`)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    gc.collect()
    write_tokenizer(out, tokenizer_from)
    return out


def default_model(ctx: Context) -> dict:
    """The default checkpoint when present; else a random-weight model of its exact shapes (step
    times depend on shapes only: the runs ignore EOS and generate fixed lengths), said so."""
    from fastdecode.config import DEFAULT_MODEL_DIR
    from fastdecode.testing import make_tiny_llama

    p = ctx.profile
    if p.cpu_smoke:
        path = make_tiny_llama(ctx.work_dir / "default", **p.tiny_default)
        return {"dir": str(path), "source": f"tiny random Llama {p.tiny_default} (cpu smoke)"}
    if (DEFAULT_MODEL_DIR / "config.json").is_file() and any(DEFAULT_MODEL_DIR.glob("*.safetensors")):
        return {"dir": str(DEFAULT_MODEL_DIR), "source": "checkpoint models/smollm2-135m-instruct"}
    path = random_llama(ctx.work_dir / "smollm2-135m-shapes", p.device, DEFAULT_MODEL_DIR, **SMOLLM2_135M)
    return {"dir": str(path), "source": "random bf16 weights with SmolLM2-135M-Instruct's shapes "
                                        "(the checkpoint is not on this machine)"}


def models_part(ctx: Context, budget: Budget) -> dict:
    p = ctx.profile
    ctx.models["default"] = default_model(ctx)
    shape = dict(p.seven_b_shape)
    path = random_llama(ctx.work_dir / "llama7b-shapes", p.device, None, **shape)
    ctx.models["7b_shape"] = {"dir": str(path), "source": f"random bf16 weights, Llama-7B layer shapes: {shape}"}
    return {name: dict(m) for name, m in ctx.models.items()}


def need_model(ctx: Context, name: str) -> str:
    if name not in ctx.models:
        raise RuntimeError(f"no {name} model: the models part did not run or failed")
    return ctx.models[name]["dir"]


# --- part: T(B) of the S-Part ----------------------------------------------------------------------

def s_part(ctx: Context, budget: Budget) -> dict:
    """T(B) per layer and H(B) per step of the engine's own S-Part code on the device."""
    from fastdecode.perf_measure import measure_s_part

    p = ctx.profile
    out = {}
    for name in ("default", "7b_shape"):
        if budget.expired():
            out[name] = {"skipped": "part budget spent"}
            continue
        t_pts, h_pts, shape = measure_s_part(need_model(ctx, name), p.t_batches, p.device, p.dtype, p.repeats,
                                             layers=2)
        ctx.s_points[name] = (t_pts, h_pts, shape)
        out[name] = {"T_ms_per_layer": ms_points(t_pts), "H_ms_per_step": ms_points(h_pts), "shape": shape}
        print(f"[s_part] {name}: T(B) ms/layer {out[name]['T_ms_per_layer']}", flush=True)
    return out


# --- part: R-Part per call on the CPU cores (the kernel, in-process) -------------------------------

def r_part(ctx: Context, budget: Budget) -> dict:
    """One layer's decode (append + attend) on one KVStore with an R-worker's threads."""
    from fastdecode.perf_measure import measure_r_part

    p = ctx.profile
    threads = rworker_threads(p)
    shapes = {"default": (p.default_heads, p.default_kv_heads, p.default_head_dim),
              "7b_shape": (p.seven_b_shape["num_attention_heads"], p.seven_b_shape["num_key_value_heads"],
                           p.seven_b_shape["hidden_size"] // p.seven_b_shape["num_attention_heads"])}
    out = {"threads": threads, "num_seqs": p.r_num_seqs}
    for name, (heads, kv_heads, head_dim) in shapes.items():
        points, impl = {}, None
        for c in p.r_contexts:
            if budget.expired():
                break
            pts, impl = measure_r_part(kv_heads, heads, head_dim, (c,), num_seqs=p.r_num_seqs, threads=threads,
                                       repeats=p.repeats)
            points.update(pts)
        out[name] = {"call_ms_by_context": ms_points(points), "impl": impl,
                     "ns_per_token": {str(k): 1e9 * v[0] / k for k, v in points.items()}}
        print(f"[r_part] {name}: call ms by context {out[name]['call_ms_by_context']} ({impl})", flush=True)
    return out


# --- part: our throughput at several batches, and the perf model against it -----------------------

def run_batch(engine, batch: int, prompt: int, gen: int, budget: Budget) -> tuple[dict, list[dict]]:
    """`batch` requests of `prompt` tokens generating `gen` each, all at once; tokens/s end to end."""
    from fastdecode.engine import SamplingParams
    from fastdecode.engine.throughput import synthetic_prompts

    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    first = engine.stats()["steps"]
    before = engine.backend.stats()
    start = time.perf_counter()
    requests = [engine.add_request(ids, params) for ids in synthetic_prompts(engine.tokenizer, batch, prompt)]
    generated = 0
    while engine.has_unfinished() and not budget.expired():
        generated += sum(len(o.token_ids) for o in engine.step())
    truncated = engine.has_unfinished()
    wall = time.perf_counter() - start
    if truncated:
        for rid in requests:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    trace = [r for r in engine.trace if r["step"] >= first]
    decode = [r for r in trace if not r["num_prefill"]]
    decode_time = sum(r["step_time"] for r in decode)
    out = {"batch": batch, "generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
           "decode_tokens_per_s": sum(r["batch_size"] for r in decode) / decode_time if decode_time else None,
           "median_decode_step_ms": 1e3 * statistics.median(r["step_time"] for r in decode) if decode else None,
           "truncated": truncated, **comm_share(before, engine.backend.stats())}
    return out, trace


def throughput_part(ctx: Context, budget: Budget) -> dict:
    from fastdecode.engine import Engine

    p = ctx.profile
    model_dir = need_model(ctx, "default")
    shape = shape_of(model_dir)
    top = max(p.tput_batches)
    out = {"prompt_tokens": p.tput_prompt, "gen_tokens": p.tput_gen, "rworkers": p.rworkers,
           "rworker_threads": rworker_threads(p), "runs": {}}
    traces = {}
    with rworker_fleet(ctx, top * (p.tput_prompt + p.tput_gen + 16), shape) as fleet:
        engine = Engine(engine_config(ctx, model_dir, fleet, max_running=top,
                                      max_prefill_tokens=max(4096, top * p.tput_prompt)))
        try:
            runs_budget = budget.less(p.model_check_reserve_s)
            run_batch(engine, min(p.tput_batches), p.tput_prompt, 4, runs_budget)        # warm-up
            for b in p.tput_batches:
                if runs_budget.expired():
                    out["runs"][str(b)] = {"skipped": "part budget spent"}
                    continue
                run, traces[b] = run_batch(engine, b, p.tput_prompt, p.tput_gen, runs_budget)
                out["runs"][str(b)] = run
                print(f"[throughput] B={b}: {run['tokens_per_s']:.0f} tok/s end to end, decode "
                      f"{run['decode_tokens_per_s'] or 0:.0f} tok/s, comm_share {run['comm_share']}", flush=True)
            out["model_check"] = guarded(lambda: model_check(ctx, "default", engine.backend, traces, budget,
                                                             p.tput_prompt, p.tput_gen))
        finally:
            engine.stop()
    return out


def guarded(fn) -> dict:
    """fn()'s dict, or its error: a sub-measurement that fails leaves its part's figures standing."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        return {"error": f"{type(e).__name__}: {e}"}


def model_check(ctx: Context, name: str, backend, traces: dict, budget: Budget, prompt: int, gen: int) -> dict:
    """The perf model (T, H from the s_part part; R through `backend`, measured for each batch)
    against the full-batch decode steps of each batch's trace."""
    if name not in ctx.s_points:
        raise RuntimeError(f"no T(B) for {name}: the s_part part did not measure it")
    checks = {}
    for b, trace in traces.items():
        if budget.expired():
            checks[str(b)] = {"skipped": "part budget spent"}
            continue
        r_pts = r_points_through(backend, b, prompt, gen, ctx.profile.repeats)
        pm, note = perf_model_of(ctx.s_points[name], r_pts, {"config": name, "device": ctx.profile.device})
        checks[str(b)] = {**check_steps(pm, trace, b), "R_call_ms_through_backend": ms_points(r_pts),
                          "r_per_token_ns": pm.r_per_token * 1e9, "r_fixed_ms": pm.r_fixed * 1e3, "note": note}
    errors = [c["rel_error"] for c in checks.values() if "rel_error" in c]
    return {"batches": checks, "rel_error_max": max(errors) if errors else None}


def shape_of(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"num_layers": cfg["num_hidden_layers"], "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads}


# --- part: FCFS and SLS end to end -----------------------------------------------------------------

def e2e_part(name: str):
    def part(ctx: Context, budget: Budget) -> dict:
        return run_e2e(ctx, name, budget)
    part.__name__ = f"e2e_{name}"
    return part


def step_interleaved(engines: dict, budget: Budget) -> bool:
    """Step the engines in turn until all are done; False when the budget ran out first."""
    while any(e.has_unfinished() for e in engines.values()):
        if budget.expired():
            return False
        for e in engines.values():
            if e.has_unfinished():
                e.step()
    return True


def run_e2e(ctx: Context, name: str, budget: Budget) -> dict:
    """FCFS and SLS on the same workload (2B+1 requests queued at once), engines stepped in turn
    against one fleet of R-workers (each engine its own connection, so its own KV namespace)."""
    import bench_sls
    from fastdecode.engine import Engine

    p = ctx.profile
    batch, prompt, gen, f = getattr(p, f"e2e_{name}")
    n = 2 * batch + 1
    model_dir = need_model(ctx, name)
    shape = shape_of(model_dir)
    out = {"model": ctx.models[name]["source"], "workload": {"requests": n, "max_running": batch,
                                                             "prompt_tokens": prompt, "gen_tokens": gen, "sls_f": f},
           "rworkers": p.rworkers, "rworker_threads": rworker_threads(p)}
    with rworker_fleet(ctx, 2 * batch * (prompt + gen + 16), shape) as fleet:
        base = engine_config(ctx, model_dir, fleet, max_running=batch, max_prefill_tokens=max(64, batch * prompt),
                             sls_f=f)
        engines = {}
        try:
            for policy in ("fcfs", "sls"):
                engines[policy] = Engine(base.replace(scheduler=policy))
                bench_sls.add_workload(engines[policy], n, prompt, gen)
            before = {k: e.backend.stats() for k, e in engines.items()}
            t = time.perf_counter()
            out["completed"] = step_interleaved(engines, budget.less(p.model_check_reserve_s))
            out["wall_s"] = time.perf_counter() - t
            traces = {k: e.trace for k, e in engines.items()}
            comm = {k: comm_share(before[k], e.backend.stats()) for k, e in engines.items()}
            out["model_check"] = guarded(lambda: model_check(ctx, name, engines["fcfs"].backend,
                                                             {batch: traces["fcfs"]}, budget, prompt, gen))
        finally:
            for e in engines.values():
                e.stop()
    out.update(analyse_policies(traces, n, gen))
    for k, c in comm.items():
        out["runs"][k].update(c)
    calls = sum(c["decode_calls"] for c in comm.values())
    out["comm_share"] = (sum(c["comm_share"] * c["decode_calls"] for c in comm.values() if c["comm_share"] is not None)
                         / calls) if calls and all(c["comm_share"] is not None for c in comm.values()) else None
    print(f"[e2e {name}] sls/fcfs steady max step {out.get('steady_max_step_latency_ratio')}, throughput "
          f"{out.get('throughput_ratio')}, comm_share {out['comm_share']}", flush=True)
    return out


def analyse_policies(traces: dict, n: int, gen: int) -> dict:
    """bench/bench_sls.py's steady-state ratios, and each policy's tokens/s and S/R/wait split."""
    import bench_sls
    from fastdecode.trace import summarize

    windows = {k: bench_sls.steady_window(t, n, gen) for k, t in traces.items()}
    length = min(b - a for a, b in windows.values())
    runs, steady = {}, {}
    for policy, trace in traces.items():
        first = windows[policy][0]
        s = summarize(trace, warmup=first, cooldown=len(trace) - first - length)
        steady[policy] = s.get("steady")
        runs[policy] = {"steps": s["steps"], "tokens_per_s": s["throughput_tok_s"],
                        "wall_tokens_per_s": s.get("wall_throughput_tok_s"), "steady_window": [first, first + length],
                        "steady": steady[policy], "step_split_ms": step_split(trace[first:first + length] or trace),
                        "steady_peak_load_step_ms": ms(bench_sls.peak_load_step(trace[first:first + length]))}
    out = {"runs": runs, "steady_max_step_latency_ratio": None, "throughput_ratio": None}
    f_s, s_s = steady["fcfs"], steady["sls"]
    if f_s and s_s and length > 0:
        out["steady_max_step_latency_ratio"] = bench_sls.paired_peak_ratio(
            traces["fcfs"], traces["sls"], runs["fcfs"]["steady_window"], runs["sls"]["steady_window"])
        out["throughput_ratio"] = s_s["throughput_tok_s"] / f_s["throughput_tok_s"]
        out["steady_p99_step_latency_ratio"] = s_s["p99_step_time_s"] / f_s["p99_step_time_s"]
        out["steady_max_context_ratio"] = s_s["max_context_tokens"] / f_s["max_context_tokens"]
    return out


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def step_split(records: list[dict]) -> dict:
    """Mean milliseconds per step: S-Part busy, R-Part busy, S waiting on R, the whole step."""
    def mean(key: str) -> float | None:
        vals = [r.get(key) for r in records]
        return None if not vals or any(v is None for v in vals) else 1e3 * statistics.fmean(vals)
    return {k: mean(k) for k in ("s_time", "r_time", "s_wait", "step_time")}


# --- part: transformers generate() with its KV-cache on the device ---------------------------------

def hf_part(ctx: Context, budget: Budget) -> dict:
    """generate() at our batches, then doubling until out of memory (or the cap, or the budget)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastdecode.engine.throughput import synthetic_prompts

    p = ctx.profile
    model_dir = need_model(ctx, "default")
    gc.collect()
    if p.device.startswith("cuda"):
        torch.cuda.empty_cache()                           # what earlier parts' engines left cached
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, p.dtype)).to(p.device).eval()
    out = {"dtype": p.dtype, "prompt_tokens": p.tput_prompt, "gen_tokens": p.tput_gen, "runs": {}}

    def generate(batch: int, new_tokens: int) -> float:
        ids = torch.tensor(synthetic_prompts(tokenizer, batch, p.tput_prompt), device=p.device)
        sync(p.device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        sync(p.device)
        return time.perf_counter() - t

    generate(min(p.tput_batches), 2)                       # warm-up
    last = None                                            # (batch, seconds) of the last run
    for b in hf_batches(p):
        if last and last[1] * b / last[0] * 1.2 > budget.left():
            out["stopped"] = f"part budget: B={b} would take ~{last[1] * b / last[0]:.0f} s"
            break
        try:
            seconds = generate(b, p.tput_gen)
        except Exception as e:  # noqa: BLE001 - the batches measured so far stand
            oom = isinstance(e, torch.OutOfMemoryError) or any(s in str(e) for s in OOM_MESSAGES)
            out["runs"][str(b)] = {"oom": True} if oom else {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            out["stopped"] = f"out of memory at B={b}" if oom else f"error at B={b}: {type(e).__name__}"
            break
        finally:
            gc.collect()
            if p.device.startswith("cuda"):
                torch.cuda.empty_cache()
        last = (b, seconds)
        out["runs"][str(b)] = {"wall_s": seconds, "tokens_per_s": b * p.tput_gen / seconds}
        print(f"[hf] B={b}: {b * p.tput_gen / seconds:.0f} tok/s", flush=True)
    fits = [int(b) for b, r in out["runs"].items() if "tokens_per_s" in r]
    out["largest_batch_run"] = max(fits, default=None)
    out["best_batch"] = max(fits, key=lambda b: out["runs"][str(b)]["tokens_per_s"], default=None)
    out["best_tokens_per_s"] = out["runs"][str(out["best_batch"])]["tokens_per_s"] if fits else None
    del model
    gc.collect()
    return out


def hf_batches(p) -> list[int]:
    """Our batches, then doubling past the largest up to the cap."""
    batches = sorted(set(p.tput_batches))
    b = batches[-1] * 2
    while b <= p.hf_batch_cap:
        batches.append(b)
        b *= 2
    return batches
