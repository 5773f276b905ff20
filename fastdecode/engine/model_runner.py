"""Runs the S-Part for a batch and hands attention to the backend.

Decode splits the batch into mini-batches that ping-pong per layer (the paper's
"Pipeline"): while the backend computes the attention of mini-batch A at layer
i, the S-Part finishes layer i-1 of B and starts layer i of B, and so on. A
backend that computes on the S-Part's own cores (`overlaps` False) gets the
whole batch at once: there is nothing to overlap.

    layer i:  [post(i-1) B | pre(i) B] submit B   [post(i) A | pre(i+1) A] submit A ...
    backend:            attn(i) A                           attn(i) B

Sequences whose KV a backend loses (SequencesLost) drop out of the step; the
engine rebuilds them by prefilling all their tokens again. So do those the backend
has no KV for (KVCapacityError: the mini-batch, or an R-worker's rows of it): the
engine preempts them (fastdecode/engine/preemption.py). Any other attention
failure ends only the sequences it concerns: rows whose q, k or v are not finite
(or beyond fp16's range, which the KV cache stores) are failed and the rest of
the mini-batch retried once; a failure with no such row fails the mini-batch.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from fastdecode.attention.base import AttentionBackend, AttentionError, KVCapacityError, SequencesLost
from fastdecode.engine.sampling import TokenLogprobs, logprobs_of
from fastdecode.model.llama import LlamaModel

PROMPT_LOGITS_ROWS = 256   # prompt positions per LM-head call for prompt log probabilities (memory: rows x vocab)
FRESH_MAP_BYTES = 32 << 20  # glibc malloc's largest mmap threshold: bigger blocks are mapped fresh each time


@dataclass
class StepTimes:
    """Where a step's time went (seconds), for the trace."""
    backend_calls: float = 0.0       # inside submit_decode / prefill calls (R work on our thread, or sending)
    s_wait: float = 0.0              # blocked on attention futures
    r_intervals: list[tuple[float, float]] = field(default_factory=list)   # (submitted, done) per call

    def r_busy(self) -> float:
        """Length of the union of the intervals an attention call was in flight."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.r_intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


@dataclass
class MiniBatch:
    seq_ids: list[int]
    rows: torch.Tensor          # row of each sequence in the step's batch
    h: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]     # cos, sin rows of its positions
    future: Future | None = None
    submitted: float = 0.0
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # what was submitted (for a retry)


@dataclass
class DecodeResult:
    logits: torch.Tensor        # [len(rows), vocab] in the model's dtype; overwritten by the next decode
    rows: list[int]             # batch rows that got logits
    lost: list[int]             # seq ids whose KV was lost
    out_of_kv: list[int]        # seq ids that could not grow their KV
    failed: dict[int, str] = field(default_factory=dict)   # seq id -> why its attention failed


class ModelRunner:
    min_minibatch = 4    # smaller batches run as one: splitting them only adds overhead

    def __init__(self, model: LlamaModel, backend: AttentionBackend, device: str, num_minibatches: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.num_minibatches = num_minibatches
        self.times = StepTimes()
        self._logits: torch.Tensor | None = None

    # -- decode -------------------------------------------------------------------------
    def decode(self, seq_ids: list[int], last_tokens: list[int], positions: list[int]) -> DecodeResult:
        n = len(seq_ids)
        tokens = torch.tensor(last_tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        h = self.model.embed(tokens)
        rope = self.model.rope_tables(pos, h.dtype)
        parts = max(1, min(self.num_minibatches if self.backend.overlaps else 1, n // self.min_minibatch))
        bounds = [n * j // parts for j in range(parts + 1)]
        mbs = [MiniBatch(seq_ids[a:b], torch.arange(a, b), h[a:b], (rope[0][a:b], rope[1][a:b]))
               for a, b in zip(bounds, bounds[1:])]
        lost: list[int] = []
        out_of_kv: list[int] = []
        failed: dict[int, str] = {}
        num_layers = self.model.args.num_layers
        for layer in range(num_layers + 1):
            for mb in mbs:
                if mb.future is not None:
                    self._finish_layer(layer - 1, mb, lost, out_of_kv, failed)
                if layer < num_layers and mb.seq_ids:
                    self._start_layer(layer, mb)
        alive = [mb for mb in mbs if mb.seq_ids]
        if not alive:
            return DecodeResult(h.new_empty((0, self.model.args.vocab_size)), [], lost, out_of_kv, failed)
        h = torch.cat([mb.h for mb in alive])
        logits = self.model.logits(h, out=self._logits_buffer(h.shape[0], h.dtype))
        rows = torch.cat([mb.rows for mb in alive]).tolist()
        return DecodeResult(logits, rows, lost, out_of_kv, failed)

    def _logits_buffer(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[rows, vocab], the same memory every step (valid until the next decode), where a fresh
        tensor would be mapped from the kernel and faulted in page by page on every step (glibc
        maps blocks above 32 MiB afresh: at 512 rows of bf16 the LM head took 32 ms, not 16).
        None below that, where a fresh tensor comes from malloc's free lists at no extra cost."""
        vocab = self.model.args.vocab_size
        if self.device == "cpu" and rows * vocab * dtype.itemsize <= FRESH_MAP_BYTES:
            return None
        buf = self._logits
        if buf is None or buf.shape[0] < rows or buf.dtype != dtype:
            self._logits = buf = torch.empty((-(-rows // 64) * 64, vocab), dtype=dtype,
                                             device=self.device)
        return buf[:rows]

    def _start_layer(self, layer: int, mb: MiniBatch) -> None:
        q, k, v = self.model.pre_attention(layer, mb.h, mb.rope)
        mb.qkv = q.cpu(), k.cpu(), v.cpu()
        t = time.perf_counter()
        mb.future = self._submit(layer, mb.seq_ids, *mb.qkv)
        done = time.perf_counter()
        self.times.backend_calls += done - t
        mb.submitted = t
        mb.future.add_done_callback(lambda _f, t=t: self.times.r_intervals.append((t, time.perf_counter())))

    def _submit(self, layer: int, seq_ids: list[int], q, k, v) -> Future:
        try:
            return self.backend.submit_decode(layer, seq_ids, q, k, v)
        except Exception as e:          # a synchronous failure travels the same way as an async one
            future: Future = Future()
            future.set_exception(e)
            return future

    def _finish_layer(self, layer: int, mb: MiniBatch, lost: list[int], out_of_kv: list[int],
                      failed: dict[int, str]) -> None:
        t = time.perf_counter()
        future, mb.future = mb.future, None
        try:
            try:
                o = future.result(timeout=self.backend.decode_backstop_s)
            except FutureTimeout:
                raise AttentionError(f"no attention result within {self.backend.decode_backstop_s:g} s") from None
        except SequencesLost as e:
            o = self._drop(mb, e, lost)
        except KVCapacityError as e:
            o = self._drop(mb, e, out_of_kv)
        except Exception as e:
            o = self._isolate_failure(layer, mb, e, failed)
        finally:
            self.times.s_wait += time.perf_counter() - t
        if o is not None and mb.seq_ids:
            mb.h = self.model.post_attention(layer, mb.h, o.to(self.device))

    def _isolate_failure(self, layer: int, mb: MiniBatch, error: Exception, failed: dict[int, str]):
        """Fail the rows that caused `error` and retry the rest once; -> their output, or None."""
        q, k, v = mb.qkv
        fp16_max = torch.finfo(torch.float16).max
        ok = torch.ones(len(mb.seq_ids), dtype=torch.bool)
        for x in (q, k, v):
            rows = x.reshape(len(mb.seq_ids), -1).float()
            ok &= torch.isfinite(rows).all(dim=1) & (rows.abs() <= fp16_max).all(dim=1)
        keep = ok.nonzero().flatten().tolist()
        if len(keep) == len(mb.seq_ids):            # no row to blame: the call failed as a whole
            failed.update((s, f"{type(error).__name__}: {error}") for s in mb.seq_ids)
            self._keep(mb, [])
            return None
        for i in (~ok).nonzero().flatten().tolist():
            failed[mb.seq_ids[i]] = "attention inputs not finite or beyond fp16 range"
        self._keep(mb, keep)
        if not keep:
            return None
        idx = torch.tensor(keep)
        try:
            return self._submit(layer, mb.seq_ids, q[idx], k[idx], v[idx]).result(self.backend.decode_backstop_s)
        except Exception as e:
            failed.update((s, f"{type(e).__name__}: {e}") for s in mb.seq_ids)
            self._keep(mb, [])
            return None

    def _drop(self, mb: MiniBatch, e: SequencesLost | KVCapacityError, into: list[int]):
        """Drop the rows `e` names (all without a partial output) into `into`; -> o of the rest."""
        gone = set(e.seq_ids) if e.seq_ids is not None and e.output is not None else set(mb.seq_ids)
        into.extend(s for s in mb.seq_ids if s in gone)
        keep = [i for i, s in enumerate(mb.seq_ids) if s not in gone]
        self._keep(mb, keep)
        return e.output[keep] if keep else None

    @staticmethod
    def _keep(mb: MiniBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long)
        mb.seq_ids = [mb.seq_ids[i] for i in keep]
        mb.rows = mb.rows[idx]
        idx = idx.to(mb.h.device)
        mb.h = mb.h[idx]
        mb.rope = (mb.rope[0][idx], mb.rope[1][idx])

    # -- prefill ------------------------------------------------------------------------
    def _prompt_logprobs(self, h: torch.Tensor, prompt: tuple[int, ...], top_n: int) -> list[TokenLogprobs]:
        """h [len(prompt), hidden] after the last layer: row t scores prompt token t + 1."""
        out = [TokenLogprobs(prompt[0], None, [])]
        for a in range(0, len(prompt) - 1, PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, len(prompt) - 1)
            out += logprobs_of(self.model.logits(h[a:b]), list(prompt[a + 1:b + 1]), top_n)
        return out

    def prefill(self, seq_ids: list[int], token_lists: list[list[int]], refused: list[int] | None = None,
                prompt_logprobs: dict[int, int | list[TokenLogprobs]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Run whole prompts through the S-Part (attention here, SDPA causal) and store
        their k, v in the backend. Identical prompts (the n choices of one request) run once
        and their k, v are stored for each sequence. Returns the last-position logits [n, vocab]
        of every sequence and the ids whose KV was lost on the way (their logits are unusable).
        With `refused`, the ids an R-worker refused KV for are dropped into it like lost ones;
        else, and for a whole call refused, KVCapacityError propagates; any other backend
        failure as an AttentionError. `prompt_logprobs` maps ids to a top-N: each gets the log
        probability of every token of its prompt there instead (sampling.logprobs_of; the first
        token has none), the LM head run over PROMPT_LOGITS_ROWS positions at a time."""
        unique: dict[tuple[int, ...], int] = {}
        prompt_of = [unique.setdefault(tuple(t), len(unique)) for t in token_lists]
        prompts = list(unique)
        lens = [len(t) for t in prompts]
        tokens = torch.tensor([t for ts in prompts for t in ts], device=self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        h = self.model.embed(tokens)
        rope = self.model.rope_tables(pos, h.dtype)
        alive = list(range(len(seq_ids)))
        lost: list[int] = []
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        for layer in range(self.model.args.num_layers):
            q, k, v = self.model.pre_attention(layer, h, rope)
            o = self.model.prefill_attention(q, k, v, lens)
            if alive:
                if len(alive) == len(seq_ids) and len(prompts) == len(seq_ids):
                    ks, vs = k.contiguous().cpu(), v.contiguous().cpu()
                else:
                    idx = torch.cat([torch.arange(starts[prompt_of[i]], starts[prompt_of[i] + 1])
                                     for i in alive]).to(k.device)
                    ks, vs = k[idx].cpu(), v[idx].cpu()
                t = time.perf_counter()
                try:
                    self.backend.prefill(layer, [seq_ids[i] for i in alive], [lens[prompt_of[i]] for i in alive],
                                         ks, vs)
                except (SequencesLost, KVCapacityError) as e:
                    if isinstance(e, KVCapacityError) and (refused is None or e.seq_ids is None):
                        raise
                    gone = set(e.seq_ids)
                    (lost if isinstance(e, SequencesLost) else refused).extend(
                        seq_ids[i] for i in alive if seq_ids[i] in gone)
                    alive = [i for i in alive if seq_ids[i] not in gone]
                except AttentionError:
                    raise
                except Exception as e:      # e.g. a non-finite k: the engine fails this prefill, not itself
                    raise AttentionError(f"{type(e).__name__}: {e}") from e
                finally:
                    done = time.perf_counter()
                    self.times.backend_calls += done - t
                    self.times.r_intervals.append((t, done))
            h = self.model.post_attention(layer, h, o)
        last = torch.tensor(starts[1:], device=self.device) - 1
        logits = self.model.logits(h[last])
        for i, sid in enumerate(seq_ids):
            if prompt_logprobs is not None and sid in prompt_logprobs:
                p = prompt_of[i]
                prompt_logprobs[sid] = self._prompt_logprobs(h[starts[p]:starts[p + 1]], prompts[p],
                                                             prompt_logprobs[sid])
        return (logits if len(prompts) == len(seq_ids) else logits[torch.tensor(prompt_of, device=logits.device)]), lost
