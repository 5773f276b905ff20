"""A/B of kernel builds in one process: their attend calls alternate on the same data.

On this shared VM, separate processes minutes apart see different neighbours (the 2-thread
STREAM read swings between 45 and 80 GB/s); calls alternated in one process see the same
moment, so the ratio of two builds holds to about 1% where process-to-process runs drift 5-10%
(calls under a millisecond stay noisy).
Copy the extension of each build aside (`cp rpart/_kernels*.so /tmp/a.so`, rebuild, ...), then

  .venv/bin/python bench/kernel_ab.py /tmp/a.so /tmp/b.so [--fmt int4] [--batch 64] [--ctx 4096]
      [--threads 2] [--heads 32] [--kv-heads 32] [--head-dim 128] [--block-size 16] [--rounds 9]
      [--groups 32/32 32/64]

--groups gives each build its int4 key / value groups (one K/V per build, in order; "-" for the
build's default, the only choice for builds before k_group / v_group); a path may be given twice
with different groups.

Prints per build: the median time per call, KV GB/s, its fraction of the STREAM read measured
between rounds, and the median over rounds of its time over the first build's.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time

import numpy as np


_loaded: dict[str, object] = {}  # real path -> module: dlopen of a loaded file hands back that library


def load_build(path: str):
    """The extension at `path` as a module of its own. Each load gets a package name of its own
    (Python hands back the module already loaded under a name, whatever the path), and the
    builds' types are module-local (bindings.cpp); builds before that collide on their types."""
    if not os.path.isfile(path):
        raise ValueError(f"no kernel build at {path!r}")
    real = os.path.realpath(path)
    if real in _loaded:
        return _loaded[real]
    for module in list(sys.modules.values()):  # imported the usual way (rpart._kernels)
        file = getattr(module, "__file__", None)
        if file and hasattr(module, "KVStore") and os.path.realpath(file) == real:
            return _loaded.setdefault(real, module)
    name = f"kernel_ab_{len(_loaded)}._kernels"  # the init function is PyInit__kernels
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        raise ValueError(f"{path!r} is not a loadable kernel build: {e}") from None
    if not hasattr(module, "KVStore"):
        raise ValueError(f"{path!r} is not a kernel build (no KVStore)")
    return _loaded.setdefault(real, module)


def groups(text: str) -> tuple[int, int] | None:
    """'K/V' -> (K, V); '-' -> None (the build's default)."""
    if text == "-":
        return None
    try:
        k, v = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"groups must be K/V (like 32/64) or -, got {text!r}") from None
    return k, v


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", help="paths of _kernels*.so files; the first is the reference")
    p.add_argument("--fmt", choices=("fp16", "int4"), default="int4")
    for name, default in (("batch", 64), ("ctx", 4096), ("threads", 2), ("heads", 32), ("kv-heads", 32),
                          ("head-dim", 128), ("block-size", 16), ("rounds", 9)):
        p.add_argument(f"--{name}", type=positive, default=default)
    p.add_argument("--groups", nargs="+", type=groups, help="int4 key/value groups per build: K/V or -")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.groups is None:
        args.groups = [None] * len(args.builds)
    if len(args.groups) != len(args.builds):
        p.error(f"--groups needs one K/V per build ({len(args.builds)}), got {len(args.groups)}")
    if args.fmt != "int4" and any(args.groups):
        p.error("--groups applies to --fmt int4 only")
    return args


def run(args: argparse.Namespace) -> list[dict]:
    mods = [load_build(path) for path in args.builds]  # a path given twice shares its module
    B, T, H, Hkv, D = args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    k = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    ids = np.arange(B, dtype=np.int64)
    stores = [m.KVStore(1, Hkv, D, B * (T + args.block_size) * Hkv * D * 4 + (64 << 20), args.block_size, args.fmt,
                        args.threads, "auto", True, **({"k_group": g[0], "v_group": g[1]} if g else {}))
              for m, g in zip(mods, args.groups)]
    for st in stores:
        st.create(ids)
    for b in range(B):  # every sequence holds the same T tokens; the stores fill in turn, so that
        for st in stores:  # their pages interleave in memory (filled one after the other, the later ran 2-5% faster)
            st.append_span(0, ids[b:b + 1], np.array([T], dtype=np.int64), k, v)
    for st in stores:
        st.attend(0, ids, q, None)
    kv_bytes = [st.stats()["bytes_used"] for st in stores]
    stream = mods[0].StreamBuffer(512 << 20, True)
    times, reads = [[] for _ in stores], []
    for r in range(args.rounds):
        reads.append(stream.read(args.threads))
        order = range(len(stores)) if r % 2 == 0 else reversed(range(len(stores)))  # neither always goes first
        for i in order:
            t0 = time.perf_counter()
            stores[i].attend(0, ids, q, None)
            times[i].append(time.perf_counter() - t0)
    read = statistics.median(reads)
    rows = []
    for path, g, nbytes, ts in zip(args.builds, args.groups, kv_bytes, times):
        t = statistics.median(ts)
        rows.append({"build": path, "groups": g, "s": t, "GBps": nbytes / t / 1e9, "stream_GBps": read,
                     "fraction": nbytes / t / 1e9 / read,
                     "over_first": statistics.median(a / b for a, b in zip(ts, times[0]))})
    return rows


def main(argv=None) -> None:
    args = parse(argv)
    rows = run(args)
    print(f"{args.fmt} batch {args.batch} ctx {args.ctx} heads {args.heads}/{args.kv_heads}x{args.head_dim} "
          f"block {args.block_size}, {args.threads} threads; STREAM read {rows[0]['stream_GBps']:.1f} GB/s")
    for row in rows:
        print(f"  {row['s'] * 1e3:8.2f} ms  {row['GBps']:5.1f} GB/s  {row['fraction']:.3f} of STREAM  "
              f"time / first {row['over_first']:.3f}  {row['build']}"
              + (f" groups {row['groups'][0]}/{row['groups'][1]}" if row["groups"] else ""))


if __name__ == "__main__":
    main()
