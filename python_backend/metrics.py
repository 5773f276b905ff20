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
"""
from __future__ import annotations

from typing import Protocol

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
FINISH_REASONS = ("stop", "length", "cancelled", "error")


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
        self._pending = self._empty()

    @staticmethod
    def _empty() -> dict:
        return {"prompt": 0, "generated": 0, "finished": {}, "ttft": [], "tpot": []}

    # ---- recording (one thread)
    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self._pending["ttft"].append(seconds)
        self._pending["prompt"] += num_prompt_tokens

    def tokens(self, n: int) -> None:
        self._pending["generated"] += n

    def request_finished(self, reason: str | None, decode_seconds: float | None, num_output_tokens: int) -> None:
        reason = reason if reason in FINISH_REASONS else "error"
        self._pending["finished"][reason] = self._pending["finished"].get(reason, 0) + 1
        if decode_seconds is not None and num_output_tokens > 1:
            self._pending["tpot"].append(decode_seconds / (num_output_tokens - 1))

    # ---- pushing
    def flush(self, stats: dict | None = None) -> None:
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
            for address, n in kv_tokens_by_worker(stats).items():
                if address not in self.kv:
                    self.kv[address] = self.sink.gauge("fastdecode_kv_tokens", "KV-cache tokens held, per R-worker",
                                                       {**self.labels, "rworker": address})
                self.kv[address].set(float(n))
