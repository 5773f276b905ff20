"""Engine RequestOutputs -> Triton output tensors (vLLM backend contract).

Outputs: text_output (STRING), finish_reason (STRING), num_input_tokens (UINT32),
num_output_tokens (UINT32), and logprobs (STRING) only when sampling_parameters has "logprobs": a
JSON list with one entry per token of the response, {"token_id", "logprob", "top_logprobs":
[{"token_id", "logprob"}, ...] (best first, as many as asked)}; log probabilities of the model's
raw distribution, -inf written as -9999.0; prompt_logprobs (STRING) only when sampling_parameters
has "prompt_logprobs", on the first response of each choice: the same entries, one per prompt
token, the first with "logprob" null and no "top_logprobs". Streaming: one response per text delta
(the engine never splits a UTF-8 character, so neither do we), except that a choice's first
token goes out at once even with no text yet (a special token, half a character): text_output
empty, its token counted, so that the client sees its first token when the engine has it;
num_output_tokens counts the tokens since the previous response. Not streaming: one response
with the whole text (prompt first unless exclude_input_in_output) and the total token count. With "n" in sampling_parameters, every tensor
holds n elements, one per choice.
"""
from __future__ import annotations

import json

import numpy as np

from python_backend.errors import CANCELLED, INTERNAL, ErrorInfo
from python_backend.request import GenerateRequest

Outputs = dict  # output name -> numpy array


class ResponseBuilder:
    """Per-request state: turns each RequestOutput of choice `i` (of the request's n) into the
    response to send, or None. Every output tensor holds one element per choice; a streamed
    response carries the delta of the choice it is about (the others' elements empty)."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        n = request.n
        self.parts: list[list[str]] = [[] for _ in range(n)]
        self.pending_tokens = [0] * n
        self.reasons: list[str | None] = [None] * n
        self.num_output = [0] * n
        self.logprobs: list[list[dict]] | None = ([[] for _ in range(n)] if request.sampling.get("logprobs")
                                                  is not None else None)
        self.prompt_logprobs: list[list[dict] | None] | None = ([None] * n if request.sampling.get(
            "prompt_logprobs") is not None else None)
        self.failed = False

    @property
    def done(self) -> bool:
        """The request's final response has been produced: every choice finished, or one failed."""
        return self.failed or all(r is not None for r in self.reasons)

    def on_output(self, out, i: int = 0, first: bool = False) -> tuple[Outputs | None, ErrorInfo | None]:
        """(outputs, error) to send now; (None, None) = nothing to send yet. first: no response of
        choice i has gone out, and a streamed one goes out now whatever text `out` has."""
        self.pending_tokens[i] += len(out.token_ids)
        if self.logprobs is not None:
            self.logprobs[i] += [_logprob_entry(lp) for lp in getattr(out, "logprobs", None) or ()]
        if self.prompt_logprobs is not None and getattr(out, "prompt_logprobs", None):
            self.prompt_logprobs[i] = [_logprob_entry(lp) for lp in out.prompt_logprobs]
        if out.finished and out.finish_reason in ("error", "cancelled"):
            self.failed = True
            if out.finish_reason == "error":
                return None, ErrorInfo(f"generation failed: {out.error or 'engine error'}", INTERNAL)
            return None, ErrorInfo("request cancelled", CANCELLED)
        if out.finished:
            self.reasons[i], self.num_output[i] = out.finish_reason, out.num_output_tokens
        n = self.request.n
        if self.request.stream:
            if not out.text and not out.finished and not (first and out.token_ids):
                return None, None            # no complete character yet; its tokens count in the next delta
            texts, reasons, counts = [""] * n, [""] * n, [0] * n
            texts[i], reasons[i], counts[i] = out.text, out.finish_reason if out.finished else "", self.pending_tokens[i]
            self.pending_tokens[i] = 0
            return self._outputs(texts, reasons, out.num_prompt_tokens, counts, only=i), None
        self.parts[i].append(out.text)
        if not self.done:
            return None, None
        prefix = self.request.prompt if self.request.prepend_prompt else ""
        return self._outputs([prefix + "".join(p) for p in self.parts], self.reasons, out.num_prompt_tokens,
                             self.num_output), None

    def _outputs(self, texts: list[str], reasons: list, num_input: int, num_output: list[int],
                 only: int | None = None) -> Outputs:
        r = self.request
        outputs = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}
        if r.return_finish_reason:
            outputs["finish_reason"] = np.array([(x or "").encode() for x in reasons], dtype=np.object_)
        if r.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([num_input] * len(texts), dtype=np.uint32)
        if r.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array(num_output, dtype=np.uint32)
        if self.logprobs is not None:
            outputs["logprobs"] = _take_json(self.logprobs, only, list)
        if self.prompt_logprobs is not None and any(
                x is not None for i, x in enumerate(self.prompt_logprobs) if only is None or i == only):
            outputs["prompt_logprobs"] = _take_json(self.prompt_logprobs, only, lambda: None)
        return outputs


def _take_json(per_choice: list, only: int | None, empty) -> np.ndarray:
    """One JSON element per choice: what the choices this response is about hold (they start over
    at empty()), [] for the others."""
    taken = [x if (only is None or i == only) and x is not None else [] for i, x in enumerate(per_choice)]
    for i in range(len(per_choice)):
        if only is None or i == only:
            per_choice[i] = empty()
    return np.array([json.dumps(x).encode() for x in taken], dtype=np.object_)


def _finite(x: float) -> float:
    return x if x > -9999.0 else -9999.0


def _logprob_entry(lp) -> dict:
    return {"token_id": lp.token_id, "logprob": None if lp.logprob is None else _finite(lp.logprob),
            "top_logprobs": [{"token_id": t, "logprob": _finite(v)} for t, v in lp.top]}
