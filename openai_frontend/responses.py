"""OpenAI response bodies and stream chunks, as plain dicts (built per token: no model validation).

Log probabilities arrive from the model as [{"token_id", "logprob", "top_logprobs": [{"token_id",
"logprob"}, ...]}] per token (python_backend/response.py) and leave in OpenAI's shapes: completions'
{"tokens", "token_logprobs", "top_logprobs" (a {token: logprob} dict per token, the top N and the
sampled token), "text_offset"}, with echo the prompt's tokens first (the first one's logprob and
top_logprobs null); chat's {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}]}. A token's text is the tokenizer's decoding of it alone.
"""
from __future__ import annotations

import json
import time


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


class TokenTexts:
    """Token id -> its text (decoded alone), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def text(self, token_ids: list[int]) -> str:
        """A prompt of token ids as text (echo): the tokenizer's decoding of them together."""
        try:
            return self.tokenizer.decode(token_ids)
        except (OverflowError, TypeError, ValueError, IndexError):    # ids the vocabulary lacks: the engine refuses them
            return ""


class CompletionFormat:
    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, echo_prompts: list[str] | None = None, n: int = 1,
                 token_text: TokenTexts | None = None, generated: bool = True):
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.echo_prompts, self.n = echo_prompts, n
        self.generated = generated            # False: max_tokens 0, the sampled token is left out
        self.echoed: set[int] = set()
        self.token_text = token_text
        self.offsets: dict[int, int] = {}     # choice -> characters of text before its next token

    def _echo(self, index: int, text: str) -> str:
        if self.echo_prompts is None or index in self.echoed:
            return text
        self.echoed.add(index)
        return self.echo_prompts[index // self.n] + text

    def head(self, index: int) -> dict | None:
        return None

    def choice(self, index: int, text: str, finish_reason: str, logprobs: list[dict] | None = None,
               prompt_logprobs: list[dict] | None = None) -> dict:
        if not self.generated:
            text, finish_reason = "", finish_reason and "length"
            logprobs = None if logprobs is None else (prompt_logprobs or [])
        elif self.echo_prompts is not None and prompt_logprobs is not None and logprobs is not None:
            logprobs = prompt_logprobs + logprobs
        return {"index": index, "text": self._echo(index, text), "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None,
              prompt_logprobs: list[dict] | None = None) -> dict:
        return self.choice(index, text, finish_reason, logprobs, prompt_logprobs)

    def logprobs(self, index: int, entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        tokens = [self.token_text(e["token_id"]) for e in entries]
        offsets, at = [], self.offsets.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[index] = at
        tops: list[dict | None] = []
        for token, e in zip(tokens, entries):
            if e["logprob"] is None:         # a prompt's first token: nothing predicts it
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for t in e["top_logprobs"]:      # tokens of the same text (U+FFFD, say): the likeliest one's
                top.setdefault(self.token_text(t["token_id"]), t["logprob"])
            top.setdefault(token, e["logprob"])
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def usage(self, usage: dict) -> dict:
        if self.generated:
            return usage
        return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

    def response(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if with_usage:
            body["usage"] = usage
        return body


class ChatFormat(CompletionFormat):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def head(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def choice(self, index: int, text: str, finish_reason: str, logprobs: list[dict] | None = None,
               prompt_logprobs: list[dict] | None = None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(index, logprobs), "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None,
              prompt_logprobs: list[dict] | None = None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason}

    def logprobs(self, index: int, entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        return {"content": [{**self._token(e["token_id"], e["logprob"]),
                             "top_logprobs": [self._token(t["token_id"], t["logprob"]) for t in e["top_logprobs"]]}
                            for e in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
