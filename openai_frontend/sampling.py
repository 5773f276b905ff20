"""An OpenAI request -> the engine's sampling_parameters (vLLM names), one dict per choice."""
from __future__ import annotations

from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# vLLM's extensions a client may send beside OpenAI's fields (the SDK's extra_body); the engine checks them
VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")


def sampling_parameters(req: SamplingRequest, max_tokens: int | None) -> dict:
    refuse_unsupported(req)
    params = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
              "stop": req.stop, "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
              "logprobs": num_logprobs(req), "logit_bias": req.logit_bias or None}
    if isinstance(req, CompletionRequest) and req.echo:
        params["prompt_logprobs"] = req.logprobs      # the echoed prompt's tokens get theirs too
    extra = req.model_extra or {}
    params.update({k: extra[k] for k in VLLM_EXTRAS if k in extra})
    return {k: v for k, v in params.items() if v is not None}


def num_logprobs(req: SamplingRequest) -> int | None:
    """The engine's `logprobs` (top-N per token) for this request, or None: completions' logprobs
    N; chat's logprobs=true with top_logprobs N (0 when not given)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return None


def per_choice(params: dict, n: int) -> list[dict]:
    """n choices of one prompt; a seeded request gets seeds seed, seed+1, ... so its choices differ."""
    if "seed" not in params:
        return [params] * n
    return [{**params, "seed": params["seed"] + i} for i in range(n)]


def refuse_unsupported(req: SamplingRequest) -> None:
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest):
        if req.tools and req.tool_choice != "none":
            raise bad_request("tools (function calling) are not supported", param="tools", code="unsupported_parameter")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", param="response_format",
                              code="unsupported_parameter")
