"""Triton request -> GenerateRequest, following the tensor contract of Triton's vLLM backend.

Inputs: text_input (STRING) or input_ids (INT32/INT64, the prompt's token ids: one of the two),
stream (BOOL), sampling_parameters (STRING holding a JSON object: max_tokens, temperature, top_p,
top_k, seed, stop, stop_token_ids, ignore_eos, repetition_penalty, frequency_penalty,
presence_penalty, min_p, min_tokens, logit_bias, logprobs, prompt_logprobs; the engine's
SamplingParams checks them; and n, the number of choices, 1..MAX_CHOICES, each its own engine
request, seeded seed, seed+1, ... when a seed is given), exclude_input_in_output,
return_finish_reason, return_num_input_tokens, return_num_output_tokens (BOOL). Without a
sampling_parameters tensor the request's parameters are used instead (what Triton's generate
endpoint makes of `"parameters": {...}`). A prompt sent as token ids is never prepended to the
output text (there is no text of it to prepend).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from python_backend.errors import BadRequest

MAX_CHOICES = 16
MAX_INPUT_IDS = 1 << 20       # beyond any context; the engine checks the model's own limit
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
         "return_num_input_tokens", "return_num_output_tokens")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list[int]
    stream: bool = False
    sampling: dict = field(default_factory=dict)   # for the engine's SamplingParams.from_dict
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    n: int = 1

    @property
    def prepend_prompt(self) -> bool:
        """The vLLM backend returns prompt + completion unless streaming or told not to."""
        return not self.stream and not self.exclude_input_in_output and isinstance(self.prompt, str)


def parse_request(get_input: Callable[[str], "np.ndarray | None"], parameters: str | dict | None = None
                  ) -> GenerateRequest:
    """`get_input(name)` gives an input tensor as numpy (None if absent); `parameters` are the
    request parameters (JSON text or dict). Raises BadRequest with a message for the client."""
    request_params = _request_parameters(parameters)
    prompt = _prompt(get_input("text_input"), get_input("input_ids"))
    flags = {}
    for name in FLAGS:
        array = get_input(name)
        if array is not None:
            flags[name] = _single_bool(array, name)
        elif name in request_params:
            value = request_params[name]
            if not isinstance(value, bool):
                raise BadRequest(f"parameter {name!r} must be true or false, got {value!r}")
            flags[name] = value
    sampling_tensor = get_input("sampling_parameters")
    if sampling_tensor is not None:
        sampling = _json_object(_single_string(sampling_tensor, "sampling_parameters"), "sampling_parameters")
    else:
        sampling = {k: v for k, v in request_params.items() if k not in FLAGS and not k.startswith("triton_")}
    n = sampling.pop("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"sampling parameter 'n' must be an integer in 1..{MAX_CHOICES}, got {n!r}")
    return GenerateRequest(prompt=prompt, sampling=sampling, n=n, **flags)


def choice_sampling(sampling: dict, i: int) -> dict:
    """The sampling parameters of choice i: seeds seed, seed+1, ... so that seeded choices differ."""
    seed = sampling.get("seed")
    if i == 0 or type(seed) is not int:
        return sampling
    return {**sampling, "seed": seed + i}


def _request_parameters(parameters) -> dict:
    if not parameters:
        return {}
    if isinstance(parameters, dict):
        return parameters
    return _json_object(parameters, "request parameters")


def _prompt(text, ids) -> str | list[int]:
    if text is not None and ids is not None:
        raise BadRequest("send the prompt as 'text_input' or as 'input_ids', not both")
    if ids is not None:
        return _input_ids(ids)
    if text is None:
        raise BadRequest("missing input 'text_input' (a STRING tensor holding the prompt) or 'input_ids' "
                         "(its token ids)")
    return _text_input(text)


def _input_ids(array) -> list[int]:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise BadRequest(f"'input_ids' must be an INT32 or INT64 tensor, got {array.dtype}")
    if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise BadRequest(f"'input_ids' must be one prompt: shape [N] or [1, N], got {list(array.shape)}")
    if array.size == 0:
        raise BadRequest("'input_ids' is empty")
    if array.size > MAX_INPUT_IDS:
        raise BadRequest(f"'input_ids' has {array.size} tokens, more than any context ({MAX_INPUT_IDS})")
    return array.reshape(-1).tolist()     # Python ints


def _text_input(array) -> str:
    prompt = _single_string(array, "text_input")
    if not prompt:
        raise BadRequest("'text_input' is empty")
    return prompt


def _single(array, name: str):
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"{name!r} must hold exactly one element, got shape {list(np.shape(array))}")
    return flat[0]


def _single_string(array, name: str) -> str:
    value = _single(array, name)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"{name!r} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, (str, np.str_)):
        return str(value)
    raise BadRequest(f"{name!r} must be a STRING (BYTES) tensor, got {type(value).__name__}")


def _single_bool(array, name: str) -> bool:
    value = _single(array, name)
    if not isinstance(value, (bool, np.bool_)):
        raise BadRequest(f"{name!r} must be a BOOL tensor, got {np.asarray(array).dtype}")
    return bool(value)


def _json_object(text: str, name: str) -> dict:
    try:
        value = json.loads(text)
    # ValueError: besides JSONDecodeError, bytes that are not UTF-8 and integers of over 4300 digits;
    # RecursionError: arrays or objects nested too deep
    except (ValueError, TypeError, RecursionError) as e:
        raise BadRequest(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
