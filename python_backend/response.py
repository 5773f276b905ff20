"""Engine RequestOutputs -> Triton output tensors (vLLM backend contract).

Outputs: text_output (STRING), finish_reason (STRING), num_input_tokens (UINT32),
num_output_tokens (UINT32), and logprobs (STRING) only when sampling_parameters has "logprobs":
a JSON list with one entry per token of the response, {"token_id", "logprob", "top_logprobs":
[{"token_id", "logprob"}, ...] (best first, as many as asked)}; log probabilities of the model's
raw distribution, -inf written as -9999.0. Streaming: one response per text delta (the engine never splits a
UTF-8 character, so neither do we); num_output_tokens counts the tokens since the previous
response. Not streaming: one response with the whole text (prompt first unless
exclude_input_in_output) and the total token count.
"""
from __future__ import annotations

import json

import numpy as np

from python_backend.errors import CANCELLED, INTERNAL, ErrorInfo
from python_backend.request import GenerateRequest

Outputs = dict  # output name -> numpy array


class ResponseBuilder:
    """Per-request state: turns each RequestOutput into the response to send, or None."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        self.parts: list[str] = []
        self.pending_tokens = 0
        self.logprobs: list[dict] | None = [] if request.sampling.get("logprobs") is not None else None

    def on_output(self, out) -> tuple[Outputs | None, ErrorInfo | None]:
        """(outputs, error) to send now; (None, None) = nothing to send yet."""
        self.pending_tokens += len(out.token_ids)
        if self.logprobs is not None:
            self.logprobs += [_logprob_entry(lp) for lp in getattr(out, "logprobs", None) or ()]
        if out.finished and out.finish_reason == "error":
            return None, ErrorInfo(f"generation failed: {out.error or 'engine error'}", INTERNAL)
        if out.finished and out.finish_reason == "cancelled":
            return None, ErrorInfo("request cancelled", CANCELLED)
        if self.request.stream:
            if not out.text and not out.finished:
                return None, None            # no complete character yet; its tokens count in the next delta
            outputs = self._outputs(out.text, out.finish_reason if out.finished else None,
                                    out.num_prompt_tokens, self.pending_tokens)
            self.pending_tokens = 0
            return outputs, None
        self.parts.append(out.text)
        if not out.finished:
            return None, None
        text = "".join(self.parts)
        if self.request.prepend_prompt:
            text = self.request.prompt + text
        return self._outputs(text, out.finish_reason, out.num_prompt_tokens, out.num_output_tokens), None

    def _outputs(self, text: str, finish_reason: str | None, num_input: int, num_output: int) -> Outputs:
        r = self.request
        outputs = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        if r.return_finish_reason:
            outputs["finish_reason"] = np.array([(finish_reason or "").encode()], dtype=np.object_)
        if r.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([num_input], dtype=np.uint32)
        if r.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([num_output], dtype=np.uint32)
        if self.logprobs is not None:
            outputs["logprobs"] = np.array([json.dumps(self.logprobs).encode()], dtype=np.object_)
            self.logprobs = []
        return outputs


def _finite(x: float) -> float:
    return x if x > -9999.0 else -9999.0


def _logprob_entry(lp) -> dict:
    return {"token_id": lp.token_id, "logprob": _finite(lp.logprob),
            "top_logprobs": [{"token_id": t, "logprob": _finite(v)} for t, v in lp.top]}
