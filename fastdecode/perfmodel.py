"""Performance model (docs/design.md, "Performance model"): T(B), H(B) and R, and the plan they give.

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

Plain Python: the micro-benchmarks that measure the curves are in perf_measure.py,
the `plan` command in ops/plan.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
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


def floor_model(pm: PerfModel) -> PerfModel:
    """The perf model from the fastest repeat of each micro-benchmark (meta["floor"])."""
    f = pm.meta.get("floor")
    if not f:
        raise ValueError("this perf model has no floor curves")
    return PerfModel.from_dict({"num_layers": pm.num_layers, **f, "meta": {**pm.meta, "floor": None}})
