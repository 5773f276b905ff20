"""Decode step time of the default model: remote backend (2 local R-workers over loopback)
versus the in-process local backend, in one run; and the share of the remote attention
time spent outside the kernel.

    make bench-rworker            # or: python bench/bench_rworker.py [--batches 128 512] [--context N]

Each batch: open B sequences, fill their KV with `context` tokens of synthetic k, v per
layer (prefilling real prompts on 2 CPU cores would take minutes and does not change
what a decode step costs), then time `steps` decode steps of the real model (S-Part in
torch, R-Part in the backend, two ping-pong mini-batches). Figures are medians over steps.

comm_share (remote only) = 1 - sum(kernel_s) / sum(call_s) over every decode attention call,
where call_s is the wall time from submit_decode() until its future resolves (conversion,
serialisation, transport both ways, queueing on the worker, deserialisation) and kernel_s is
the time the slowest worker of that call spent inside KVStore.decode, measured on the
worker and returned in the reply (worker_handler_ms: the worker's whole handling of the
call, parsing and reply building included; client_submit_ms: the S-worker's conversion,
row gathering and serialisation inside submit_decode). It is measured twice: in the pipelined run (the other
mini-batch's S-Part competes with the workers for the same 2 cores, so "waiting" includes
CPU contention), and with one mini-batch (`comm_share_unpipelined`), where the S-worker idles
during each call and the share is serialisation + transport + worker-side overhead alone.

per_call (no model, no S-Part): one client calls submit_decode() for one layer of a 2-layer
KV-cache with the model's head shape, against fresh fleets of 1 and 2 R-workers, at each batch
and at context 256 and 1024, and splits each call with perf_counter_ns stamps (CLOCK_MONOTONIC,
comparable across processes on one host) taken by the client (RemoteAttention.call_trace) and
the worker (Reply.recv_ns / reply_ns): client_encode (conversion, row gathering, message
building), to_worker (queue to gRPC's sender thread, HTTP/2 over loopback, parse, hand-off to
the stream's handler thread), worker_other (handler time outside the kernel), kernel,
back (reply serialisation, transport, client parse, reader thread wake-up), client_decode (o
into the output tensor), future_handoff (future resolved -> caller awake). Medians over calls.
On this shared 2-core machine every hop also waits for a core: the stamps tell where.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdecode.attention import create_backend  # noqa: E402
from fastdecode.attention.base import KVSpec  # noqa: E402
from fastdecode.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from fastdecode.engine.model_runner import ModelRunner, StepTimes  # noqa: E402
from fastdecode.model.loader import load_model  # noqa: E402
from fastdecode.ops.testing import local_fleet  # noqa: E402

RESULT = ROOT / "bench" / "results" / "rworker.json"


def fill_kv(backend, spec: KVSpec, seq_ids: list[int], context: int, gen: torch.Generator) -> None:
    """Open the sequences and give each `context` tokens of KV in every layer (the same random
    block everywhere: the values do not change what attention costs)."""
    backend.open(seq_ids)
    chunk = max(1, 16384 // context)                      # sequences per prefill call
    k = torch.randn(chunk * context, spec.num_kv_heads, spec.head_dim, generator=gen)
    v = torch.randn(chunk * context, spec.num_kv_heads, spec.head_dim, generator=gen)
    for a in range(0, len(seq_ids), chunk):
        ids = seq_ids[a:a + chunk]
        n = len(ids) * context
        for layer in range(spec.num_layers):
            backend.prefill(layer, ids, [context] * len(ids), k[:n], v[:n])


def time_decode(model, backend, spec, batch: int, context: int, steps: int, minibatches: int,
                warmup: int = 2) -> dict:
    gen = torch.Generator().manual_seed(0)
    seq_ids = list(range(1, batch + 1))
    fill_kv(backend, spec, seq_ids, context, gen)
    runner = ModelRunner(model, backend, "cpu", minibatches)
    tokens = torch.randint(0, model.args.vocab_size, (batch,), generator=gen).tolist()
    times, r_busy, s_wait = [], [], []
    before = backend.stats()
    for step in range(warmup + steps):
        if step == warmup:
            before = backend.stats()
            getattr(backend, "call_trace", []).clear()
        positions = [context + step] * batch
        runner.times = StepTimes()
        t = time.perf_counter()
        with torch.inference_mode():
            res = runner.decode(seq_ids, tokens, positions)
        dt = time.perf_counter() - t
        assert not res.lost and not res.out_of_kv, "a benchmark step lost sequences"
        tokens = res.logits.argmax(-1).tolist()
        if step >= warmup:
            times.append(dt)
            r_busy.append(runner.times.r_busy())
            s_wait.append(runner.times.s_wait)
    after = backend.stats()
    trace = list(getattr(backend, "call_trace", []))
    backend.close(seq_ids)
    out = {"step_s": statistics.median(times), "step_s_all": [round(x, 4) for x in times],
           "r_busy_s": statistics.median(r_busy), "s_wait_s": statistics.median(s_wait)}
    if "decode_calls" in after:
        calls = after["decode_calls"] - before["decode_calls"]
        wall = after["decode_wall_s"] - before["decode_wall_s"]
        kernel = after["decode_kernel_s"] - before["decode_kernel_s"]
        handler = after["decode_handler_s"] - before["decode_handler_s"]
        submit = after["decode_submit_s"] - before["decode_submit_s"]
        out.update(calls=calls, call_ms=1e3 * wall / calls, kernel_ms=1e3 * kernel / calls,
                   worker_handler_ms=1e3 * handler / calls, client_submit_ms=1e3 * submit / calls,
                   comm_share=1.0 - kernel / wall, breakdown_us=breakdown(trace))
    return out


def _median_us(xs) -> float:
    return round(statistics.median(xs) / 1e3, 1)


def breakdown(trace: list[dict], woke_ns: list[int] | None = None) -> dict:
    """Median per-call split (microseconds) of RemoteAttention.call_trace records; with several
    workers the slowest part (the last reply read) is the one the call waited for."""
    rows = []
    for c in trace:
        last = max(c["parts"], key=lambda p: p[3])            # (recv_ns, reply_ns, kernel_s, read_ns, decoded_ns)
        rows.append(dict(total=c["done_ns"] - c["submit_ns"], client_encode=c["encoded_ns"] - c["submit_ns"],
                         to_worker=last[0] - c["encoded_ns"], kernel=last[2] * 1e9,
                         worker_other=last[1] - last[0] - last[2] * 1e9, back=last[3] - last[1],
                         client_decode=last[4] - last[3], gather_wait=c["done_ns"] - last[4]))
    out = {k: _median_us(r[k] for r in rows) for k in rows[0]} if rows else {}
    # Medians of the parts need not add up to the median total (contention gives heavy tails);
    # the means do (the parts telescope from submit to done).
    out["mean"] = {k: round(statistics.fmean(r[k] for r in rows) / 1e3, 1) for k in rows[0]} if rows else {}
    if woke_ns:
        out["future_handoff"] = _median_us([w - c["done_ns"] for w, c in zip(woke_ns, trace)])
    out["calls"] = len(rows)
    out["comm_share"] = round(1 - sum(r["kernel"] for r in rows) / sum(r["total"] for r in rows), 3) if rows else None
    return out


def per_call(spec: KVSpec, batches, contexts, workers_list, iters: int, threads: int) -> dict:
    """submit_decode of one layer, one client, no S-Part: see the module docstring."""
    small = KVSpec(2, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    per_token = 2 * small.num_layers * small.num_kv_heads * small.head_dim * 2
    need = int(max(batches) * (max(contexts) + iters + 8) * per_token * 1.25) + (32 << 20)
    results = {}
    for nw in workers_list:
        with local_fleet(nw, tempfile.mkdtemp(prefix="bench_rworker_call_"), kv_capacity=need // nw + (32 << 20),
                         threads=threads) as fleet:
            cfg = EngineConfig(attention="remote", rworkers=fleet.addresses, rworker_timeout_s=60.0)
            backend = create_backend(cfg, small)
            try:
                for ctx in contexts:
                    for b in batches:
                        gen = torch.Generator().manual_seed(0)
                        seq_ids = list(range(1, b + 1))
                        fill_kv(backend, small, seq_ids, ctx, gen)
                        q = torch.randn(b, small.num_heads, small.head_dim, generator=gen)
                        k = torch.randn(b, small.num_kv_heads, small.head_dim, generator=gen)
                        v = torch.randn(b, small.num_kv_heads, small.head_dim, generator=gen)
                        woke = []
                        for i in range(iters + 3):
                            if i == 3:
                                backend.call_trace.clear()
                                woke.clear()
                            backend.submit_decode(1, seq_ids, q, k, v).result()
                            woke.append(time.perf_counter_ns())
                        backend.close(seq_ids)
                        key = f"w{nw}_b{b}_ctx{ctx}"
                        results[key] = breakdown(list(backend.call_trace), woke)
                        print(f"per call {key}: {results[key]}", flush=True)
            finally:
                backend.shutdown()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    p.add_argument("--context", type=int, default=256, help="tokens of KV per sequence before timing")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--s-threads", type=int, default=1,
                   help="torch threads of the S-Part (1: on a shared 2-core box, OpenMP barriers of 2 threads "
                        "competing with the R-Part's threads slow the S-Part down many times over)")
    p.add_argument("--r-threads", type=int, default=0,
                   help="R-Part threads in total: the local kernel's, split evenly over the R-workers "
                        "(0 = all cores)")
    p.add_argument("--call-contexts", type=int, nargs="+", default=[256, 1024],
                   help="contexts of the per-call breakdown (2-layer KV, no S-Part)")
    p.add_argument("--call-iters", type=int, default=30)
    p.add_argument("--out", default=str(RESULT))
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.s_threads)
    load_at_start = round(os.getloadavg()[0], 2)
    threads = torch.get_num_threads()
    r_threads = args.r_threads or os.cpu_count() or 1
    loaded = load_model(args.model, "float32", "cpu", 0)
    model, a = loaded.model, loaded.args
    spec = KVSpec(a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    need = int(max(args.batches) * (args.context + 16) * per_token * 1.25) + (64 << 20)
    base = EngineConfig(model=args.model, kv_capacity_bytes=need, kernel_threads=r_threads)
    results = {}
    for b in args.batches:
        local = create_backend(base.replace(attention="local"), spec)
        try:
            results[f"local_b{b}"] = time_decode(model, local, spec, b, args.context, args.steps, 2)
        finally:
            local.shutdown()
        print(f"local  B={b}: {results[f'local_b{b}']['step_s'] * 1e3:.1f} ms/step", flush=True)
    # Each worker gets an equal share of the local kernel's threads.
    with local_fleet(args.workers, tempfile.mkdtemp(prefix="bench_rworker_"),
                     kv_capacity=need // args.workers + (64 << 20),
                     threads=max(1, r_threads // args.workers)) as fleet:
        remote = create_backend(base.replace(attention="remote", rworkers=fleet.addresses, rworker_timeout_s=60.0), spec)
        try:
            for b in args.batches:
                r = results[f"remote_b{b}"] = time_decode(model, remote, spec, b, args.context, args.steps, 2)
                u = time_decode(model, remote, spec, b, args.context, max(3, args.steps // 2), 1)
                r["comm_share_unpipelined"] = u["comm_share"]
                r["call_ms_unpipelined"], r["kernel_ms_unpipelined"] = u["call_ms"], u["kernel_ms"]
                r["worker_handler_ms_unpipelined"] = u["worker_handler_ms"]
                r["client_submit_ms_unpipelined"] = u["client_submit_ms"]
                r["breakdown_us_unpipelined"] = u["breakdown_us"]
                print(f"remote B={b}: {r['step_s'] * 1e3:.1f} ms/step, comm_share {r['comm_share']:.3f} "
                      f"(unpipelined {u['comm_share']:.3f}; call {u['call_ms']:.2f} ms, kernel {u['kernel_ms']:.2f} ms)",
                      flush=True)
        finally:
            remote.shutdown()
    calls = per_call(spec, args.batches, args.call_contexts, sorted({1, args.workers}), args.call_iters,
                     max(1, r_threads // args.workers))
    ratios = {b: results[f"remote_b{b}"]["step_s"] / results[f"local_b{b}"]["step_s"] for b in args.batches}
    summary = {
        "bench": "rworker",
        "model": Path(args.model).name,
        "context_tokens": args.context,
        "steps_timed": args.steps,
        "rworkers": args.workers,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": load_at_start, "python": platform.python_version()},
        "threads": {"s_part_torch": threads, "r_part_total": r_threads,
                    "per_rworker": max(1, r_threads // args.workers)},
        "method": "Step times: the real model's decode steps (S-Part in torch, 1 thread) with 2 ping-pong mini-batches, "
                  "local backend vs remote (2 R-workers over loopback), medians over steps. comm_share from the "
                  "backend's per-call counters (definition below). per_call: one client, no model, no S-Part, a "
                  "2-layer KV-cache with the model's heads, 1 and 2 R-workers, contexts " + str(args.call_contexts)
                  + "; each call split by perf_counter_ns stamps from client and worker (same host clock); medians, "
                  "microseconds. On this 2-core machine the S-Part, client threads and R-workers (and other users) "
                  "share the cores, so 'waiting' includes waiting for a core; per_call shows it without the S-Part.",
        "remote_over_local_step_time": {str(b): round(r, 3) for b, r in ratios.items()},
        "comm_share": {str(b): round(results[f"remote_b{b}"]["comm_share"], 3) for b in args.batches},
        "comm_share_unpipelined": {str(b): round(results[f"remote_b{b}"]["comm_share_unpipelined"], 3)
                                   for b in args.batches},
        "comm_share_definition": "1 - sum(kernel_s)/sum(call_s) over decode attention calls; call_s = submit_decode() "
                                 "to future resolved (S-worker side), kernel_s = slowest worker's KVStore.decode time "
                                 "(measured on the worker, sent back in the reply). 'unpipelined' = one mini-batch, "
                                 "no S-Part running during the calls.",
        "target_comm_share": 0.15,
        "per_call_breakdown_us": calls,
        "runs": results,
    }
    print(f"load average at start {load_at_start} on {os.cpu_count()} CPUs (shared machine: figures are noisy)")
    for b in args.batches:
        print(f"B={b}: remote/local step time = {ratios[b]:.2f}x, comm_share = {summary['comm_share'][str(b)]:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
