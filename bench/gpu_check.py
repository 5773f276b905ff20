"""The paper's configuration on a GPU machine, in one run (issue #19): `make gpu-check`.

    python bench/gpu_check.py [--budget-s 440] [--out bench/results/gpu.json] [--parts a,b] [--set key=value]
    python bench/gpu_check.py --cpu-smoke --out /tmp/gpu.json      # every part, tiny, on the CPU

Builds what it needs (the kernel extension and the gRPC stubs, for this Python), then, in order:
  models       the default checkpoint (or, where it is not on the machine, random bf16 weights
               of its shapes, said so) and a 2-layer Llama-7B-shaped model with random bf16 weights;
  s_part       T(B) per layer and H(B) of the engine's S-Part on the GPU, B = 1..4096, for both;
  r_part       one layer's decode call on the kernel with an R-worker's threads (CPU);
  e2e_default, e2e_7b_shape
               FCFS and SLS on the same queued workload, S-Part on the GPU and 2 local R-workers
               on the host's cores: tokens/s, the per-step S/R/wait split, comm_share, the SLS
               steady-state ratios (bench/bench_sls.py's method), the perf model against the
               FCFS full-batch steps;
  throughput   our engine end to end at several batches, and the perf model against those steps;
  hf           transformers generate() with its KV-cache on the GPU at our batches, then
               doubling until out of memory;
and writes the JSON (after every part, so a run cut short keeps what it measured) with the
issue's bars, pass or fail, and prints a short table.

Time: --budget-s covers the whole run, build included; each part has its own cap (the
profile's budget_* fields) and a part that raises or overruns is recorded and the next one
runs. A watchdog writes the JSON and exits 3 if the run overruns the budget by --grace-s.
Exit status: 0 when every part ran without error (bars may still fail: they are results),
1 when some part failed, 2 for bad arguments. Without a GPU (and no --cpu-smoke): a message, 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_parts import (Budget, Context, e2e_part, hf_part, models_part, r_part, s_part,  # noqa: E402
                       throughput_part)

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu.json"
NO_GPU_MESSAGE = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure. " \
                 "--cpu-smoke runs every part on the CPU at tiny sizes."
MACHINE_KEYS = ("gpu", "cpu_model", "cores", "torch_version", "commit", "date")
SUMMARY_KEYS = ("sls_config", "sls_config_why", "sls_steady_max_step_latency_ratio", "sls_throughput_ratio",
                "comm_share", "comm_share_default", "comm_share_7b_shape", "tokens_per_s", "step_split_ms",
                "speedup_vs_hf_gpu", "speedup_vs_hf_gpu_same_batch", "perfmodel_error_max", "bars", "parts",
                "parts_failed")
BARS = {"comm_share": ("<=", 0.15), "sls_steady_max_step_latency_ratio": ("<=", 0.75),
        "sls_throughput_ratio": (">=", 1.05), "speedup_vs_hf_gpu": (">=", 2.0), "perfmodel_error_max": ("<=", 0.2)}


@dataclass
class Profile:
    """Sizes and per-part budgets (seconds). `--set key=value` overrides any field."""
    name: str = "gpu"
    cpu_smoke: bool = False
    device: str = "cuda"
    dtype: str = "bfloat16"
    repeats: int = 5
    t_batches: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    seven_b_shape: dict = field(default_factory=lambda: dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096))
    tiny_default: dict = field(default_factory=dict)          # cpu smoke: make_tiny_llama's arguments
    default_heads: int = 9                                     # SmolLM2-135M: 9 heads of 64, 3 KV heads
    default_kv_heads: int = 3
    default_head_dim: int = 64
    rworkers: int = 2
    rworker_threads: int = 0                                   # 0: (cores - s_worker_cores) / rworkers
    s_worker_cores: int = 2
    r_contexts: tuple = (16384, 65536, 262144)
    r_num_seqs: int = 64
    tput_batches: tuple = (64, 256, 1024, 4096)
    tput_prompt: int = 32
    tput_gen: int = 128
    hf_batch_cap: int = 65536
    e2e_default: tuple = (256, 16, 128, 8)                     # max_running, prompt, gen, SLS F
    e2e_7b_shape: tuple = (128, 32, 384, 12)
    model_check_reserve_s: float = 12.0
    # caps (a part that finishes early leaves its time unused); they add up to 410 s
    budget_build: float = 90.0                                 # spent only where the build is missing
    budget_models: float = 30.0
    budget_s_part: float = 25.0
    budget_r_part: float = 15.0
    budget_e2e_default: float = 60.0                           # FCFS's steady window ends near step 2*gen
    budget_e2e_7b_shape: float = 80.0
    budget_throughput: float = 60.0
    budget_hf: float = 50.0


def cpu_smoke_profile() -> Profile:
    return Profile(
        name="cpu-smoke", cpu_smoke=True, device="cpu", dtype="float32", repeats=2, t_batches=(1, 2, 4, 8),
        seven_b_shape=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=320, max_position_embeddings=512),
        tiny_default=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
        default_heads=4, default_kv_heads=2, default_head_dim=16, rworker_threads=1, s_worker_cores=1,
        r_contexts=(256, 1024, 4096), r_num_seqs=8, tput_batches=(2, 4), tput_prompt=4, tput_gen=6,
        hf_batch_cap=8, e2e_default=(4, 4, 8, 2), e2e_7b_shape=(4, 4, 8, 2), model_check_reserve_s=1.0,
        # caps, not targets: each part takes 1-4 s here; the caps leave room on a loaded machine
        budget_build=30.0, budget_models=30.0, budget_s_part=10.0, budget_r_part=5.0, budget_throughput=15.0,
        budget_hf=10.0, budget_e2e_default=15.0, budget_e2e_7b_shape=15.0)


def apply_overrides(profile: Profile, pairs: list[str]) -> Profile:
    """`key=value` pairs onto the profile; the value is parsed as the field's current type."""
    fields = {f.name: f for f in dataclasses.fields(profile)}
    changes = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in fields or key in ("name", "cpu_smoke"):
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY one of "
                             f"{sorted(k for k in fields if k not in ('name', 'cpu_smoke'))}")
        current = getattr(profile, key)
        try:
            changes[key] = parse_like(current, text)
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"--set {pair!r}: not a valid {type(current).__name__}: {e}") from None
        if key.startswith("e2e_") and len(changes[key]) != 4:
            raise ValueError(f"--set {pair!r}: need 4 integers: max_running,prompt,gen,sls_f")
    return dataclasses.replace(profile, **changes)


def parse_like(current, text: str):
    if isinstance(current, bool):
        raise ValueError("not settable")
    if isinstance(current, tuple):
        values = tuple(int(x) for x in text.split(",") if x.strip())
        if not values or min(values) < 1:
            raise ValueError("need integers >= 1, comma-separated")
        return values
    if isinstance(current, dict):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("need a JSON object")
        return value
    value = type(current)(text)
    if isinstance(value, (int, float)) and value < 0:
        raise ValueError("must be >= 0")
    return value


# --- the build ----------------------------------------------------------------------------------

# `setup.py -q build_ext --inplace --force` (the Makefile's build) with every source compiled in
# parallel where torch finds no ninja, and, where grpc_tools is missing but the stubs exist, the
# protoc call skipped.
BUILD = """import runpy, subprocess, sys
from pybind11.setup_helpers import ParallelCompile
ParallelCompile(default=0).install()
if {skip_protoc}:
    real = subprocess.check_call
    subprocess.check_call = lambda cmd, **kw: 0 if "grpc_tools.protoc" in cmd else real(cmd, **kw)
sys.argv = ["setup.py", "-q", "build_ext", "--inplace", "--force"]
runpy.run_path("setup.py", run_name="__main__")
"""
NEEDED_MODULES = {"kernels": "rpart._kernels", "proto": "rpart.proto.rworker_pb2_grpc"}


def importable(module: str) -> bool:
    """Whether this Python imports `module`, asked in a fresh process (nothing stale stays loaded here)."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True).returncode == 0


def build_part(ctx: Context, budget: Budget) -> dict:
    status = {name: importable(mod) for name, mod in NEEDED_MODULES.items()}
    if all(status.values()):
        return {"built": False, "why": "already importable", **status}
    if ctx.profile.cpu_smoke:
        raise RuntimeError(f"not built here ({status}); the smoke run only checks: run `make build`")
    has_protoc = importable("grpc_tools.protoc")
    if not status["proto"] and not has_protoc:
        raise RuntimeError("the gRPC stubs are missing and grpc_tools is not installed (pip install grpcio-tools)")
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    if ctx.profile.device.startswith("cuda"):
        env["FASTDECODE_NO_SPART_OPS"] = "1"                  # the CPU's fused S-Part ops: not used here
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", BUILD.format(skip_protoc=not has_protoc)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=max(1.0, budget.left()))
    if done.returncode != 0:
        raise RuntimeError(f"setup.py build_ext failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    status = {name: importable(mod) for name, mod in NEEDED_MODULES.items()}
    if not all(status.values()):
        raise RuntimeError(f"built, yet not importable: {status}")
    return {"built": True, "seconds": time.perf_counter() - t, "protoc": has_protoc, **status}


# --- the machine --------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def machine(commit: str | None) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
            "cpu_model": cpu_model(), "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "transformers_version": transformers.__version__, "python": platform.python_version(),
            "commit": commit or git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": platform.node()}


# --- running the parts --------------------------------------------------------------------------

PARTS = {"build": build_part, "models": models_part, "s_part": s_part, "r_part": r_part,
         "e2e_default": e2e_part("default"), "e2e_7b_shape": e2e_part("7b_shape"), "throughput": throughput_part,
         "hf": hf_part}


class Run:
    """The results so far and where they go: written after every part, and by the watchdog."""

    def __init__(self, out: Path, head: dict) -> None:
        self.out = out
        self.results = {**head, "parts": {}}
        self.current: str | None = None
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            text = json.dumps(summarize(self.results), indent=1, default=str) + "\n"
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out)


def run_parts(run: Run, parts: dict, ctx: Context, budgets: dict, global_deadline: float) -> None:
    """Each part in turn under its budget; an exception is recorded and the next part runs."""
    for name, part in parts.items():
        entry = run.results["parts"][name] = {"status": "running"}
        if time.monotonic() >= global_deadline:
            entry.update(status="skipped", error="global time budget spent")
            run.write()
            continue
        budget = Budget(budgets.get(name, 60.0), global_deadline)
        run.current = name
        print(f"== {name} (budget {budget.left():.0f} s)", flush=True)
        try:
            entry["result"] = part(ctx, budget)
            entry["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            entry.update(status="error", error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc(limit=8).splitlines()[-12:])
            print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
        entry["seconds"] = round(budget.spent(), 2)
        run.current = None
        run.write()


def start_watchdog(run: Run, ctx: Context, deadline: float) -> threading.Timer:
    """At `deadline` (the budget and its grace): write what there is, kill the R-workers we started, exit 3."""
    seconds = deadline - time.monotonic()

    def fire() -> None:
        if run.current:
            run.results["parts"][run.current].update(status="error", error="watchdog: overran the time budget")
        run.results["watchdog"] = f"fired at the budget and its grace ({seconds:.0f} s after it was set)"
        try:
            run.write()
        finally:
            for fleet in list(ctx.fleets):
                for pid in fleet.pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            print(f"gpu_check: watchdog: past the budget and its grace; wrote {run.out}", file=sys.stderr, flush=True)
            os._exit(3)
    timer = threading.Timer(max(0.0, seconds), fire)
    timer.daemon = True
    timer.start()
    return timer


# --- the summary ----------------------------------------------------------------------------------

def part_result(results: dict, name: str) -> dict:
    return (results.get("parts", {}).get(name) or {}).get("result") or {}


def sls_headline(results: dict) -> tuple[str | None, str]:
    """The default model's SLS ratios; the 7B-shaped run's where the default misses a bar and it meets both."""
    default, seven = part_result(results, "e2e_default"), part_result(results, "e2e_7b_shape")

    def passes(r: dict) -> bool:
        lat, tput = r.get("steady_max_step_latency_ratio"), r.get("throughput_ratio")
        return lat is not None and tput is not None and lat <= BARS["sls_steady_max_step_latency_ratio"][1] \
            and tput >= BARS["sls_throughput_ratio"][1]

    if passes(default):
        return "default", "the default model"
    if passes(seven):
        return "7b_shape", ("the 7B-shaped S-Part: on the default model the R-Part is too small a share of a step "
                            "for SLS to show" if default.get("steady_max_step_latency_ratio") else
                            "the 7B-shaped S-Part: the default model's run has no ratios")
    for name, r in (("default", default), ("7b_shape", seven)):
        if r.get("steady_max_step_latency_ratio") is not None:
            return name, f"the {name} run (neither run meets both SLS bars)"
    return None, "no end-to-end run produced the ratios"


def speedup(results: dict) -> dict:
    ours = {int(b): r["tokens_per_s"] for b, r in part_result(results, "throughput").get("runs", {}).items()
            if "tokens_per_s" in r and not r.get("truncated")}
    hf = part_result(results, "hf")
    theirs = {int(b): r["tokens_per_s"] for b, r in hf.get("runs", {}).items() if "tokens_per_s" in r}
    same = {str(b): ours[b] / theirs[b] for b in sorted(ours.keys() & theirs.keys())}
    best = max(ours.values()) / max(theirs.values()) if ours and theirs else None
    return {"speedup_vs_hf_gpu": best, "speedup_vs_hf_gpu_same_batch": same,
            "ours_best_batch": max(ours, key=ours.get) if ours else None,
            "ours_best_tokens_per_s": max(ours.values()) if ours else None,
            "hf_best_batch": hf.get("best_batch"), "hf_best_tokens_per_s": hf.get("best_tokens_per_s"),
            "hf_largest_batch_run": hf.get("largest_batch_run"), "hf_stopped": hf.get("stopped")}


def perfmodel_errors(results: dict) -> dict:
    checks = {name: (part_result(results, name).get("model_check") or {})
              for name in ("throughput", "e2e_default", "e2e_7b_shape")}
    errors = {name: c.get("rel_error_max") for name, c in checks.items()}
    known = {n: e for n, e in errors.items() if e is not None}
    return {"perfmodel_error_max": max(known.values()) if known else None,
            "perfmodel_error_max_at": max(known, key=known.get) if known else None,
            "perfmodel_error_by_check": errors}


def summarize(results: dict) -> dict:
    """The top-level figures and the bars, from the parts' results."""
    head, why = sls_headline(results)
    e2e = {n: part_result(results, f"e2e_{n}") for n in ("default", "7b_shape")}
    top = {"sls_config": head, "sls_config_why": why,
           "sls_steady_max_step_latency_ratio": e2e[head].get("steady_max_step_latency_ratio") if head else None,
           "sls_throughput_ratio": e2e[head].get("throughput_ratio") if head else None,
           "comm_share": e2e[head].get("comm_share") if head else None,
           "comm_share_default": e2e["default"].get("comm_share"),
           "comm_share_7b_shape": e2e["7b_shape"].get("comm_share"),
           "tokens_per_s": {n: {p: r.get("tokens_per_s") for p, r in e2e[n].get("runs", {}).items()} for n in e2e},
           "step_split_ms": {n: {p: r.get("step_split_ms") for p, r in e2e[n].get("runs", {}).items()} for n in e2e},
           **speedup(results), **perfmodel_errors(results)}
    top["bars"] = {k: bar(top[k], *BARS[k]) for k in BARS}
    failed = [n for n, p in results.get("parts", {}).items() if p.get("status") not in ("ok", "running")]
    return {**results, **top, "parts_failed": failed}


def bar(value, op: str, target: float) -> dict:
    ok = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"value": value, "target": f"{op} {target}", "pass": ok}


def table(summary: dict) -> str:
    lines = [f"{'bar':38} {'value':>10} {'target':>9}  result"]
    for key, b in summary["bars"].items():
        value = "-" if b["value"] is None else f"{b['value']:.3f}"
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[b["pass"]]
        lines.append(f"{key:38} {value:>10} {b['target']:>9}  {verdict}")
    lines.append(f"SLS figures from: {summary['sls_config_why']}")
    for name, tput in summary["tokens_per_s"].items():
        if tput:
            lines.append(f"e2e {name}: tokens/s " + ", ".join(f"{p} {v:.0f}" for p, v in tput.items() if v))
    if summary.get("ours_best_tokens_per_s") and summary.get("hf_best_tokens_per_s"):
        lines.append(f"ours best {summary['ours_best_tokens_per_s']:.0f} tok/s at B={summary['ours_best_batch']}; "
                     f"transformers best {summary['hf_best_tokens_per_s']:.0f} tok/s at B={summary['hf_best_batch']}")
    for name, p in summary["parts"].items():
        lines.append(f"part {name:14} {p.get('status'):8} {p.get('seconds', 0):7.1f} s  {p.get('error', '')[:90]}")
    return "\n".join(lines)


# --- the command line -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=positive_float, default=440.0, help="the whole run, build included")
    p.add_argument("--grace-s", type=positive_float, default=30.0, help="past the budget: the watchdog")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON to write")
    p.add_argument("--parts", type=part_list, default=list(PARTS), help=f"comma-separated subset of {list(PARTS)}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile field, e.g. --set tput_batches=64,256 --set budget_hf=90")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--cpu-smoke", action="store_true", help="every part on the CPU at tiny sizes (no GPU needed)")
    args = p.parse_args(argv)
    try:
        args.profile = apply_overrides(cpu_smoke_profile() if args.cpu_smoke else Profile(), args.overrides)
    except ValueError as e:
        p.error(str(e))
    return args


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def part_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or text!r}; choose from {list(PARTS)}")
    return [n for n in PARTS if n in names]                     # in the run's order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0
    t0 = time.monotonic()
    profile = args.profile
    torch.set_num_threads(max(1, profile.s_worker_cores))
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(profile=profile, work_dir=work_dir)
    run = Run(Path(args.out), {"bench": "gpu_check", "profile": dataclasses.asdict(profile),
                               "budget_s": args.budget_s, "bars_from": "issue #19", **machine(args.commit)})
    watchdog = start_watchdog(run, ctx, t0 + args.budget_s + args.grace_s)
    budgets = {name: getattr(profile, f"budget_{name}") for name in PARTS}
    try:
        run_parts(run, {n: PARTS[n] for n in args.parts}, ctx, budgets, t0 + args.budget_s)
    finally:
        watchdog.cancel()
        shutil.rmtree(work_dir, ignore_errors=True)
    run.results["wall_s"] = round(time.monotonic() - t0, 1)
    run.write()
    summary = summarize(run.results)
    print(table(summary))
    print(f"wrote {run.out} in {run.results['wall_s']:.0f} s")
    return 1 if summary["parts_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
