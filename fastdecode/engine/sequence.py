"""One request's state inside the engine, and the output records it streams."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastdecode.engine.detokenizer import IncrementalDetokenizer
from fastdecode.engine.errors import InvalidRequestError
from fastdecode.engine.sampling import SamplingParams, TokenHistory, TokenLogprobs

MAX_STOP_STRINGS = 16        # stop strings of one request; each is looked for at every token
MAX_STOP_CHARS = 256         # characters of one stop string
MAX_CHARS_PER_TOKEN = 32     # a text prompt longer than max_model_len times this is refused untokenized


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
    logprobs: list[TokenLogprobs] | None = None   # one per token of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None   # one per prompt token, on the first output, when asked


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, on_output: Callable[[RequestOutput], None] | None) -> None:
        check_stop_strings(params.stop)
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
        # token ids as the sampler reads them (penalties, min_tokens): only for requests that need them
        self.history = TokenHistory(prompt_ids) if params.needs_history else None
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""          # output text so far (a stop string cut off)
        self.sent = 0           # characters of self.text already streamed
        self.prompt_logprobs: list[TokenLogprobs] | None = None   # computed at the first prefill, sent once
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
        if self.history is not None:
            self.history.append(token)
        if is_stop_token:
            return
        before = len(self.text)
        self.text += self.detok.push(token)
        self._check_stop_strings(before)

    def _check_stop_strings(self, before: int) -> None:
        if not self.params.stop or len(self.text) == before or len(self.output_ids) < self.params.min_tokens:
            return
        text = self.text     # a new match ends in the new text: look only from len(stop) - 1 before it
        hits = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in self.params.stop) if i >= 0]
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

    def take_output(self, new_tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        """The output record for what is new since the last one."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent:end], end
        if logprobs is None and self.params.logprobs is not None:
            logprobs = []
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(self.request_id, new_tokens, text, self.finished, self.finish_reason,
                             len(self.prompt_ids), len(self.output_ids), self.error, logprobs, prompt_logprobs)


def check_stop_strings(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")


def tokenize_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt's token ids, checked (at most max_model_len - 1: one is generated); a prompt
    far too long is refused before any per-token work."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(f"prompt has {len(prompt)} characters, far more than the model's limit of "
                                      f"{max_model_len} tokens can hold")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, (list, tuple)):
        _check_length(len(prompt), max_model_len)
        ids = list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:4]}")
    else:
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("prompt is empty (no tokens)")
    _check_length(len(ids), max_model_len)
    return ids


def _check_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise InvalidRequestError(f"prompt has {num_tokens} tokens; the model's limit is {max_model_len} "
                                  "tokens including at least one generated token")
