"""R-Part kernel benchmark (`make bench-kernel`): our fp16 and int4 decode attention
against torch SDPA (fp32, bf16) on the same data, and against a STREAM-style read
bandwidth of this machine (same huge-page setting, same thread count).

Writes bench/results/kernel.json (the whole table + headline ratios) and kernel.png.
The cases are filled by one prefill per sequence; the headline case is measured again with
its cache grown a block at a time for every sequence in turn (`decode_grown`), as decoding
sequences grow it. The headline ratios are medians over HEADLINE_PASSES passes of the headline case
spread over the run (`headline_passes`).
Times are medians of repeats of one attention call over the whole batch (wall
clock); the machine is shared, so the load average is recorded beside them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rpart import _kernels
from rpart.kernels import KVStore

OUT = Path(__file__).resolve().parent / "results"
SHAPES = [  # name, query heads, head_dim, kv heads
    ("llama7b", 32, 128, 32),
    ("llama7b", 32, 128, 8),
    ("smollm2", 9, 64, 3),
]
BATCHES = (16, 64)
CONTEXTS = (1024, 4096)
THREADS = (1, 2)
HEADLINE_THREADS = 2
HEADLINE_PASSES = 3  # the table's pass and more of the headline case alone, a minute or more apart
TORCH_CHUNK_BYTES = 1 << 30  # torch K+V (fp32) of at most this many bytes at once
STREAM_BYTES = 512 << 20
MAX_FP16_KV_BYTES = 1100 << 20  # larger cases run only when this much RAM is free (it is shared):
BIG_CASE_MIN_AVAILABLE = 12 << 30


def kv_data(ctx: int, hkv: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V of one sequence, fp16, deterministic. Every sequence of a case gets a copy
    (memory traffic is what is measured; generating distinct data would dominate the run)."""
    rng = np.random.default_rng(ctx * 1000 + hkv * 10 + d)
    k = rng.standard_normal((ctx, hkv, d), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((ctx, hkv, d), dtype=np.float32).astype(np.float16)
    return k, v


def queries(batch: int, h: int, d: int) -> np.ndarray:
    """q [batch, h, d] of a case, deterministic."""
    return np.random.default_rng(1).standard_normal((batch, h, d), dtype=np.float32)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def filled_store(fmt: str, k: np.ndarray, v: np.ndarray, batch: int, grown: bool = False) -> KVStore:
    """A store of `batch` sequences 0.., each holding k, v [ctx, hkv, d]: filled by one prefill per
    sequence (its blocks consecutive in the pool), or (grown) a block's tokens at a time for every
    sequence in turn, as sequences decoding together grow (their blocks interleave)."""
    ctx, hkv, d = k.shape
    store = KVStore(1, hkv, d, capacity_bytes=batch * ctx * hkv * d * 4 + (64 << 20), kv_format=fmt)
    ids = list(range(batch))
    store.create(ids)
    if grown:
        step = store.block_size
        for t0 in range(0, ctx, step):
            n = min(step, ctx - t0)
            store.append_span(0, ids, [n] * batch, np.concatenate([k[t0:t0 + n]] * batch),
                              np.concatenate([v[t0:t0 + n]] * batch))
    else:
        for s in ids:
            store.append_span(0, [s], [ctx], k, v)
    return store


def bench_ours(h, d, hkv, batch, ctx, q, repeats, stream, grown=False, threads=THREADS) -> dict:
    """Our fp16 and int4 kernels on the same data, their calls interleaved with STREAM passes
    (same threads), so all three see the same machine load; medians of `repeats`."""
    k, v = kv_data(ctx, hkv, d)
    ids = list(range(batch))
    stores = {fmt: filled_store(fmt, k, v, batch, grown) for fmt in ("fp16", "int4")}
    out = {"isa": stores["fp16"].isa, "kv_bytes": {f: st.stats()["bytes_used"] for f, st in stores.items()}}
    for th in threads:
        times = {"fp16": [], "int4": [], "stream": []}
        for store in stores.values():
            store.set_threads(th)
            store.attend(0, ids, q)  # warm-up
        for _ in range(repeats):
            times["stream"].append(stream.read(th))
            for fmt, store in stores.items():
                # Past the other store's 20 us of spinning: its workers sleep, and this call wakes
                # its own from sleep, as a decode step's calls do.
                time.sleep(0.002)
                t0 = time.perf_counter()
                store.attend(0, ids, q)
                times[fmt].append(time.perf_counter() - t0)
        out[th] = {key: statistics.median(x) for key, x in times.items()}
    for store in stores.values():
        store.close()
    return out


def bench_int4_in_cache(repeats: int) -> dict:
    """int4 at the 7B MHA shape on a cache small enough to stay in the last-level cache (2 x 1024
    tokens, 10 MiB): the kernel's compute speed without DRAM, per thread count (GB/s of int4 data)."""
    h, d, hkv, batch, ctx = 32, 128, 32, 2, 1024
    ids = list(range(batch))
    store = filled_store("int4", *kv_data(ctx, hkv, d), batch)
    q = queries(batch, h, d)
    nbytes = store.stats()["bytes_used"]
    out = {"batch": batch, "context": ctx, "kv_bytes": nbytes}
    for th in THREADS:
        store.set_threads(th)
        out[th] = nbytes / median_time(lambda: store.attend(0, ids, q), repeats) / 1e9
    store.close()
    return out


def bench_torch(h, d, hkv, batch, ctx, q, repeats) -> dict:
    """SDPA (enable_gqa) on the same K, V, in chunks of the batch so fp32 copies stay <= 1 GiB;
    the time of a case is the sum over its chunks."""
    chunk = max(1, min(batch, TORCH_CHUNK_BYTES // (ctx * hkv * d * 4 * 2)))
    k16, v16 = (torch.from_numpy(x).transpose(0, 1) for x in kv_data(ctx, hkv, d))  # [Hkv, T, D]
    out = {"chunk": chunk, "float32": dict.fromkeys(THREADS, 0.0), "bfloat16": dict.fromkeys(THREADS, 0.0)}
    for b0 in range(0, batch, chunk):
        n = min(chunk, batch - b0)
        for dtype in (torch.float32, torch.bfloat16):
            k = k16.to(dtype).unsqueeze(0).expand(n, -1, -1, -1).contiguous()  # [n, Hkv, T, D]
            v = v16.to(dtype).unsqueeze(0).expand(n, -1, -1, -1).contiguous()
            qq = torch.from_numpy(q[b0:b0 + n]).to(dtype).unsqueeze(2)  # [n, H, 1, D]
            for th in THREADS:
                torch.set_num_threads(th)
                out[str(dtype).removeprefix("torch.")][th] += median_time(
                    lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True), repeats)
            del k, v
            gc.collect()
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, 6), sharey=True)
    for ax, th in zip(axes, THREADS):
        sel = [r for r in rows if r["threads"] == th]
        labels = [f"{r['shape']}/kv{r['kv_heads']}\nB{r['batch']} T{r['context']}" for r in sel]
        x = np.arange(len(sel))
        gbs = lambda key: [r["fp16_kv_bytes"] / r[key] / 1e9 for r in sel]  # fp16-equivalent GB/s
        for i, (key, name) in enumerate([("ours_fp16_s", "ours fp16"), ("ours_int4_s", "ours int4"),
                                         ("torch_float32_s", "torch SDPA fp32"),
                                         ("torch_bfloat16_s", "torch SDPA bf16")]):
            ax.bar(x + (i - 1.5) * 0.2, gbs(key), 0.2, label=name)
        ax.plot(x, [r["stream_GBps"] for r in sel], "k_", ms=20, mew=2, label="STREAM read (same moment)")
        ax.set_xticks(x, labels, fontsize=6)
        ax.set_title(f"{th} thread(s)")
        ax.set_ylabel("fp16 KV bytes / second (GB/s)")
        ax.legend(fontsize=7)
    fig.suptitle("Decode attention over a batch: effective fp16-KV throughput (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure_case(name, h, d, hkv, batch, ctx, stream) -> list[dict]:
    repeats = 5 if batch * ctx * hkv * d * 4 > (1 << 29) else 9
    q = queries(batch, h, d)
    ours = bench_ours(h, d, hkv, batch, ctx, q, repeats, stream)
    gc.collect()
    tref = bench_torch(h, d, hkv, batch, ctx, q, 3 if repeats == 5 else 7)
    rows = []
    for th in THREADS:
        row = dict(shape=name, heads=h, head_dim=d, kv_heads=hkv, batch=batch, context=ctx, threads=th,
                   isa=ours["isa"], fp16_kv_bytes=ours["kv_bytes"]["fp16"], int4_kv_bytes=ours["kv_bytes"]["int4"],
                   ours_fp16_s=ours[th]["fp16"], ours_int4_s=ours[th]["int4"], stream_GBps=ours[th]["stream"],
                   torch_float32_s=tref["float32"][th], torch_bfloat16_s=tref["bfloat16"][th],
                   torch_batch_chunk=tref["chunk"], loadavg=os.getloadavg()[0])
        row["fp16_GBps"] = row["fp16_kv_bytes"] / row["ours_fp16_s"] / 1e9
        row["int4_GBps"] = row["int4_kv_bytes"] / row["ours_int4_s"] / 1e9
        row["fp16_bandwidth_fraction"] = row["fp16_GBps"] / row["stream_GBps"]
        row["fp16_speedup_vs_torch"] = min(row["torch_float32_s"], row["torch_bfloat16_s"]) / row["ours_fp16_s"]
        row["int4_speedup_vs_fp16"] = row["ours_fp16_s"] / row["ours_int4_s"]
        rows.append(row)
        print(f"{name:8s} kv{hkv:<2d} B{batch:<3d} T{ctx:<5d} th{th}: STREAM {row['stream_GBps']:5.1f} GB/s  "
              f"fp16 {row['ours_fp16_s']*1e3:8.2f} ms ({row['fp16_GBps']:5.1f} GB/s, "
              f"{row['fp16_bandwidth_fraction']:.2f})  int4 {row['ours_int4_s']*1e3:8.2f} ms "
              f"(x{row['int4_speedup_vs_fp16']:.2f})  torch fp32 {row['torch_float32_s']*1e3:8.2f} ms  "
              f"bf16 {row['torch_bfloat16_s']*1e3:8.2f} ms (ours x{row['fp16_speedup_vs_torch']:.2f})  "
              f"load {row['loadavg']:.1f}", flush=True)
    return rows


def hl_rows(rows: list[dict], hkv: int) -> list[dict]:
    """The rows of the headline case (Llama-7B attention, batch 64, context 4096) at every thread count."""
    return [r for r in rows if (r["shape"], r["kv_heads"], r["batch"], r["context"]) == ("llama7b", hkv, 64, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="batch 16 / context 1024 only (smoke test)")
    ap.add_argument("--out", default=str(OUT / "kernel.json"), help="result JSON (the plot goes beside it)")
    args = ap.parse_args()
    batches, contexts = ((16,), (1024,)) if args.quick else (BATCHES, CONTEXTS)
    started = time.time()
    load_start = os.getloadavg()
    stream = _kernels.StreamBuffer(STREAM_BYTES, hugepages=True)
    bandwidth = {th: statistics.median(stream.read(th) for _ in range(7)) for th in THREADS}
    print("STREAM read GB/s at start:", {th: round(bw, 2) for th, bw in bandwidth.items()}, flush=True)

    rows, skipped = [], []
    for name, h, d, hkv in SHAPES:
        for batch in batches:
            for ctx in contexts:
                fp16_bytes = batch * ctx * hkv * d * 4
                if fp16_bytes > MAX_FP16_KV_BYTES and mem_available() < BIG_CASE_MIN_AVAILABLE:
                    skipped.append(dict(shape=name, kv_heads=hkv, batch=batch, context=ctx,
                                        why=f"{fp16_bytes / 1e9:.1f} GB of fp16 KV and only "
                                            f"{mem_available() / 2**30:.1f} GiB available on a shared machine"))
                    print("skipped", skipped[-1], flush=True)
                    continue
                rows += measure_case(name, h, d, hkv, batch, ctx, stream)

    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "note": "shared 2-core VM: other jobs run at the same time, so wall times are noisy"},
        "stream_read_GBps_at_start": {str(k): v for k, v in bandwidth.items()},
        "stream_note": f"{STREAM_BYTES >> 20} MiB huge-page buffer; each row's stream_GBps is the median of "
                       "passes interleaved with that row's kernel calls (same threads, same moment)",
        "rows": rows,
        "skipped": skipped,
        "seconds": time.time() - started,
    }
    # Headline: Llama-7B attention (32 x 128), batch 64, context 4096, 2 threads; the real
    # Llama-7B has 32 kv heads (fall back to 8 when the 4.3 GB case could not run).
    for hkv in (32, 8):
        hl = [r for r in hl_rows(rows, hkv) if r["threads"] == HEADLINE_THREADS]
        if not hl:
            continue
        r = hl[0]
        result["headline"] = dict(shape="llama7b", heads=32, head_dim=128, kv_heads=hkv, batch=64, context=4096,
                                  threads=HEADLINE_THREADS, stream_read_GBps=r["stream_GBps"])
        if hkv != 32:
            result["headline"]["why_not_kv_heads_32"] = [s["why"] for s in skipped if s["kv_heads"] == 32]
        passes = [dict(stream_GBps=r["stream_GBps"], ours_fp16_s=r["ours_fp16_s"], ours_int4_s=r["ours_int4_s"])]
        # What int4 would reach if its DRAM run went as fast as its in-cache run (compute alone): a
        # bound on int4_speedup_vs_fp16 from the kernel's arithmetic, at 1 thread (the in-cache call
        # is short, so at 2 threads waking the pool weighs on it).
        if hkv == 32:
            cached = bench_int4_in_cache(repeats=31)
            result["int4_in_cache"] = {str(k): v for k, v in cached.items()}
            one = [x for x in hl_rows(rows, hkv) if x["threads"] == 1]
            if one:
                int4_compute_s = one[0]["int4_kv_bytes"] / (cached[1] * 1e9)
                result["int4_speedup_bound_in_cache_1thread"] = one[0]["ours_fp16_s"] / int4_compute_s
                result["int4_speedup_vs_fp16_1thread"] = one[0]["int4_speedup_vs_fp16"]
            print(f"int4 in cache (7B MHA, {cached['kv_bytes'] >> 20} MiB): "
                  + ", ".join(f"th{th} {cached[th]:.1f} GB/s" for th in THREADS)
                  + (f"; 1-thread ratio if int4 ran at that speed: x{result['int4_speedup_bound_in_cache_1thread']:.2f}"
                     f" (measured x{result['int4_speedup_vs_fp16_1thread']:.2f})" if one else ""), flush=True)
        # The same case with the cache grown as decoding sequences grow it (blocks interleaved): the
        # rows above are filled by prefill, whose blocks lie in order, and a layout can favour that.
        g = bench_ours(32, 128, hkv, 64, 4096, queries(64, 32, 128), 5, stream, grown=True,
                       threads=(HEADLINE_THREADS,))
        gt = g[HEADLINE_THREADS]
        result["decode_grown"] = dict(
            threads=HEADLINE_THREADS, stream_GBps=gt["stream"], ours_fp16_s=gt["fp16"], ours_int4_s=gt["int4"],
            fp16_bandwidth_fraction=g["kv_bytes"]["fp16"] / gt["fp16"] / 1e9 / gt["stream"],
            int4_bandwidth_fraction=g["kv_bytes"]["int4"] / gt["int4"] / 1e9 / gt["stream"],
            int4_speedup_vs_fp16=gt["fp16"] / gt["int4"])
        print("decode-grown cache:", json.dumps({k: round(x, 3) for k, x in result["decode_grown"].items()}), flush=True)
        # The machine's neighbours come and go over minutes: the headline figures are medians over passes
        # spread over the run (the table's and those after the cases above), each pass's own medians.
        while len(passes) < HEADLINE_PASSES:
            o = bench_ours(32, 128, hkv, 64, 4096, queries(64, 32, 128), 5, stream, threads=(HEADLINE_THREADS,))
            ot = o[HEADLINE_THREADS]
            passes.append(dict(stream_GBps=ot["stream"], ours_fp16_s=ot["fp16"], ours_int4_s=ot["int4"]))
        for p in passes:
            p["fp16_bandwidth_fraction"] = r["fp16_kv_bytes"] / p["ours_fp16_s"] / 1e9 / p["stream_GBps"]
            p["int4_speedup_vs_fp16"] = p["ours_fp16_s"] / p["ours_int4_s"]
            print("headline pass:", json.dumps({k: round(x, 4) for k, x in p.items()}), flush=True)
        result["headline_passes"] = passes
        result["headline"]["passes"] = len(passes)
        result["fp16_bandwidth_fraction"] = statistics.median(p["fp16_bandwidth_fraction"] for p in passes)
        result["fp16_speedup_vs_torch"] = (min(r["torch_float32_s"], r["torch_bfloat16_s"])
                                           / statistics.median(p["ours_fp16_s"] for p in passes))
        result["int4_speedup_vs_fp16"] = statistics.median(p["int4_speedup_vs_fp16"] for p in passes)
        print("HEADLINE", json.dumps(result["headline"]), json.dumps(
            {k: round(result[k], 3) for k in ("fp16_bandwidth_fraction", "fp16_speedup_vs_torch",
                                              "int4_speedup_vs_fp16")}), flush=True)
        break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
