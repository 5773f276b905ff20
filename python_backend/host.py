"""EngineHost: one engine behind one decoupled Triton model instance.

execute() calls `submit()` per request: it parses and validates the request, registers it and
hands it to the engine (engine.add_request validates too) -- or answers at once with an error.
It never waits for tokens. The engine's background loop calls `on_output` for every
RequestOutput; a sender thread turns them into responses and sends them (the last one with the
FINAL flag), so the engine loop never blocks on Triton. A decoupled send is a synchronous round
trip to the Triton server process; with one send in flight at a time, every response wakes the
server's threads on its own, and on a machine whose cores the engine keeps busy each wake-up
takes one from the engine. So the sender hands the outputs it drained to `send_threads` threads,
each request always to the same one (its responses stay in order), and waits for them before it
drains again; the server then takes several responses per wake-up. Each send costs about the
same whatever it carries, so under load a response carries `stream_interval` tokens (auto: one
while at most AUTO_STREAMS requests are in flight, then twice as many for every twice as many
requests, so that a step sends about AUTO_STREAMS responses: 2 up to 32, 4 up to 64, 8 beyond); a
request's first token (even one of no text yet) and its last output go out at once, and no token
waits longer than `max_hold_s`: where steps are too slow for that, held tokens leave with the
step whose next wait would pass it, on the send threads like any other output. The sender thread
polls each live request's `is_cancelled()` (the client cancelled its gRPC stream) and aborts it in
the engine, which frees its KV at once; pushes metrics; and watches `engine.healthy`: once the
engine loop has crashed, every live request ends with an error, new ones are refused, and the
model unloads itself so that Triton reports it not ready.

The Triton side is behind `Transport` (pb_model.PbTransport in Triton, a fake in tests).
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from python_backend.errors import UNAVAILABLE, BadRequest, ErrorInfo, map_exception
from python_backend.metrics import Metrics
from python_backend.request import GenerateRequest, choice_sampling, parse_request
from python_backend.response import Outputs, ResponseBuilder


class Transport(Protocol):
    def send(self, sender: Any, outputs: Outputs | None, error: ErrorInfo | None, final: bool) -> None: ...
    def is_cancelled(self, sender: Any) -> bool: ...
    def unload(self) -> None: ...            # ask Triton to unload this model (it then reports not ready)
    def log(self, level: str, message: str) -> None: ...


@dataclass
class Live:
    """One engine request: a Triton request, or one of its n choices (they share the builder)."""
    request_id: str
    sender: Any
    request: GenerateRequest
    builder: ResponseBuilder
    arrival: float
    choice: int = 0
    siblings: list["Live"] | None = None      # all n choices of the Triton request, when n > 1
    lane: int = 0             # the send thread of the Triton request (its choices share it)
    first_token: float | None = None
    responded: bool = False   # a response with tokens went out
    accepted: bool = False    # every choice is in the engine; until then submit() may still refuse it
    cancelled: bool = False
    done: bool = False


_STOP = object()
AUTO_STREAMS = 16          # stream_interval "auto": 1 token a response up to this many live requests
AUTO_MAX_INTERVAL = 8      # ... then x2 per x2 requests, up to this
MAX_STREAM_INTERVAL = 64


class EngineHost:
    def __init__(self, engine, transport: Transport, metrics: Metrics | None = None, *,
                 make_params: Callable[[dict], Any] | None = None, cancel_poll_s: float = 0.25,
                 metrics_interval_s: float = 1.0, crash_grace_s: float = 1.0, cancel_poll_batch: int = 32,
                 send_threads: int = 8, stream_interval: int = 0, max_hold_s: float = 2.0):
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self.make_params = make_params or _engine_sampling_params
        self.cancel_poll_s = cancel_poll_s
        self.cancel_poll_batch = max(1, cancel_poll_batch)
        self._poll_cursor = 0
        self.metrics_interval_s = metrics_interval_s
        self.crash_grace_s = crash_grace_s
        self.healthy = True
        self.crash_reason = ""
        self._ids = itertools.count()
        self.stream_interval = stream_interval          # tokens a response; 0 = auto
        self.max_hold_s = max_hold_s
        # request id -> (output waiting for more tokens, waiting since, its latest token's arrival)
        self._held: dict[str, tuple[Any, float, float]] = {}
        self.send_threads = max(1, send_threads)
        self._lanes = ThreadPoolExecutor(self.send_threads - 1, thread_name_prefix="fastdecode-send") \
            if self.send_threads > 1 else None
        self._prefix = f"t{os.getpid()}-"
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._crashed_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="fastdecode-sender", daemon=True)
        self._thread.start()

    # ---- execute() side
    def submit(self, sender, get_input: Callable[[str], Any], parameters: str | dict | None = None) -> str | None:
        """Validate and enqueue one request; on failure answer it with a final error response.
        Returns the engine request id, or None when the request was refused."""
        if not self.healthy:
            self._send_error(sender, ErrorInfo(f"model unavailable: the engine crashed ({self.crash_reason}); "
                                               "reload the model", UNAVAILABLE))
            return None
        if not getattr(self.engine, "ready", True):
            self._send_error(sender, ErrorInfo("model unavailable: no R-worker is reachable; retry later",
                                               UNAVAILABLE))
            return None
        try:
            request = parse_request(get_input, parameters)
            self._check_max_tokens(request.sampling)
            try:
                params = [self.make_params(choice_sampling(request.sampling, i)) for i in range(request.n)]
            except Exception as e:   # whatever SamplingParams.from_dict raises is about the client's values
                raise BadRequest(f"sampling_parameters: {e}") from None
        except Exception as e:
            self._send_error(sender, map_exception(e))
            return None
        number = next(self._ids)
        request_id = f"{self._prefix}{number}"
        builder, now, lane = ResponseBuilder(request), time.monotonic(), number % self.send_threads
        lives = [Live(request_id if request.n == 1 else f"{request_id}.{i}", sender, request, builder, now, i,
                      lane=lane) for i in range(request.n)]
        if request.n > 1:
            for live in lives:
                live.siblings = lives
        with self._lock:
            self._live.update((live.request_id, live) for live in lives)
        for i, live in enumerate(lives):
            try:
                self.engine.add_request(request.prompt, params[i], request_id=live.request_id,
                                        on_output=self.on_output)
            except Exception as e:
                with self._lock:
                    for other in lives:
                        self._live.pop(other.request_id, None)
                for other in lives[:i]:
                    self._abort(other)
                self._send_error(sender, map_exception(e))
                return None
        for live in lives:
            live.accepted = True
        return request_id

    def _check_max_tokens(self, sampling: dict) -> None:
        limit = getattr(self.engine, "max_model_len", None)
        n = sampling.get("max_tokens")
        if isinstance(limit, int) and isinstance(n, int) and not isinstance(n, bool) and n > limit:
            raise BadRequest(f"max_tokens {n} exceeds the model's context length ({limit} tokens)")

    # ---- engine loop side
    def on_output(self, out) -> None:
        self._outputs.put(out)

    # ---- sender thread
    def _run(self) -> None:
        next_poll = next_flush = next_release = time.monotonic()
        while True:
            wake = min(next_poll, next_flush, next_release) if self._held else min(next_poll, next_flush)
            timeout = max(0.0, wake - time.monotonic())
            try:
                item = self._outputs.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            batch = [] if item is None else [item]
            while True:                               # drain what is there: one pass, many sends
                try:
                    more = self._outputs.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._handle_all(batch)
                    return
                batch.append(more)
            self._handle_all(batch)
            now = time.monotonic()
            if now >= next_poll:
                self._poll_cancelled()
                self._watch_engine()
                next_poll = now + self.cancel_poll_s
            if now >= next_flush:
                self._flush_metrics()
                next_flush = now + self.metrics_interval_s
            if now >= next_release and self._held:
                next_release = self._release_held(now)

    def _handle_all(self, batch: list) -> None:
        lanes: dict[int, list] = {}
        now = time.monotonic()
        with self._lock:
            interval = self._interval()
            for out in coalesce(batch):
                live = self._live.get(out.request_id)
                if live is not None:
                    out = self._pace(live, out, interval, now)
                    if out is not None:
                        lanes.setdefault(live.lane, []).append(out)
        self._send_lanes(lanes)

    def _send_lanes(self, lanes: dict[int, list]) -> None:
        """Each lane's outputs in order, the lanes side by side on the send threads."""
        groups = list(lanes.values())
        if self._lanes is None or len(groups) < 2:
            for group in groups:
                self._handle_lane(group)
            return
        others = [self._lanes.submit(self._handle_lane, group) for group in groups[1:]]
        self._handle_lane(groups[0])
        for future in others:
            future.result()

    def _interval(self) -> int:
        if self.stream_interval:
            return self.stream_interval
        return auto_interval(len(self._live))

    def _pace(self, live: Live, out, interval: int, now: float):
        """`out` joined to what waits for this request: the output to send now, or None while it
        waits for more tokens. The last output and those up to the first response never wait."""
        held = self._held.pop(live.request_id, None)
        if held is not None:
            out = coalesce([held[0], out])[0]
        # Held tokens go out with this step's output when one more gap like the last would take
        # them past max_hold_s; the timer (_release_held) is for requests whose tokens stop.
        if out.finished or not live.responded or len(out.token_ids) >= interval \
                or (held is not None and 2 * now - held[1] - held[2] >= self.max_hold_s):
            return out
        self._held[live.request_id] = (out, now if held is None else held[1], now)
        return None

    def _release_held(self, now: float) -> float:
        """Send what has waited `max_hold_s` (a request paused by preemption, or a slow step);
        returns when the next of those still held is due."""
        lanes: dict[int, list] = {}
        with self._lock:
            due = [rid for rid, (_, since, _) in self._held.items() if now - since >= self.max_hold_s]
            for rid in due:
                out = self._held.pop(rid)[0]
                live = self._live.get(rid)
                lanes.setdefault(live.lane if live is not None else 0, []).append(out)
            oldest = min((since for _, since, _ in self._held.values()), default=now)
        self._send_lanes(lanes)
        return oldest + self.max_hold_s

    def _handle_lane(self, outs: list) -> None:
        for out in outs:
            try:
                self._handle(out)
            except Exception:
                self.transport.log("error", f"fastdecode: failed to handle an output: {traceback.format_exc()}")

    def _handle(self, out) -> None:
        with self._lock:
            live = self._live.get(out.request_id)
        if live is None or live.done:
            return
        now = time.monotonic()
        if live.first_token is None and (out.token_ids or out.finished):
            live.first_token = now
            if self.metrics is not None and out.token_ids:
                self.metrics.first_token(now - live.arrival, out.num_prompt_tokens)
        if self.metrics is not None:
            self.metrics.tokens(len(out.token_ids))
        outputs, error = live.builder.on_output(out, live.choice, first=not live.responded)
        final = live.builder.done
        if out.finished:
            self._finish(live)
            if self.metrics is not None:
                self.metrics.request_finished(out.finish_reason, now - live.first_token, out.num_output_tokens)
        if error is not None and live.siblings:       # one choice failed: the request ends with it
            for other in live.siblings:
                if not other.done:
                    self._abort(other)
                    self._finish(other)
        if outputs is None and error is None and not final:
            return
        if live.cancelled and not out.finished:
            return
        try:
            self.transport.send(live.sender, outputs, error, final=final)
            live.responded = True
        except Exception as e:                        # the client is gone: stop generating for it
            self.transport.log("warn", f"fastdecode: send failed for {live.request_id} ({e}); aborting it")
            for other in live.siblings or [live]:
                if not other.done:
                    self._abort(other)
        if final:
            for other in live.siblings or [live]:
                other.sender = None  # Triton frees the request's response factory with the sender

    def _finish(self, live: Live) -> None:
        live.done = True
        with self._lock:
            self._live.pop(live.request_id, None)
            self._held.pop(live.request_id, None)

    def _abort(self, live: Live) -> None:
        live.cancelled = True
        try:
            self.engine.abort(live.request_id)
        except Exception as e:
            self.transport.log("warn", f"fastdecode: abort of {live.request_id} failed: {e}")

    def _poll_cancelled(self) -> None:
        """Ask Triton about at most `cancel_poll_batch` live requests per tick, round robin: each
        question is an IPC round trip that wakes a thread of the stub and of the server, taken from
        the cores that generate (32 every 100 ms cost 4% of the throughput at 128 streams against
        32 every second); a cancelled request is seen within N/batch ticks.
        Only accepted requests: submit() may still refuse one on its own thread, and Triton frees
        a request's response factory with its final response, so asking about it then would
        read freed memory (tritonserver segfaults in TRITONBACKEND_ResponseFactoryIsCancelled)."""
        with self._lock:
            candidates = [live for live in self._live.values() if live.accepted and not live.cancelled]
        if not candidates:
            return
        start = self._poll_cursor % len(candidates)
        chosen = (candidates[start:] + candidates[:start])[: self.cancel_poll_batch]
        self._poll_cursor = start + len(chosen)
        for live in chosen:
            try:
                cancelled = self.transport.is_cancelled(live.sender)
            except Exception:
                cancelled = True
            if cancelled:
                self._abort(live)

    def _watch_engine(self) -> None:
        if self.healthy and not getattr(self.engine, "healthy", True):
            self.healthy = False
            self.crash_reason = str(getattr(self.engine, "error", None) or getattr(self.engine, "_error", None)
                                    or "engine loop stopped")
            self._crashed_at = time.monotonic()
            self.transport.log("error", f"fastdecode: engine crashed ({self.crash_reason}); "
                                        "failing live requests and unloading the model")
            # From its own thread: unloading runs finalize(), which stops this sender thread.
            threading.Thread(target=self._unload, name="fastdecode-unload", daemon=True).start()
        if not self.healthy and time.monotonic() - self._crashed_at >= self.crash_grace_s:
            # The engine ends its requests with finish_reason "error"; whatever it missed ends here.
            self._fail_all(ErrorInfo(f"model unavailable: the engine crashed ({self.crash_reason})", UNAVAILABLE))

    def _unload(self) -> None:
        try:
            self.transport.unload()
        except Exception as e:
            self.transport.log("error", f"fastdecode: could not unload the model: {e}")

    def _fail_all(self, error: ErrorInfo) -> None:
        with self._lock:
            lives, self._live = list(self._live.values()), {}
            self._held.clear()
        for live in lives:
            live.done = True
            if live.sender is not None:
                self._send_error(live.sender, error)
            for other in live.siblings or [live]:
                other.sender = None
            if self.metrics is not None:
                self.metrics.request_finished("error", None, 0)

    def _flush_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.flush(self.engine.stats(), engine_trace(self.engine))
        except Exception as e:
            self.transport.log("warn", f"fastdecode: metrics update failed: {e}")

    def _send_error(self, sender, error: ErrorInfo) -> None:
        try:
            self.transport.send(sender, None, error, final=True)
        except Exception as e:
            self.transport.log("warn", f"fastdecode: could not send an error response: {e}")

    # ---- lifecycle
    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine, end the requests still live with an error, stop the sender thread."""
        try:
            self.engine.stop()
        except Exception as e:
            self.transport.log("warn", f"fastdecode: engine.stop failed: {e}")
        self._outputs.put(_STOP)
        self._thread.join(timeout)
        if self._lanes is not None:
            self._lanes.shutdown(wait=not self._thread.is_alive())
        self._fail_all(ErrorInfo("model is unloading", UNAVAILABLE))


def auto_interval(live: int) -> int:
    """Tokens a response carries under stream_interval "auto" with `live` requests in flight."""
    interval, limit = 1, AUTO_STREAMS
    while live > limit and interval < AUTO_MAX_INTERVAL:
        interval, limit = interval * 2, limit * 2
    return interval


def engine_trace(engine) -> list[dict] | None:
    """engine.trace (its newest per-step records, a copy), None for an engine without one. The
    copy is taken while the engine loop appends; should that race raise, the steps are not
    lost: the next push takes them (Metrics hands each step out once, by step number)."""
    try:
        trace = getattr(engine, "trace", None)
    except RuntimeError:                          # deque mutated during the copy
        return None
    return trace if isinstance(trace, list) else None


def coalesce(batch: list) -> list:
    """One output per request: the outputs of a request that queued up while the sender was
    busy go out as one response carrying all their tokens, text and logprobs."""
    merged: dict[str, Any] = {}
    for out in batch:
        prev = merged.get(out.request_id)
        merged[out.request_id] = out if prev is None else replace(
            out, token_ids=prev.token_ids + out.token_ids, text=prev.text + out.text,
            logprobs=None if out.logprobs is None else (prev.logprobs or []) + out.logprobs,
            prompt_logprobs=prev.prompt_logprobs or out.prompt_logprobs)
    return list(merged.values())


def _engine_sampling_params(values: dict):
    from fastdecode.engine import SamplingParams

    return SamplingParams.from_dict(values)


def install_step_fault(engine, flag_file: str) -> None:
    """TEST ONLY (model parameter fault_step_error_file): while `flag_file` exists, the engine step
    fails -- the drill for the crash watchdog. The fault goes into the S-Part forward
    (engine.runner.prefill/decode) so that it raises inside engine.step, where a real fault
    would; an engine without a runner (the unit tests' fake) gets it in step() itself."""
    def faulty(real):
        def call(*args, **kwargs):
            if os.path.exists(flag_file):
                raise RuntimeError(f"injected engine fault ({flag_file} exists)")
            return real(*args, **kwargs)
        return call

    runner = getattr(engine, "runner", None)
    if runner is not None:
        runner.prefill, runner.decode = faulty(runner.prefill), faulty(runner.decode)
    else:
        engine.step = faulty(engine.step)
