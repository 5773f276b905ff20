"""Chat messages -> one prompt, rendered with the checkpoint's own chat template."""
from __future__ import annotations

from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatMessage


class ChatTemplate:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.available = bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: list[ChatMessage], kwargs: dict | None = None) -> str:
        if not self.available:
            raise bad_request("this model's checkpoint has no chat template; use /v1/completions", param="messages",
                              code="no_chat_template")
        plain = [_plain(m, i) for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False,
                                                      **(kwargs or {}))
        except Exception as e:      # the template's own raise_exception(), or a jinja error
            raise bad_request(f"cannot render the messages with the model's chat template: {e}",
                              param="messages") from None


def _plain(message: ChatMessage, index: int) -> dict:
    content = message.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"message {index}: content part of type {part.type!r} is not supported "
                                  "(text only)", param=f"messages.{index}.content")
            parts.append(part.text)
        content = "".join(parts)
    out = {"role": message.role, "content": content or ""}
    if message.name:
        out["name"] = message.name
    return out
