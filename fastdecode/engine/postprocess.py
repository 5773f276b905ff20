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
        """seqs ran; logits has a row for each."""
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
