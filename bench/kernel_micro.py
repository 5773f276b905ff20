"""Micro-benchmark of KVStore.attend: fp16 vs int4 on one thread, per process-CPU-second.

Usage: .venv/bin/python bench/kernel_micro.py [--batch 8] [--ctx 4096] [--repeats 9]
Prints GB/s of KV bytes per CPU second (median of repeats) and the int4/fp16 time ratio.
"""
import argparse
import statistics
import time

import numpy as np

from rpart.kernels import KVStore


def run(fmt, B, T, H, Hkv, D, repeats, isa, threads):
    per_tok = Hkv * D * 2 * 2 if fmt == "fp16" else Hkv * (D // 2 + D // 32 * 4) * 2
    cap = int(B * (T + 32) * per_tok * 1.2) + (64 << 20)
    st = KVStore(1, Hkv, D, cap, kv_format=fmt, num_threads=threads, isa=isa)
    rng = np.random.default_rng(0)
    ids = np.arange(B, dtype=np.int64)
    st.create(ids)
    for b in range(B):
        k = rng.standard_normal((T, Hkv, D), dtype=np.float32).astype(np.float16)
        v = rng.standard_normal((T, Hkv, D), dtype=np.float32).astype(np.float16)
        st.append_span(0, ids[b:b + 1], np.array([T], dtype=np.int64), k, v)
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    st.attend(0, ids, q)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        st.attend(0, ids, q)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    nbytes = B * T * per_tok
    return nbytes, statistics.median(cpu), statistics.median(wall), min(cpu)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="avx512")
    ap.add_argument("--formats", default="fp16,int4")
    a = ap.parse_args()
    res = {}
    for fmt in a.formats.split(","):
        nb, c, w, cmin = run(fmt, a.batch, a.ctx, a.heads, a.kv_heads, a.head_dim, a.repeats, a.isa, a.threads)
        res[fmt] = c
        print(f"{fmt:5s} bytes={nb / 1e6:7.1f}MB cpu={c * 1e3:7.2f}ms wall={w * 1e3:7.2f}ms "
              f"GB/s(cpu)={nb / c / 1e9:6.2f} GB/s(wall)={nb / w / 1e9:6.2f} best={nb / cmin / 1e9:6.2f}")
    if "fp16" in res and "int4" in res:
        print(f"int4 speedup vs fp16 (cpu time): {res['fp16'] / res['int4']:.2f}")


if __name__ == "__main__":
    main()
