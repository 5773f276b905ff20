"""The engine: requests in, streamed tokens out.

One step = schedule (abort, preempt, admit), run (decode the running batch with the
backend, prefill the admitted prompts), postprocess (sample, detokenize, stop, free
KV). Between steps requests join and leave (continuous batching).
"""
from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from typing import Callable, Iterator

import torch

from fastdecode.attention import AttentionError, KVCapacityError, KVSpec, create_backend
from fastdecode.config import EngineConfig
from fastdecode.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from fastdecode.engine.model_runner import ModelRunner, StepTimes
from fastdecode.engine.preemption import TOO_LONG, KVBackoff, KVPlan
from fastdecode.engine.sampling import SamplingParams, sample, token_logprobs
from fastdecode.engine.sequence import RequestOutput, Sequence, Status, tokenize_prompt
from fastdecode.model.loader import load_model
from fastdecode.scheduler import Candidate, create_scheduler

log = logging.getLogger("fastdecode.engine")
TRACE_KEEP = 4096            # trace records kept in memory
MAX_REBUILD_ATTEMPTS = 3     # re-prefills of a sequence whose KV keeps getting lost in one step


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.device = config.torch_device
        self.config = config
        loaded = load_model(config.model, config.model_dtype, self.device, config.max_model_len)
        self.model, self.tokenizer, self.args = loaded.model, loaded.tokenizer, loaded.args
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.spec = KVSpec(self.args.num_layers, self.args.num_heads, self.args.num_kv_heads, self.args.head_dim)
        self.backend = create_backend(config, self.spec)
        self.scheduler = create_scheduler(config)
        self.runner = ModelRunner(self.model, self.backend, self.device, config.num_minibatches)

        self.healthy = True
        self._trace: deque[dict] = deque(maxlen=TRACE_KEEP)
        self._trace_file = open(config.trace_path, "a") if config.trace_path else None
        self._lock = threading.Lock()            # waiting, requests, aborts (short holds)
        self._step_lock = threading.RLock()      # one step at a time
        self._wake = threading.Event()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self._aborts: set[str] = set()
        self._outputs: list[RequestOutput] = []  # produced since step() last returned
        self._seq_ids = itertools.count(1)
        self._step = 0
        self._tokens_out = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: str | None = None
        self.kv = KVPlan(lambda: self.backend.kv_room())
        self._backoff = KVBackoff()

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
        if (why := self.kv.too_long(len(prompt_ids))) is not None:
            raise InvalidRequestError(f"prompt too long: {why}")
        request_id = str(request_id) if request_id is not None else uuid.uuid4().hex
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if len(self._waiting) >= self.config.max_waiting:
                raise EngineOverloadedError(f"{len(self._waiting)} requests are waiting (limit "
                                            f"{self.config.max_waiting}); retry later")
            seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params, self.tokenizer, on_output)
            check = getattr(self.scheduler, "check", None)
            if check is not None:
                try:
                    check(self._candidate(seq))
                except ValueError as e:
                    raise InvalidRequestError(str(e)) from None
            self._requests[request_id] = seq
            self._waiting.append(seq)
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV is freed now (or at the end of a step in flight)."""
        with self._lock:
            seq = self._requests.get(request_id)
            if seq is None or seq.finished:
                return False
            self._aborts.add(request_id)
        if self._step_lock.acquire(blocking=False):
            try:
                self._process_aborts()
            finally:
                self._step_lock.release()
        return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

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
                outputs, self._outputs = self._outputs, []
            return outputs

    def _run_step(self) -> None:
        t0 = time.perf_counter()
        self.runner.times = StepTimes()
        self._process_aborts()
        self._make_room()
        decoding = list(self._running)
        admitted = self._admit()
        sampled: list[Sequence] = []
        logits = []

        if decoding:
            res = self.runner.decode([s.seq_id for s in decoding], [s.all_ids[-1] for s in decoding],
                                     [s.num_tokens - 1 for s in decoding])
            sampled += [decoding[r] for r in res.rows]
            logits.append(res.logits)
            by_id = {s.seq_id: s for s in decoding}
            for sid, why in res.failed.items():
                self._finish(by_id[sid], "error", f"attention failed: {why}")
            self._refused([by_id[sid] for sid in res.out_of_kv], "while decoding")
            rebuild = [by_id[sid] for sid in res.lost]
        else:
            rebuild = []

        prefill = admitted
        for attempt in range(MAX_REBUILD_ATTEMPTS + 1):
            rebuild = self._reopen(rebuild, last_try=attempt == MAX_REBUILD_ATTEMPTS)
            batch = prefill + rebuild
            if not batch:
                break
            refused: list[int] = []
            try:
                out, lost = self.runner.prefill([s.seq_id for s in batch], [s.all_ids for s in batch], refused)
            except AttentionError as e:
                if isinstance(e, KVCapacityError):
                    self._refused(batch, f"during prefill: {e}")
                else:
                    for s in batch:
                        self._finish(s, "error", f"attention backend failure during prefill: {e}")
                break
            self._refused([s for s in batch if s.seq_id in refused], "during prefill")
            lost_set = set(lost)
            keep = [i for i, s in enumerate(batch) if s.seq_id not in lost_set and s.status is Status.RUNNING]
            sampled += [batch[i] for i in keep]
            logits.append(out[keep])
            prefill, rebuild = [], [s for s in batch if s.seq_id in lost_set]

        if sampled:
            self._postprocess(sampled, logits[0] if len(logits) == 1 else torch.cat(logits))
        self._process_aborts()
        self._record(t0, len(sampled), len(admitted))

    def _candidate(self, seq: Sequence) -> Candidate:
        """What the scheduler sees: the most context this request can reach (a preempted one's too)."""
        room = self.max_model_len - seq.num_tokens
        return Candidate(seq.seq_id, seq.num_tokens, min(seq.params.max_tokens - len(seq.output_ids), room))

    def _admit(self) -> list[Sequence]:
        with self._lock:
            room = max(0, self.config.max_running - len(self._running))
            head = list(itertools.islice(self._waiting, room))
        if not head or not self._backoff.due(bool(self._running)):
            return []
        cands = [self._candidate(s) for s in head]
        n = min(self.scheduler.admit(self._step, cands, len(self._running)), len(head))
        n = min(n, self.kv.admissible(head[:n], self._running), self._backoff.limit() or n) if n > 0 else 0
        if n <= 0:
            return []
        n = self._open_kv(head[:n])
        if n <= 0:
            return []
        chosen = head[:n]
        with self._lock:
            for s in chosen:
                self._waiting.remove(s)
                s.status = Status.RUNNING
                self._running.append(s)
        self.scheduler.on_admitted(self._step, cands[:n])
        return chosen

    def _open_kv(self, chosen: list[Sequence]) -> int:
        """Open KV for the longest prefix of `chosen` the backend has room for now (halving the
        prefix on each capacity refusal; the backend's open is all or nothing); returns its
        length. Refused requests stay waiting and are retried later. Any other failure ends
        the requests with an error, and never the engine."""
        k, refusal = len(chosen), None
        while k > 0:
            ids = [s.seq_id for s in chosen[:k]]
            try:
                self.backend.open(ids)
            except KVCapacityError as e:
                refusal, k = e, k // 2
                continue
            except Exception as e:  # noqa: BLE001 -- a failed open must not take every request down
                if isinstance(e, AttentionError):
                    message = f"attention backend failure: {e}"
                else:
                    log.exception("opening KV for %d sequence(s) failed", len(ids))
                    message = f"opening KV failed: {type(e).__name__}: {e}"
                    self._close_kv(chosen[:k])          # whatever it left open (close is idempotent)
                for s in chosen[:k]:
                    self._finish(s, "error", message)
                return 0
            self._backoff.accepted()
            return k
        self._backoff.refused(refusal, len(self._waiting))
        return 0

    def _reopen(self, seqs: list[Sequence], last_try: bool) -> list[Sequence]:
        """Fresh KV for sequences whose KV was lost; those that cannot get one end with an error."""
        if not seqs:
            return []
        ids = [s.seq_id for s in seqs]
        reason = "KV lost repeatedly" if last_try else None
        if reason is None:
            try:
                self.backend.close(ids)
                self.backend.open(ids)
                return seqs
            except AttentionError as e:
                reason = f"KV lost and could not be rebuilt: {e}"
        for s in seqs:
            self._finish(s, "error", f"attention backend failure: {reason}")
        return []

    def _postprocess(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        params = [s.params for s in seqs]
        sampled = sample(logits, params, [s.generator for s in seqs],
                         lambda: [s.history for s in seqs], self.eos_token_ids)
        logprobs = token_logprobs(logits, params, sampled)
        tokens = sampled.tolist()
        for row, (s, tok) in enumerate(zip(seqs, tokens)):
            if s.finished:
                continue
            p = s.params
            stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)
            s.append_token(tok, stop_token)
            self._tokens_out += 1
            if stop_token:
                s.finish("stop")
            elif not s.finished and (len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_model_len):
                s.finish("length")
            if s.finished:
                self._release(s)
            self._emit(s, [tok], None if logprobs is None or logprobs[row] is None else [logprobs[row]])

    def _finish(self, s: Sequence, reason: str, error: str | None = None) -> None:
        """End a request now (error, cancel) and tell its caller."""
        if s.finished:
            return
        s.finish(reason, error)
        self._release(s)
        self._emit(s, [])

    def _release(self, s: Sequence) -> None:
        was_running = s in self._running
        if was_running:
            self._close_kv([s])
            self._backoff.frees += 1
            self.scheduler.on_finished(self._step, s.seq_id, len(s.output_ids))
        with self._lock:
            if was_running:
                self._running.remove(s)
            elif s in self._waiting:
                self._waiting.remove(s)
            self._requests.pop(s.request_id, None)
            self._aborts.discard(s.request_id)

    def _close_kv(self, seqs: list[Sequence]) -> None:
        try:
            self.backend.close([s.seq_id for s in seqs])
        except Exception:            # freeing must not take the engine down
            log.exception("closing KV of sequence(s) %s failed", [s.seq_id for s in seqs][:8])

    def _make_room(self) -> None:
        """Before a decode step: preempt the youngest running sequences the KV store cannot grow."""
        doomed, victims = self.kv.victims(self._running)
        for s in doomed:
            self._finish(s, "error", TOO_LONG)
        self._preempt(victims)

    def _refused(self, seqs: list[Sequence], when: str) -> None:
        """The backend had no KV for these running sequences in the step: preempt them (and pause
        admission until KV is freed), unless one is all that runs: it ends with an error."""
        if len(self._running) == 1 and seqs:
            self._finish(seqs[0], "error", f"out of KV capacity {when}")
        elif seqs:
            self._preempt(seqs)
            self._backoff.refused(f"KV refused {when}", len(self._waiting), cap=max(1, len(seqs) // 2))

    def _preempt(self, seqs: list[Sequence]) -> None:
        """Free these running sequences' KV; they wait first in line, to be recomputed (preemption.py)."""
        if not seqs:
            return
        self._close_kv(seqs)
        with self._lock:
            for s in sorted(seqs, key=lambda s: s.seq_id, reverse=True):
                self._running.remove(s)
                s.status = Status.WAITING
                self._waiting.appendleft(s)
        for s in seqs:
            self.scheduler.on_preempted(self._step, s.seq_id)
        self.kv.preemptions += len(seqs)
        log.info("preempted %d sequence(s) for lack of KV; %d run on", len(seqs), len(self._running))

    def _emit(self, s: Sequence, tokens: list[int], logprobs=None) -> None:
        out = s.take_output(tokens, logprobs)
        self._outputs.append(out)
        if s.on_output is not None:
            try:
                s.on_output(out)
            except Exception:
                log.exception("on_output callback of request %s failed", s.request_id)

    def _process_aborts(self) -> None:
        with self._lock:
            ids, self._aborts = self._aborts, set()
            seqs = [self._requests[r] for r in ids if r in self._requests]
        for s in seqs:
            self._finish(s, "cancelled")

    def _die(self, message: str) -> None:
        self.healthy = False
        self._error = message
        with self._lock:
            seqs = list(self._running) + list(self._waiting)
        for s in seqs:
            self._finish(s, "error", message)

    def _record(self, t0: float, batch_size: int, num_prefill: int) -> None:
        t = self.runner.times
        step_time = time.perf_counter() - t0
        r_time = t.r_busy()
        rec = {"step": self._step, "time": time.time(), "batch_size": batch_size, "num_prefill": num_prefill,
               "context_tokens": sum(s.num_tokens for s in self._running),
               "s_time": max(0.0, step_time - t.s_wait - t.backend_calls), "r_time": r_time,
               "s_wait": t.s_wait, "r_wait": max(0.0, step_time - r_time) if t.r_intervals else None,
               "step_time": step_time}
        self._step += 1
        self._trace.append(rec)
        if self._trace_file is not None:
            self._trace_file.write(json.dumps(rec) + "\n")
            self._trace_file.flush()

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
            try:
                self.step()
            except Exception:
                return           # step() has marked us unhealthy and ended every request

    def stop(self) -> None:
        """Stop the loop; requests still in flight end as cancelled; the backend shuts down."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._step_lock:
            with self._lock:
                seqs = list(self._running) + list(self._waiting)
            for s in seqs:
                self._finish(s, "cancelled")
            self.backend.shutdown()
            if self._trace_file is not None:
                self._trace_file.close()
                self._trace_file = None

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
        """The most recent per-step records (at most TRACE_KEEP), oldest first."""
        return list(self._trace)

    @property
    def ready(self) -> bool:
        """For a readiness probe: healthy, and the backend can open KV (a live R-worker, say)."""
        return self.healthy and self.backend.available()

    def stats(self) -> dict:
        with self._lock:
            running, waiting = len(self._running), len(self._waiting)
        return {"healthy": self.healthy, "ready": self.ready, "running": running, "waiting": waiting,
                "steps": self._step, "tokens": self._tokens_out, "preemptions": self.kv.preemptions,
                "kv": self.backend.stats(), "scheduler": self.scheduler.stats()}
