"""dtype="auto": the S-Part's dtype for a device, on the CPU chosen by timing both candidates.

A GPU takes bf16 where it has it, else fp16. A CPU without native bf16 takes fp32. A CPU with
native bf16 (AMX, or AVX512-BF16 alone) does not always multiply faster in bf16: with AMX,
oneDNN's bf16 GEMMs ran several times fp32's speed; on a 2-core Xeon that exposes AVX512-BF16
but not AMX, they took 1.4-1.6x fp32's time from batch 32 up while bf16 halved the bytes read
at batch 1 to 8 (bench/README.md). So there "auto" times one decoder layer's matrix products
and a slice of the LM head as the engine runs them (bf16 packed for oneDNN, fp32 packed for MKL),
at the batch the engine runs at full load, both ways in alternation, and takes bf16 only where
it is clearly the faster (fp32 keeps the checkpoint's precision; a close call would flip from
one start to the next on a shared machine).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdecode.model.llama import ModelArgs
from fastdecode.model.packed import PackedLinear, cpu_flags, packing_supported

PROBE_MAX_BATCH = 256          # rows of the probe's products: the engine at full load, capped
PROBE_MAX_WEIGHT = 1 << 22     # elements per probe weight (the LM head is cut to this many)
PROBE_ROUNDS = 4
PROBE_MIN_ROUND_S = 0.02       # a round repeats the products at least this long (a tiny model's take microseconds)
BF16_MARGIN = 1.15             # bf16 is taken where fp32 takes at least this many times as long
PROBE_MIN_FLOP = 50e6          # below, a step's products take microseconds in either dtype: thread wake-ups, not
                               # the dtype, set their time, so the probe would pick at random


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)    # probe: best time of each candidate

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "reason": self.reason, "probe_seconds": dict(self.seconds)}


def cpu_has_native_bf16(flags: list[str] | None = None) -> bool:
    """AVX512-BF16 (Zen 4, Cooper Lake and later) or AMX-BF16 (Sapphire Rapids and later)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def probe_shapes(args: ModelArgs) -> list[tuple[int, int, int]]:
    """(out_features, in_features, times per step) of one step's products, out cut to the cap."""
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    layer = [(qkv, args.hidden_size), (args.hidden_size, args.num_heads * args.head_dim),
             (2 * args.intermediate_size, args.hidden_size), (args.hidden_size, args.intermediate_size)]
    shapes = [(n, k, args.num_layers) for n, k in layer] + [(args.vocab_size, args.hidden_size, 1)]
    return [(min(n, max(1, PROBE_MAX_WEIGHT // k)), k, times) for n, k, times in shapes]


def time_products(shapes: list[tuple[int, int, int]], dtype: torch.dtype, batch: int) -> Callable[[], float]:
    """A function that runs each product once and returns the step time they imply."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, k, times in shapes:
        linear = nn.Linear(k, n, bias=False, dtype=dtype)
        linear.weight.requires_grad_(False)
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        layer = PackedLinear(linear) if packing_supported(dtype, "cpu") else linear
        cases.append((layer, torch.randn(batch, k, generator=gen).to(dtype), times))

    def one_pass() -> float:
        total = 0.0
        for layer, x, times in cases:
            t = time.perf_counter()
            layer(x)
            total += (time.perf_counter() - t) * times
        return total

    def run() -> float:
        passes, total, start = 0, 0.0, time.perf_counter()
        with torch.inference_mode():
            while passes == 0 or time.perf_counter() - start < PROBE_MIN_ROUND_S:
                total += one_pass()
                passes += 1
        return total / passes
    return run


def probe(candidates: dict[str, Callable[[], float]], rounds: int = PROBE_ROUNDS) -> dict[str, float]:
    """Each candidate's best time over `rounds`, the candidates alternated (after one warm-up each),
    so that a burst of load on a shared machine hits both."""
    for run in candidates.values():
        run()
    best = {name: float("inf") for name in candidates}
    for _ in range(rounds):
        for name, run in candidates.items():
            best[name] = min(best[name], run())
    return best


def choose_dtype(dtype: str, device: str, args: ModelArgs, batch: int,
                 flags: list[str] | None = None) -> DtypeChoice:
    """`dtype` as given, or "auto" resolved for `device` (batch: sequences decoding at full load)."""
    if dtype != "auto":
        return DtypeChoice(dtype, "configured")
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", "auto: the GPU computes bf16")
        return DtypeChoice("float16", "auto: the GPU has no bf16")
    if not cpu_has_native_bf16(flags):
        return DtypeChoice("float32", "auto: the CPU has neither AVX512-BF16 nor AMX")
    if not packing_supported(torch.bfloat16, "cpu"):
        return DtypeChoice("float32", "auto: torch's oneDNN has no bf16 on this CPU")
    batch = max(1, min(batch, PROBE_MAX_BATCH))
    shapes = probe_shapes(args)
    flop = 2 * batch * sum(n * k * times for n, k, times in shapes)
    if flop < PROBE_MIN_FLOP:
        return DtypeChoice("float32", f"auto: a step's matrix products are too small for the dtype to matter "
                                      f"({flop / 1e6:.1f} MFLOP at batch {batch})")
    seconds = probe({"bfloat16": time_products(shapes, torch.bfloat16, batch),
                     "float32": time_products(shapes, torch.float32, batch)})
    timing = (f"at batch {batch} (bf16 {seconds['bfloat16'] * 1e3:.2f} ms, fp32 {seconds['float32'] * 1e3:.2f} ms "
              f"a step of matrix products)")
    if seconds["bfloat16"] * BF16_MARGIN <= seconds["float32"]:
        return DtypeChoice("bfloat16", f"auto: bf16 is the faster on this CPU {timing}", seconds)
    return DtypeChoice("float32", f"auto: bf16 is not {BF16_MARGIN}x faster on this CPU {timing}", seconds)
