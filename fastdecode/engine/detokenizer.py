"""Incremental detokenization that never emits half a UTF-8 character.

Decode a short window of recent tokens twice (with and without the new ones)
and emit the difference, holding text back while it ends in U+FFFD (an
incomplete byte sequence). Concatenating the pieces gives the full decode.
"""
from __future__ import annotations

import functools
from typing import Callable


def decoder_of(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).
    For a fast tokenizer whose decode adds nothing to its Rust tokenizer's, that one directly:
    transformers' wrapper around it costs several times the decode of a few tokens."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        PreTrainedTokenizerFast = None
    if (PreTrainedTokenizerFast is not None and isinstance(tokenizer, PreTrainedTokenizerFast)
            and type(tokenizer).decode is PreTrainedTokenizerFast.decode
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self._decode = decoder_of(tokenizer)
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the window decoded for context
        self.read_offset = 0     # tokens before this have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (maybe "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if text.startswith(prefix) else ""
