"""After the model ran: sample each sequence's next token, apply the stop rules (stop token,
max_tokens, max_model_len; stop strings are the Sequence's), and stream RequestOutputs.
Also ends requests early (error, cancel) with a last output.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from fastdecode.engine.sampling import sample, token_logprobs
from fastdecode.engine.sequence import RequestOutput, Sequence

log = logging.getLogger("fastdecode.engine")


class Postprocessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int,
                 release: Callable[[Sequence], None]) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.release = release                      # a finished sequence leaves the engine
        self.outputs: list[RequestOutput] = []      # produced since take() last ran
        self.tokens_out = 0

    def run(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """seqs ran; logits has a row for each. Should sampling fail, each row is sampled alone
        and only the rows that fail again end (with the error): one request never fails a step."""
        try:
            tokens, logprobs = self._sample(seqs, logits)
        except Exception:
            log.exception("sampling %d rows failed; sampling them one by one", len(seqs))
            kept = []
            for i, s in enumerate(seqs):
                try:
                    kept.append((s, *self._sample([s], logits[i:i + 1])))
                except Exception as e:          # noqa: BLE001 -- this row's values: its request ends
                    self.finish(s, "error", f"sampling failed: {type(e).__name__}: {e}")
            seqs = [s for s, _, _ in kept]
            tokens = [t[0] for _, t, _ in kept]
            logprobs = [None if lp is None else lp[0] for _, _, lp in kept]
        self._advance(seqs, tokens, logprobs)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor):
        params = [s.params for s in seqs]
        sampled = sample(logits, params, [s.generator for s in seqs],
                         lambda: [s.history for s in seqs], self.eos_token_ids)
        return sampled.tolist(), token_logprobs(logits, params, sampled)

    def _advance(self, seqs: list[Sequence], tokens: list[int], logprobs) -> None:
        for row, (s, tok) in enumerate(zip(seqs, tokens)):
            if s.finished:
                continue
            p = s.params
            stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)
            s.append_token(tok, stop_token)
            self.tokens_out += 1
            if stop_token:
                s.finish("stop")
            elif not s.finished and (len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_model_len):
                s.finish("length")
            if s.finished:
                self.release(s)
            self.emit(s, [tok], None if logprobs is None or logprobs[row] is None else [logprobs[row]])

    def finish(self, s: Sequence, reason: str, error: str | None = None) -> None:
        """End a request now (error, cancel) and tell its caller."""
        if s.finished:
            return
        s.finish(reason, error)
        self.release(s)
        self.emit(s, [])

    def emit(self, s: Sequence, tokens: list[int], logprobs=None) -> None:
        out = s.take_output(tokens, logprobs)
        self.outputs.append(out)
        if s.on_output is not None:
            try:
                s.on_output(out)
            except Exception:
                log.exception("on_output callback of request %s failed", s.request_id)

    def take(self) -> list[RequestOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs
