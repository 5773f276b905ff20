"""The engine: requests in, streamed tokens out.

One step = schedule (abort, preempt, admit), run (decode the running batch with the
backend, prefill the admitted prompts), postprocess (sample, detokenize, stop, free
KV). Between steps requests join and leave (continuous batching).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Callable, Iterator

import torch

from fastdecode.attention import KVSpec, create_backend
from fastdecode.config import EngineConfig
from fastdecode.engine.errors import EngineDeadError, InvalidRequestError
from fastdecode.engine.kv_recovery import KVRecovery
from fastdecode.engine.model_runner import ModelRunner, StepTimes
from fastdecode.engine.postprocess import Postprocessor
from fastdecode.engine.preemption import KVPlan
from fastdecode.engine.requests import RequestTable
from fastdecode.engine.sampling import SamplingParams
from fastdecode.engine.sequence import RequestOutput, Sequence, tokenize_prompt
from fastdecode.engine.step_trace import StepTrace
from fastdecode.model.loader import load_model
from fastdecode.scheduler import Candidate, create_scheduler

log = logging.getLogger("fastdecode.engine")


def on_a_thread_of_its_own(fn: Callable, *args):
    """fn(*args) on a thread that ends when it returns; its result, or its exception raised here.

    torch's CPU ops run on OpenMP (libgomp), which keeps a pool of worker threads for every
    thread that ran a parallel op. Once the pools hold more threads than there are cores, the
    workers stop spinning between ops and sleep, and every op pays a wake-up: a decode step on
    the engine's loop thread took twice as long (27 ms -> 55 ms at batch 1 on 2 cores) when the
    thread that built the engine (Triton's main thread) had loaded the model. A thread that
    ends takes its pool with it."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 -- re-raised on the caller's thread
            result.append((False, e))
    t = threading.Thread(target=run, name="fastdecode-load")
    t.start()
    t.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.device = config.torch_device
        self.config = config
        loaded = on_a_thread_of_its_own(load_model, config.model, config.dtype, self.device,
                                        config.max_model_len, config.max_running, config.cpu_gemm)
        self.model, self.tokenizer, self.args = loaded.model, loaded.tokenizer, loaded.args
        self.max_model_len = loaded.max_model_len
        self.dtype = loaded.dtype.dtype
        self.dtype_choice = loaded.dtype.as_dict()
        log.info("fastdecode: dtype %s (%s)", self.dtype, loaded.dtype.reason)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.spec = KVSpec(self.args.num_layers, self.args.num_heads, self.args.num_kv_heads, self.args.head_dim)
        self.backend = on_a_thread_of_its_own(create_backend, config, self.spec)
        self.scheduler = create_scheduler(config)
        self.runner = ModelRunner(self.model, self.backend, self.device, config.num_minibatches)

        self.healthy = True
        self.requests = RequestTable()
        self.kv = KVPlan(lambda: self.backend.kv_room())
        self.postprocessor = Postprocessor(self.eos_token_ids, self.max_model_len, self._release)
        self.kv_recovery = KVRecovery(self.runner, self.requests, self.kv, self.scheduler,
                                      lambda: self._step, self.postprocessor.finish)
        self.step_trace = StepTrace(config.trace_path)
        self._step_lock = threading.RLock()      # one step at a time
        self._wake = threading.Event()
        self._step = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: str | None = None

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                    request_id: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> str:
        if not self.healthy:
            raise EngineDeadError(f"engine is not healthy: {self._error}")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
        prompt_ids = tokenize_prompt(prompt, self.tokenizer, self.args.vocab_size, self.max_model_len)
        if params.logit_bias and params.logit_bias[-1][0] >= self.args.vocab_size:
            raise InvalidRequestError(f"logit_bias token id {params.logit_bias[-1][0]} is not in the vocabulary "
                                      f"[0, {self.args.vocab_size})")
        if (why := self.kv.too_long(len(prompt_ids))) is not None:
            raise InvalidRequestError(f"prompt too long: {why}")
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex

        def new_sequence(seq_id: int) -> Sequence:
            seq = Sequence(seq_id, request_id, prompt_ids, params, self.tokenizer, on_output)
            check = getattr(self.scheduler, "check", None)
            if check is not None:
                try:
                    check(self._candidate(seq))
                except ValueError as e:
                    raise InvalidRequestError(str(e)) from None
            return seq
        self.requests.add(request_id, new_sequence, self.config.max_waiting)
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV is freed now (or at the end of a step in flight)."""
        if not self.requests.mark_abort(request_id):
            return False
        if self._step_lock.acquire(blocking=False):
            try:
                self._process_aborts()
            finally:
                self._step_lock.release()
        return True

    def has_unfinished(self) -> bool:
        return self.requests.has_unfinished()

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._step_lock:
            if not self.healthy:
                raise EngineDeadError(f"engine is not healthy: {self._error}")
            try:
                with torch.inference_mode():
                    self._run_step()
            except Exception as e:
                log.exception("engine step failed")
                self._die(f"engine step failed: {type(e).__name__}: {e}")
                raise
            finally:
                outputs = self.postprocessor.take()
            return outputs

    def _run_step(self) -> None:
        t0 = time.perf_counter()
        self.runner.times = StepTimes()
        decoding, admitted = self._schedule()
        seqs, logits = self._run(decoding, admitted)
        if seqs:
            self.postprocessor.run(seqs, logits)
        self._process_aborts()
        self.step_trace.record(self._step, t0, self.runner.times, len(seqs), len(admitted), self.requests.running)
        self._step += 1

    def _schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """(the running sequences to decode, the waiting ones admitted to prefill)"""
        self._process_aborts()
        self.kv_recovery.make_room()
        decoding = list(self.requests.running)
        return decoding, self._admit()

    def _admit(self) -> list[Sequence]:
        head = self.requests.head(self.config.max_running)
        if not head or not self.kv_recovery.admission_due():
            return []
        cands = [self._candidate(s) for s in head]
        n = min(self.scheduler.admit(self._step, cands, len(self.requests.running)), len(head))
        n = self.kv_recovery.admissible(head[:n]) if n > 0 else 0
        n = self.kv_recovery.open(head[:n]) if n > 0 else 0
        if n <= 0:
            return []
        self.requests.start_running(head[:n])
        self.scheduler.on_admitted(self._step, cands[:n])
        return head[:n]

    def _candidate(self, seq: Sequence) -> Candidate:
        """What the scheduler sees: the most context this request can reach (a preempted one's too)."""
        room = self.max_model_len - seq.num_tokens
        return Candidate(seq.seq_id, seq.num_tokens, min(seq.params.max_tokens - len(seq.output_ids), room))

    def _run(self, decoding: list[Sequence], admitted: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Decode and prefill; the sequences to sample, and their logits (a row each)."""
        seqs: list[Sequence] = []
        logits: list[torch.Tensor] = []
        lost: list[Sequence] = []
        if decoding:
            res = self.runner.decode([s.seq_id for s in decoding], [s.all_ids[-1] for s in decoding],
                                     [s.num_tokens - 1 for s in decoding])
            seqs += [decoding[r] for r in res.rows]
            logits.append(res.logits)
            by_id = {s.seq_id: s for s in decoding}
            for sid, why in res.failed.items():
                self.postprocessor.finish(by_id[sid], "error", f"attention failed: {why}")
            self.kv_recovery.refused([by_id[sid] for sid in res.out_of_kv], "while decoding")
            lost = [by_id[sid] for sid in res.lost]
        prefilled, prefill_logits = self.kv_recovery.prefill(admitted, lost)
        seqs += prefilled
        logits += prefill_logits
        if not seqs:
            return seqs, None
        return seqs, logits[0] if len(logits) == 1 else torch.cat(logits)

    def _release(self, s: Sequence) -> None:
        was_running = s in self.requests.running
        if was_running:
            self.kv_recovery.free(s)
            self.scheduler.on_finished(self._step, s.seq_id, len(s.output_ids))
        self.requests.remove(s, was_running)

    def _process_aborts(self) -> None:
        for s in self.requests.take_aborts():
            self.postprocessor.finish(s, "cancelled")

    def _die(self, message: str) -> None:
        self.healthy = False
        self._error = message
        for s in self.requests.unfinished():
            self.postprocessor.finish(s, "error", message)

    # -- background loop and helpers --------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fastdecode-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping and self.healthy:
            if not self.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            hold = self._burst_hold()
            if hold > 0:
                self._wake.wait(hold)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:
                return           # step() has marked us unhealthy and ended every request

    def _burst_hold(self) -> float:
        """Seconds the engine waits before its next step while a burst is arriving: requests keep
        coming less than burst_gap_ms apart, every request it holds came at most burst_window_ms
        ago (so nothing that was already decoding waits), and less than a batch's worth is there.
        Prefilled as they came, the early ones' steps took the cores the later ones needed to
        arrive, and a burst trickled in over many steps. Through Triton a burst's second request
        came 5-6 ms after its first: the first, prefilled alone, then waits for the rest."""
        gap, window = self.config.burst_gap_ms / 1e3, self.config.burst_window_ms / 1e3
        if gap <= 0 or window <= 0:
            return 0.0
        with self.requests.lock:
            waiting, running = self.requests.waiting, self.requests.running
            if not waiting or len(waiting) + len(running) >= self.config.max_running:
                return 0.0
            first = min([waiting[0].arrival] + [s.arrival for s in running])
            last = waiting[-1].arrival
        return max(0.0, min(last + gap, first + window) - time.monotonic())

    def stop(self) -> None:
        """Stop the loop; requests still in flight end as cancelled; the backend shuts down."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._step_lock:
            for s in self.requests.unfinished():
                self.postprocessor.finish(s, "cancelled")
            self.backend.shutdown()
            self.step_trace.close()

    def generate(self, prompt: str | list[int], params: SamplingParams | dict | None = None,
                 request_id: str | None = None) -> Iterator[RequestOutput]:
        """Stream one request's outputs. Drives step() itself unless the loop is running."""
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        rid = self.add_request(prompt, params, request_id, on_output=outputs.put)
        finished = False
        try:
            while not finished:
                if self._thread is None:
                    while outputs.empty():
                        self.step()
                out = outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    @property
    def trace(self) -> list[dict]:
        """The most recent per-step records (at most step_trace.KEEP), oldest first."""
        return list(self.step_trace.records)

    @property
    def ready(self) -> bool:
        """For a readiness probe: healthy, and the backend can open KV (a live R-worker, say)."""
        return self.healthy and self.backend.available()

    def stats(self) -> dict:
        running, waiting = self.requests.counts()
        return {"healthy": self.healthy, "ready": self.ready, "running": running, "waiting": waiting,
                "steps": self._step, "tokens": self.postprocessor.tokens_out, "preemptions": self.kv.preemptions,
                "kv": self.backend.stats(), "scheduler": self.scheduler.stats()}
