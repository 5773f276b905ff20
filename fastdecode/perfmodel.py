"""Performance model (PAPER.md, "Performance model"): measure T(B) and R, choose B and P.

    T(B)  S-Part seconds of one layer-step at (mini-)batch B on the S-worker's device:
          the engine's own DecoderLayer (norms, fused qkv + rope, o proj, MLP).
    H(B)  the once-per-step S-Part: embedding + final norm + LM head + greedy pick.
    R     R-Part seconds per token of context per layer on one R-worker (the C++
          KVStore with its thread pool: append + attend), plus a fixed cost per call.

    plan: B = largest with 2*N*S*T(B) <= L, or with no L the knee of E(B) = B/T(B)
          (smallest B reaching 90% of the best E over [1, max_batch]);
          P = ceil(B*S*R / (2*T(B))) R-workers; SLS F and W_lim; predicted tokens/s.

B is the mini-batch: the engine runs `num_minibatches` of them ping-pong, so
max_running = num_minibatches * B (the paper's 2*N*S*T(B) is the step of two).

The math (Curve, PerfModel, plan) is plain Python; torch and the kernel are
imported only by the micro-benchmarks.

    python -m fastdecode plan --model DIR [--latency-budget MS] [--seq-len S] [--out FILE]

writes {"settings": {...}, "plan": {...}, "perf_model": {...}}; "settings" is what
EngineConfig.from_dict takes (max_running, scheduler, sls_f, sls_w_lim, sls_target_len,
num_minibatches).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from fastdecode.scheduler.sls import paper_w_max

DEFAULT_BATCHES = (1, 4, 16, 32, 64, 128, 256, 512)
DEFAULT_CONTEXTS = (4096, 16384, 65536, 131072)      # total context tokens of one attention call
KNEE_FRACTION = 0.9
MICRO_BATCHES_IN_FLIGHT = 32                           # F = S / 32: S/F micro-batches coexist


# --- curves ---------------------------------------------------------------------------------------

def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a + b*x."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("fit_line needs equally many x and y values, at least one")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


@dataclass(frozen=True)
class Curve:
    """Measured (x, seconds) points: piecewise linear between them, the end segments'
    slopes beyond them (never below zero); `fit` is the global least-squares line."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise ValueError("Curve needs equally many x and y values, at least one")
        if any(not math.isfinite(v) for v in (*self.xs, *self.ys)):
            raise ValueError("Curve values must be finite numbers")
        if list(self.xs) != sorted(set(self.xs)):
            raise ValueError(f"Curve x values must be strictly increasing, got {self.xs}")
        if min(self.xs) <= 0 or min(self.ys) <= 0:
            raise ValueError("Curve x values and times must be > 0")

    @classmethod
    def of(cls, points: dict | Sequence[tuple[float, float]]) -> "Curve":
        items = sorted(points.items() if isinstance(points, dict) else points)
        return cls(tuple(float(x) for x, _ in items), tuple(float(y) for _, y in items))

    @property
    def fit(self) -> tuple[float, float]:
        return fit_line(self.xs, self.ys)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * x / xs[0]             # one point: proportional
        i = 1
        while i < len(xs) - 1 and x > xs[i]:
            i += 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-12)

    def to_dict(self) -> dict:
        a, b = self.fit
        return {"x": list(self.xs), "seconds": list(self.ys), "fit": {"a": a, "b": b}}

    @classmethod
    def from_dict(cls, d: dict) -> "Curve":
        return cls(tuple(float(x) for x in d["x"]), tuple(float(y) for y in d["seconds"]))


# --- the model ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PerfModel:
    num_layers: int
    s_layer: Curve                 # T(B): seconds of one layer-step vs batch
    s_head: Curve                  # H(B): once-per-step S-Part vs batch
    r_per_token: float             # R: seconds per context token per layer, one R-worker
    r_fixed: float = 0.0           # seconds per attention call per layer (launch, copies)
    meta: dict = field(default_factory=dict)   # device, dtype, model shape, R backend, threads

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        if not (math.isfinite(self.r_per_token) and self.r_per_token > 0):
            raise ValueError(f"r_per_token must be a finite number > 0, got {self.r_per_token!r}")
        if not (math.isfinite(self.r_fixed) and self.r_fixed >= 0):
            raise ValueError(f"r_fixed must be a finite number >= 0, got {self.r_fixed!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """fp16 K and V of one token over all layers (0 when the shape is unknown)."""
        shape = self.meta.get("shape", {})
        return 2 * 2 * self.num_layers * shape.get("num_kv_heads", 0) * shape.get("head_dim", 0)

    def T(self, batch: float) -> float:
        return self.s_layer(batch)

    def E(self, batch: float) -> float:
        return batch / self.T(batch)

    def r_time(self, context: float, workers: int = 1) -> float:
        """R-Part seconds of one layer for a mini-batch with `context` tokens in total."""
        return self.r_fixed + self.r_per_token * context / workers

    def step_time(self, batch: int, context: int, workers: int = 1, minibatches: int = 2,
                  overlap: bool = True) -> float:
        """Predicted seconds of one decode step of `batch` sequences holding `context`
        tokens in total, split into `minibatches` equal parts. overlap=True: S and R on
        separate hardware, pipelined over two or more mini-batches (per layer the slower
        side sets the pace); overlap=False or one mini-batch: the times add up."""
        if batch < 1:
            return 0.0
        parts = min(minibatches, batch)
        sizes = [batch * (j + 1) // parts - batch * j // parts for j in range(parts)]
        s = sum(self.T(b) for b in sizes)
        r = sum(self.r_time(context * b / batch, workers) for b in sizes)
        per_layer = max(s, r) if overlap and parts > 1 else s + r
        return self.num_layers * per_layer + self.s_head(batch)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "s_layer": self.s_layer.to_dict(), "s_head": self.s_head.to_dict(),
                "r_per_token_s": self.r_per_token, "r_fixed_s": self.r_fixed, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "PerfModel":
        try:
            return cls(int(d["num_layers"]), Curve.from_dict(d["s_layer"]), Curve.from_dict(d["s_head"]),
                       float(d["r_per_token_s"]), float(d.get("r_fixed_s", 0.0)), dict(d.get("meta", {})))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a perf model: missing or bad field {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PerfModel":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None


# --- choosing B, P, F, W_lim ----------------------------------------------------------------------

def choose_batch(pm: PerfModel, seq_len: int, latency_budget_s: float | None, max_batch: int) -> tuple[int, str]:
    """B per mini-batch: largest with 2*N*S*T(B) <= L, or the knee of E(B) = B/T(B)."""
    batches = range(1, max_batch + 1)
    if latency_budget_s is not None:
        def latency(b: int) -> float:
            return 2 * pm.num_layers * seq_len * pm.T(b)

        fits = [b for b in batches if latency(b) <= latency_budget_s]
        if not fits:
            raise ValueError(f"latency budget {latency_budget_s * 1e3:.1f} ms is below what batch 1 needs: "
                             f"2*N*S*T(1) = {latency(1) * 1e3:.1f} ms (N={pm.num_layers}, S={seq_len})")
        return fits[-1], f"largest B <= {max_batch} with 2*N*S*T(B) <= L"
    e = [pm.E(b) for b in batches]
    target = KNEE_FRACTION * max(e)
    knee = next(b for b, v in zip(batches, e) if v >= target)
    return knee, f"knee of E(B)=B/T(B): smallest B with E(B) >= {KNEE_FRACTION} * max over [1, {max_batch}]"


def plan(pm: PerfModel, seq_len: int, latency_budget_s: float | None = None, max_batch: int | None = None,
         num_minibatches: int = 2, f: int = 0) -> dict:
    """The deployment plan for target length `seq_len` (prompt + generated tokens).
    B is searched in [1, max_batch], by default the largest measured batch (no
    extrapolation of T beyond what was measured)."""
    if max_batch is None:
        max_batch = int(pm.s_layer.xs[-1])
    for name, v, low in (("seq_len", seq_len, 1), ("max_batch", max_batch, 1), ("f", f, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if num_minibatches not in (1, 2):
        raise ValueError(f"num_minibatches must be 1 or 2, got {num_minibatches!r}")
    if latency_budget_s is not None and not (isinstance(latency_budget_s, (int, float))
                                             and math.isfinite(latency_budget_s) and latency_budget_s > 0):
        raise ValueError(f"latency budget must be a finite number > 0, got {latency_budget_s!r}")
    b, rule = choose_batch(pm, seq_len, latency_budget_s, max_batch)
    t = pm.T(b)
    workers_exact = b * seq_len * pm.r_per_token / (2 * t)
    workers = max(1, math.ceil(workers_exact - 1e-9))
    f = f or max(1, seq_len // MICRO_BATCHES_IN_FLIGHT)
    running = num_minibatches * b
    w_lim = paper_w_max(running, seq_len, f) + seq_len     # the scheduler's derivation (sls.py), P = 0
    # Steady state under SLS: mean context per sequence ~ (S+F)/2 .. S/2; use the peak for the
    # slowest step and the mean for throughput.
    step_peak = pm.step_time(running, w_lim, workers, num_minibatches, overlap=True)
    step_mean = pm.step_time(running, running * seq_len // 2, workers, num_minibatches, overlap=True)
    return {
        "batch_per_minibatch": b, "rule": rule, "num_minibatches": num_minibatches, "max_running": running,
        "seq_len": seq_len, "latency_budget_ms": None if latency_budget_s is None else latency_budget_s * 1e3,
        "T_B_ms": t * 1e3, "E_B_per_s": b / t, "R_ns_per_token": pm.r_per_token * 1e9,
        "rworkers_exact": workers_exact, "rworkers": workers,
        "sls_f": f, "sls_w_lim": w_lim, "micro_batch": running * f / seq_len,
        "kv_tokens_per_rworker": math.ceil(w_lim / workers),
        "kv_bytes_per_rworker": math.ceil(w_lim / workers) * pm.kv_bytes_per_token,
        "predicted_step_ms_mean": step_mean * 1e3, "predicted_step_ms_peak": step_peak * 1e3,
        "predicted_tokens_per_s": running / step_mean,
        "predicted_sequence_latency_s": seq_len * step_mean,
    }


def settings_from_plan(p: dict) -> dict:
    """The EngineConfig settings of a plan (EngineConfig.from_dict takes them)."""
    return {"max_running": p["max_running"], "num_minibatches": p["num_minibatches"], "scheduler": "sls",
            "sls_f": p["sls_f"], "sls_w_lim": p["sls_w_lim"], "sls_target_len": p["seq_len"]}


# --- micro-benchmarks (torch) ---------------------------------------------------------------------

def _timeit(fn, repeats: int, sync=lambda: None) -> tuple[float, float]:
    """(median, min) seconds of `repeats` calls after one warm-up call. The median is the
    model's figure; the min is the noise floor, for comparing with the fastest engine
    steps on a machine shared with other work."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def measure_s_part(model_dir: str, batches: Sequence[int] = DEFAULT_BATCHES, device: str = "cpu",
                   dtype: str = "float32", repeats: int = 5, layers: int = 2) -> tuple[dict, dict, dict]:
    """T(B) and H(B) of the engine's code on `device`. T: the engine's ModelRunner decoding
    one mini-batch of B through `layers` layers with an attention backend that costs
    nothing (so the runner's per-layer work -- host copies of q/k/v, futures -- counts
    with the layer's GEMMs and norms), less embedding + LM head, per layer. H: embedding +
    LM head + the engine's sampler + one incremental detokenizer push per sequence (the
    S-worker's per-step host work). Weights are random: only the shapes matter for time.
    Returns (T points, H points, model shape); points map B -> (median, min) seconds."""
    from concurrent.futures import Future

    import torch

    from fastdecode.attention.base import AttentionBackend, KVSpec
    from fastdecode.engine.detokenizer import IncrementalDetokenizer
    from fastdecode.engine.model_runner import ModelRunner
    from fastdecode.engine.sampling import SamplingParams, sample
    from fastdecode.model.llama import LlamaModel, ModelArgs
    from fastdecode.model.loader import DTYPES
    from fastdecode.model.fused import fuse_layers
    from fastdecode.model.packed import pack_linears
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = ModelArgs.from_hf(cfg)
    n = max(1, min(layers, args.num_layers))
    small = ModelArgs(**{**asdict(args), "num_layers": n})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(small, cfg, 4096).to(DTYPES[dtype]).eval()
    model.rope.build(device)
    model.requires_grad_(False)
    pack_linears(model)                            # as load_model does: the engine's S-Part
    fuse_layers(model)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    class FreeAttention(AttentionBackend):        # o = 0 at once: only the S-worker's side is timed
        def open(self, seq_ids): pass
        def close(self, seq_ids): pass
        def prefill(self, layer, seq_ids, lens, k, v): pass

        def submit_decode(self, layer, seq_ids, q, k, v):
            fut: Future = Future()
            fut.set_result(torch.zeros(q.shape, dtype=torch.float32))
            return fut

    runner = ModelRunner(model, FreeAttention(KVSpec(n, args.num_heads, args.num_kv_heads, args.head_dim)),
                         device, 1)
    t_points, h_points = {}, {}
    with torch.inference_mode():
        for b in batches:
            pos = torch.randint(0, 2048, (b,), device=device)
            tok = torch.randint(0, args.vocab_size, (b,), device=device)
            ids, tok_list, pos_list = list(range(b)), tok.tolist(), pos.tolist()

            def runner_step() -> None:
                runner.decode(ids, tok_list, pos_list)

            def ends() -> None:
                model.logits(model.embed(tok))

            greedy = [SamplingParams(temperature=0.0)] * b
            detoks = [IncrementalDetokenizer(tokenizer) for _ in range(b)]

            def head_step() -> None:
                tokens = sample(model.logits(model.embed(tok)), greedy, [None] * b).tolist()
                for d, t in zip(detoks, tokens):
                    d.push(t)

            total, outer = _timeit(runner_step, repeats, sync), _timeit(ends, repeats, sync)
            # median and min of a difference of two separately timed calls: subtracting the
            # pairs term by term can put the min above the median, so cap it there
            med, low = (max(a - o, 0.05 * a) / n for a, o in zip(total, outer))
            t_points[b] = (med, min(low, med))
            h_points[b] = _timeit(head_step, repeats, sync)
    shape = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
             "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
             "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size}
    return t_points, h_points, shape


def measure_r_part(num_kv_heads: int, num_heads: int, head_dim: int, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                   num_seqs: int = 32, threads: int = 0, kv_format: str = "fp16", repeats: int = 5) -> tuple[dict, str]:
    """Seconds (median, min) of one layer's decode (append + attend) over `num_seqs`
    sequences holding `context` tokens in total, on one in-process KVStore (an R-worker's
    kernel). Falls back to the plain-torch reference when the kernel is not built."""
    import numpy as np

    rng = np.random.default_rng(0)
    points = {}
    try:
        from fastdecode.kernels import KVStore
    except ImportError:
        return _measure_r_torch(num_kv_heads, num_heads, head_dim, contexts, num_seqs, repeats), "torch_ref"
    per_token = 2 * num_kv_heads * head_dim * (2 if kv_format == "fp16" else 1)
    for ctx in contexts:
        each = max(1, ctx // num_seqs)
        store = KVStore(1, num_kv_heads, head_dim, capacity_bytes=int(per_token * (each + 64 + repeats * 2) * num_seqs
                                                                     * 1.5) + (64 << 20),
                        kv_format=kv_format, num_threads=threads)
        ids = list(range(num_seqs))
        store.create(ids)
        kv = rng.standard_normal((each * num_seqs, num_kv_heads, head_dim), dtype=np.float32).astype(np.float16)
        store.append_span(0, ids, [each] * num_seqs, kv, kv)
        q = rng.standard_normal((num_seqs, num_heads, head_dim), dtype=np.float32)
        k1 = rng.standard_normal((num_seqs, num_kv_heads, head_dim), dtype=np.float32)
        points[each * num_seqs] = _timeit(lambda: store.decode(0, ids, q, k1, k1), repeats)
        store.close()
    return points, f"kernels.KVStore({kv_format}, threads={threads or 'all'})"


def _measure_r_torch(num_kv_heads, num_heads, head_dim, contexts, num_seqs, repeats) -> dict:
    import torch

    from fastdecode.attention.base import KVSpec
    from fastdecode.attention.torch_ref import TorchAttention

    points = {}
    for ctx in contexts:
        each = max(1, ctx // num_seqs)
        be = TorchAttention(KVSpec(1, num_heads, num_kv_heads, head_dim))
        ids = list(range(num_seqs))
        be.open(ids)
        kv = torch.randn(each * num_seqs, num_kv_heads, head_dim)
        be.prefill(0, ids, [each] * num_seqs, kv, kv)
        q = torch.randn(num_seqs, num_heads, head_dim)
        k1 = torch.randn(num_seqs, num_kv_heads, head_dim)
        points[each * num_seqs] = _timeit(lambda: be.decode(0, ids, q, k1, k1), repeats)
    return points


def measure_r_backend(backend, contexts: Sequence[int] = DEFAULT_CONTEXTS, num_seqs: int = 32,
                      repeats: int = 5) -> dict:
    """R-Part seconds (median, min) of one layer's submit_decode(...).result() through an AttentionBackend
    (e.g. the remote one: transport included) over `num_seqs` sequences holding `context`
    tokens in total. Opens and closes its own sequences (ids from 2**39 up)."""
    import torch

    spec = backend.spec
    gen = torch.Generator().manual_seed(0)
    points = {}
    for j, ctx in enumerate(contexts):
        each = max(1, ctx // num_seqs)
        ids = [(1 << 39) + j * num_seqs + i for i in range(num_seqs)]
        backend.open(ids)
        try:
            kv = torch.randn(each * num_seqs, spec.num_kv_heads, spec.head_dim, generator=gen)
            backend.prefill(0, ids, [each] * num_seqs, kv, kv)
            q = torch.randn(num_seqs, spec.num_heads, spec.head_dim, generator=gen)
            k1 = torch.randn(num_seqs, spec.num_kv_heads, spec.head_dim, generator=gen)
            points[each * num_seqs] = _timeit(lambda: backend.decode(0, ids, q, k1, k1), repeats)
        finally:
            backend.close(ids)
    return points


def build_perf_model(model_dir: str, device: str = "cpu", dtype: str = "float32",
                     batches: Sequence[int] = DEFAULT_BATCHES, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                     threads: int = 0, kv_format: str = "fp16", repeats: int = 5, backend=None) -> PerfModel:
    """Measure and fit (medians). R through `backend` (an AttentionBackend, all its
    R-workers as one) when given, else on one in-process KVStore with `threads` threads.
    meta["floor"] holds the same curves from the fastest repeat (see floor_model)."""
    t_pts, h_pts, shape = measure_s_part(model_dir, batches, device, dtype, repeats)
    if backend is not None:
        r_pts, r_backend = measure_r_backend(backend, contexts, repeats=repeats), type(backend).__name__
    else:
        r_pts, r_backend = measure_r_part(shape["num_kv_heads"], shape["num_heads"], shape["head_dim"], contexts,
                                          threads=threads, kv_format=kv_format, repeats=repeats)
    models = []
    for which in (0, 1):              # median, min
        r0, r = fit_line(list(r_pts), [v[which] for v in r_pts.values()])
        if r <= 0:
            raise RuntimeError(f"R-Part time did not grow with context ({r_pts}): measurement too noisy")
        models.append((Curve.of({b: v[which] for b, v in t_pts.items()}),
                       Curve.of({b: v[which] for b, v in h_pts.items()}), r, max(r0, 0.0)))
    (t, h, r, r0), (tf, hf, rf, rf0) = models
    return PerfModel(shape["num_layers"], t, h, r, r0, {
        "model": str(model_dir), "device": _device_name(device), "dtype": dtype, "shape": shape,
        "r_backend": r_backend, "r_points": {str(k): v[0] for k, v in r_pts.items()}, "repeats": repeats,
        "measured_at": time.time(),
        "floor": {"s_layer": tf.to_dict(), "s_head": hf.to_dict(), "r_per_token_s": rf, "r_fixed_s": rf0}})


def floor_model(pm: PerfModel) -> PerfModel:
    """The perf model from the fastest repeat of each micro-benchmark (meta["floor"])."""
    f = pm.meta.get("floor")
    if not f:
        raise ValueError("this perf model has no floor curves")
    return PerfModel.from_dict({"num_layers": pm.num_layers, **f, "meta": {**pm.meta, "floor": None}})


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


# --- CLI ------------------------------------------------------------------------------------------

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
