"""Custom metrics on Triton's metrics port.

Recording is cheap and local (the host's sender thread calls it per output); `flush()` pushes
the accumulated values to the sink every metrics interval, so a stream of 128 requests does not
pay one IPC round trip per token. The sink makes the metric objects: pb_model.PbMetricsSink over
pb_utils.MetricFamily in Triton, a fake in the tests.

    fastdecode_prompt_tokens_total              counter
    fastdecode_generation_tokens_total          counter
    fastdecode_requests_finished_total{reason}  counter (stop, length, cancelled, error)
    fastdecode_time_to_first_token_seconds      histogram (arrival in execute() -> first token out)
    fastdecode_time_per_output_token_seconds    histogram (per request: (last - first) / (tokens - 1))
    fastdecode_requests_running                 gauge
    fastdecode_requests_waiting                 gauge
    fastdecode_kv_tokens{rworker}               gauge (KV tokens held by each R-worker; "local" in-process)
    fastdecode_ready                            gauge (1 while the engine takes requests; 0 while no
                                                R-worker is reachable or the engine crashed)
    fastdecode_preemptions_total                counter (sequences preempted for KV and requeued)

From the engine's per-step trace (engine.trace; fastdecode/trace.py), each step counted once:
    fastdecode_steps_total                      counter (engine steps)
    fastdecode_step_seconds_total               counter (time in steps)
    fastdecode_s_part_seconds_total             counter (S-Part: the model's own work in steps)
    fastdecode_r_part_seconds_total             counter (R-Part: attention calls in flight)
    fastdecode_s_wait_seconds_total             counter (S-Part blocked, waiting for the R-Part)
    fastdecode_r_wait_seconds_total             counter (R-Part idle, waiting for the S-Part)
    fastdecode_step_time_seconds{stat}          gauge (mean, p50, p99, max over the steps since the
                                                previous push; unchanged while no step runs)
    fastdecode_batch_size                       gauge (sequences in the newest step; 0 when idle)
    fastdecode_context_tokens                   gauge (context tokens in flight after the newest step)
and, with scheduler=sls, from engine.stats()["scheduler"]:
    fastdecode_sls_w_lim                        gauge (the W_lim in use: sls_w_lim or the derived one)
    fastdecode_sls_w_in_flight                  gauge (the context load SLS counts in flight now)

Rates are the counters': rate(fastdecode_s_wait_seconds_total) / rate(fastdecode_step_seconds_total)
is the fraction of step time the S-Part waits for attention. A step-time histogram would cost one
IPC round trip to Triton per step (pb_utils observes one value per call), hence the counters and
per-push statistics. The engine keeps its newest 4096 steps: a push sees all of them unless
more than that many steps ran since the previous push.
"""
from __future__ import annotations

import threading
from typing import Protocol

from fastdecode.trace import PARTS, TraceCursor, step_totals

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
FINISH_REASONS = ("stop", "length", "cancelled", "error")
STEP_STATS = ("mean", "p50", "p99", "max")
PART_COUNTERS = {
    "s_time": ("fastdecode_s_part_seconds_total", "S-Part (model) time in engine steps"),
    "r_time": ("fastdecode_r_part_seconds_total", "R-Part (attention) time in flight in engine steps"),
    "s_wait": ("fastdecode_s_wait_seconds_total", "Time the S-Part waited for the R-Part"),
    "r_wait": ("fastdecode_r_wait_seconds_total", "Time the R-Part was idle, waiting for the S-Part"),
}
assert set(PART_COUNTERS) == set(PARTS)


class MetricsSink(Protocol):
    def counter(self, name: str, description: str, labels: dict): ...      # -> .increment(v)
    def gauge(self, name: str, description: str, labels: dict): ...        # -> .set(v)
    def histogram(self, name: str, description: str, labels: dict, buckets: list[float]): ...  # -> .observe(v)


def kv_tokens_by_worker(stats: dict) -> dict[str, int]:
    """KV tokens per R-worker from engine.stats(): stats["kv"] is the attention backend's stats();
    a remote backend lists its workers under "workers" (address -> stats, or a list of stats with
    "address"); the local backend's own kv_tokens count as "local"."""
    kv = stats.get("kv") or {}
    workers = kv.get("workers")
    if isinstance(workers, dict):
        return {str(a): int((w or {}).get("kv_tokens", 0)) for a, w in workers.items()}
    if isinstance(workers, list):
        return {str(w.get("address", i)): int(w.get("kv_tokens", 0)) for i, w in enumerate(workers)}
    if "kv_tokens" in kv:
        return {"local": int(kv["kv_tokens"])}
    return {}


class Metrics:
    def __init__(self, sink: MetricsSink, labels: dict[str, str]):
        self.sink, self.labels = sink, dict(labels)
        self.prompt_tokens = sink.counter("fastdecode_prompt_tokens_total", "Prompt tokens processed", self.labels)
        self.generation_tokens = sink.counter("fastdecode_generation_tokens_total", "Tokens generated", self.labels)
        self.finished = {r: sink.counter("fastdecode_requests_finished_total", "Requests finished, by reason",
                                         {**self.labels, "reason": r}) for r in FINISH_REASONS}
        self.ttft = sink.histogram("fastdecode_time_to_first_token_seconds",
                                   "Time from request arrival to its first token", self.labels, TTFT_BUCKETS)
        self.tpot = sink.histogram("fastdecode_time_per_output_token_seconds",
                                   "Mean time between output tokens of a request", self.labels, TPOT_BUCKETS)
        self.running = sink.gauge("fastdecode_requests_running", "Sequences decoding", self.labels)
        self.waiting = sink.gauge("fastdecode_requests_waiting", "Requests queued for admission", self.labels)
        self.kv = {}                                   # R-worker address -> gauge, made on first sight
        self.ready = sink.gauge("fastdecode_ready", "1 while the engine takes requests", self.labels)
        self.preemptions = sink.counter("fastdecode_preemptions_total",
                                        "Sequences preempted for lack of KV and requeued for recompute", self.labels)
        self._preemptions_seen = 0
        self.steps = sink.counter("fastdecode_steps_total", "Engine steps", self.labels)
        self.step_seconds = sink.counter("fastdecode_step_seconds_total", "Time in engine steps", self.labels)
        self.parts = {k: sink.counter(name, desc, self.labels) for k, (name, desc) in PART_COUNTERS.items()}
        self.step_time = {s: sink.gauge("fastdecode_step_time_seconds",
                                        "Step time over the steps since the previous update",
                                        {**self.labels, "stat": s}) for s in STEP_STATS}
        self.batch_size = sink.gauge("fastdecode_batch_size", "Sequences in the newest engine step", self.labels)
        self.context_tokens = sink.gauge("fastdecode_context_tokens",
                                         "Context tokens of the sequences in flight", self.labels)
        self.sls: dict | None = None                   # sls gauges, made on first sight of an sls scheduler
        self.trace_cursor = TraceCursor()
        self._pending = self._empty()
        self._lock = threading.Lock()      # the host's send threads record side by side

    @staticmethod
    def _empty() -> dict:
        return {"prompt": 0, "generated": 0, "finished": {}, "ttft": [], "tpot": []}

    # ---- recording (any thread)
    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self._pending["ttft"].append(seconds)
            self._pending["prompt"] += num_prompt_tokens

    def tokens(self, n: int) -> None:
        with self._lock:
            self._pending["generated"] += n

    def request_finished(self, reason: str | None, decode_seconds: float | None, num_output_tokens: int) -> None:
        reason = reason if reason in FINISH_REASONS else "error"
        with self._lock:
            self._pending["finished"][reason] = self._pending["finished"].get(reason, 0) + 1
            if decode_seconds is not None and num_output_tokens > 1:
                self._pending["tpot"].append(decode_seconds / (num_output_tokens - 1))

    # ---- pushing
    def flush(self, stats: dict | None = None, trace: list[dict] | None = None) -> None:
        """Push what was recorded, the gauges of engine.stats() (`stats`) and the steps of
        engine.trace (`trace`, the engine's newest records) not pushed before."""
        with self._lock:
            p, self._pending = self._pending, self._empty()
        if p["prompt"]:
            self.prompt_tokens.increment(p["prompt"])
        if p["generated"]:
            self.generation_tokens.increment(p["generated"])
        for reason, n in p["finished"].items():
            self.finished[reason].increment(n)
        for v in p["ttft"]:
            self.ttft.observe(v)
        for v in p["tpot"]:
            self.tpot.observe(v)
        if stats is not None:
            self.running.set(float(stats.get("running", 0)))
            self.waiting.set(float(stats.get("waiting", 0)))
            self.ready.set(1.0 if stats.get("ready", stats.get("healthy", True)) else 0.0)
            self._flush_preemptions(stats.get("preemptions"))
            for address, n in kv_tokens_by_worker(stats).items():
                if address not in self.kv:
                    self.kv[address] = self.sink.gauge("fastdecode_kv_tokens", "KV-cache tokens held, per R-worker",
                                                       {**self.labels, "rworker": address})
                self.kv[address].set(float(n))
        if trace is not None:
            self._flush_steps(step_totals(self.trace_cursor.take(trace)), stats)
        if stats is not None:
            self._flush_scheduler(stats.get("scheduler") or {})

    def _flush_preemptions(self, total) -> None:
        if isinstance(total, int) and total > self._preemptions_seen:
            self.preemptions.increment(total - self._preemptions_seen)
            self._preemptions_seen = total

    def _flush_steps(self, t: dict, stats: dict | None) -> None:
        if t:
            self.steps.increment(t["steps"])
            self.step_seconds.increment(t["step_time"])
            for key, counter in self.parts.items():
                if t[key] > 0:
                    counter.increment(t[key])
            for stat, gauge in self.step_time.items():
                gauge.set(float(t[f"step_time_{stat}"]))
            self.batch_size.set(float(t["batch_size"]))
            self.context_tokens.set(float(t["context_tokens"]))
        elif stats is not None and not stats.get("running"):
            self.batch_size.set(0.0)                   # idle: no step, nothing in flight
            self.context_tokens.set(0.0)

    def _flush_scheduler(self, sched: dict) -> None:
        if sched.get("policy") != "sls":
            return
        if self.sls is None:
            self.sls = {"w_lim": self.sink.gauge("fastdecode_sls_w_lim", "SLS bound W_lim on the context in flight",
                                                 self.labels),
                        "w_in_flight": self.sink.gauge("fastdecode_sls_w_in_flight",
                                                       "Context load SLS counts in flight", self.labels)}
        for key, gauge in self.sls.items():
            if isinstance(sched.get(key), (int, float)):
                gauge.set(float(sched[key]))
