"""`python -m fastdecode plan` (`make plan`): measure T(B) and R, choose B, R-workers, F and W_lim.

Writes {"settings": {...}, "plan": {...}, "perf_model": {...}}; "settings" are EngineConfig
settings (max_running, scheduler, sls_f, sls_w_lim, sls_target_len, num_minibatches), which a
Triton model takes with the `plan` parameter.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fastdecode.perf_measure import build_perf_model
from fastdecode.perfmodel import DEFAULT_BATCHES, PerfModel, plan, settings_from_plan

def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return v
    return parse


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return tuple(sorted(set(vals)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastdecode plan",
                                description="Measure T(B) and R, then choose B, R-workers, F and W_lim.")
    p.add_argument("--model", required=True, help="model directory (config.json)")
    p.add_argument("--latency-budget", type=_positive(float), default=None, metavar="MS",
                   help="per-sequence latency budget L in ms (2*N*S*T(B) <= L); default: knee of B/T(B)")
    p.add_argument("--seq-len", type=_positive(int), default=1024, metavar="S", help="target sequence length")
    p.add_argument("--out", default="bench/results/plan.json", help="plan JSON to write")
    p.add_argument("--perf", default=None, metavar="FILE", help="reuse a measured perf model JSON")
    p.add_argument("--perf-out", default=None, metavar="FILE", help="also write the measured perf model here")
    p.add_argument("--device", default="auto", help="S-worker device: auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--batches", type=_int_list, default=DEFAULT_BATCHES, help="batch sizes to measure")
    p.add_argument("--max-batch", type=_positive(int), default=None,
                   help="largest B per mini-batch to consider (default: the largest measured)")
    p.add_argument("--num-minibatches", type=int, choices=(1, 2), default=2)
    p.add_argument("--rworker-threads", type=int, default=0, help="kernel threads of one R-worker (0 = all)")
    p.add_argument("--repeats", type=_positive(int), default=5)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":
        argv = argv[1:]
    args = parser().parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"plan: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if args.perf:
        try:
            pm = PerfModel.load(args.perf)
        except (OSError, ValueError) as e:
            print(f"plan: cannot read perf model {args.perf}: {e}", file=sys.stderr)
            return 2
    else:
        device = args.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = args.dtype if args.dtype != "auto" else ("float16" if device.startswith("cuda") else "float32")
        pm = build_perf_model(args.model, device, dtype, args.batches, threads=args.rworker_threads,
                              repeats=args.repeats)
        if args.perf_out:
            pm.save(args.perf_out)
    try:
        p = plan(pm, args.seq_len, None if args.latency_budget is None else args.latency_budget / 1e3,
                 args.max_batch, args.num_minibatches)
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    result = {"settings": settings_from_plan(p), "plan": p, "perf_model": pm.to_dict()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"S-worker {pm.meta.get('device', '?')} {pm.meta.get('dtype', '')}: T(B={p['batch_per_minibatch']}) = "
          f"{p['T_B_ms']:.3f} ms/layer, R = {p['R_ns_per_token']:.2f} ns/token/layer ({pm.meta.get('r_backend', '?')})")
    print(f"B = {p['batch_per_minibatch']} per mini-batch x {p['num_minibatches']} = max_running "
          f"{p['max_running']} ({p['rule']})")
    print(f"R-workers P = {p['rworkers']} (exact {p['rworkers_exact']:.2f}); SLS F = {p['sls_f']}, "
          f"W_lim = {p['sls_w_lim']}; predicted {p['predicted_tokens_per_s']:.0f} tokens/s, "
          f"step {p['predicted_step_ms_mean']:.1f} ms (peak {p['predicted_step_ms_peak']:.1f} ms)")
    print(f"settings: {json.dumps(result['settings'])}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
