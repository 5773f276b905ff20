"""One request's state inside the engine, and the output records it streams."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastdecode.engine.detokenizer import IncrementalDetokenizer
from fastdecode.engine.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]            # new this step
    text: str                       # new text this step (never half a UTF-8 character)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "cancelled" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, on_output: Callable[[RequestOutput], None] | None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.params = params
        self.on_output = on_output
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival = time.monotonic()
        self.generator = None
        if params.seed is not None:   # a CPU generator whatever the device: sample() moves its draws
            self.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""          # output text so far (a stop string cut off)
        self.sent = 0           # characters of self.text already streamed
        self.hold = max((len(s) for s in params.stop), default=1) - 1   # chars that may start a stop string

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, is_stop_token: bool) -> None:
        """Record a sampled token; extend the text and cut at a stop string."""
        self.output_ids.append(token)
        if is_stop_token:
            return
        before = len(self.text)
        self.text += self.detok.push(token)
        self._check_stop_strings(before)

    def _check_stop_strings(self, before: int) -> None:
        if not self.params.stop or len(self.text) == before:
            return
        start = max(0, before - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish("stop", flush=False)

    def finish(self, reason: str, error: str | None = None, flush: bool = True) -> None:
        if self.finished:
            return
        if flush:     # an incomplete character at the end still belongs to the text
            self.text += self.detok.flush()
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error

    def take_output(self, new_tokens: list[int]) -> RequestOutput:
        """The output record for what is new since the last one."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent:end], end
        return RequestOutput(self.request_id, new_tokens, text, self.finished, self.finish_reason,
                             len(self.prompt_ids), len(self.output_ids), self.error)
