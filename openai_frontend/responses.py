"""OpenAI response bodies and stream chunks, as plain dicts (built per token: no model validation)."""
from __future__ import annotations

import json
import time


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


class CompletionFormat:
    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, echo_prompts: list[str] | None = None, n: int = 1):
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.echo_prompts, self.n = echo_prompts, n
        self.echoed: set[int] = set()

    def _echo(self, index: int, text: str) -> str:
        if self.echo_prompts is None or index in self.echoed:
            return text
        self.echoed.add(index)
        return self.echo_prompts[index // self.n] + text

    def head(self, index: int) -> dict | None:
        return None

    def choice(self, index: int, text: str, finish_reason: str) -> dict:
        return {"index": index, "text": self._echo(index, text), "logprobs": None, "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        return self.choice(index, text, finish_reason)

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

    def choice(self, index: int, text: str, finish_reason: str) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}
