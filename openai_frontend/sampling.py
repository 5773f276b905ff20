"""An OpenAI request -> the engine's sampling_parameters (vLLM names), one dict per choice."""
from __future__ import annotations

from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# vLLM's extensions a client may send beside OpenAI's fields (the SDK's extra_body)
VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")

# values that ask for nothing: not sent, so an engine without the parameter still serves the request
NO_OPS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
          "min_tokens": 0}


def sampling_parameters(req: SamplingRequest, max_tokens: int | None) -> dict:
    refuse_unsupported(req)
    params = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
              "stop": req.stop, "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty}
    extra = req.model_extra or {}
    params.update({k: extra[k] for k in VLLM_EXTRAS if k in extra})
    return {k: v for k, v in params.items() if v is not None and (k not in NO_OPS or v != NO_OPS[k])}


def per_choice(params: dict, n: int) -> list[dict]:
    """n choices of one prompt; a seeded request gets seeds seed, seed+1, ... so its choices differ."""
    if "seed" not in params:
        return [params] * n
    return [{**params, "seed": params["seed"] + i} for i in range(n)]


def refuse_unsupported(req: SamplingRequest) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this engine", param="logit_bias",
                          code="unsupported_parameter")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            raise _no_logprobs("logprobs")
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            raise _no_logprobs("logprobs")
        if req.top_logprobs:
            raise _no_logprobs("top_logprobs")
        if req.tools and req.tool_choice != "none":
            raise bad_request("tools (function calling) are not supported", param="tools", code="unsupported_parameter")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", param="response_format",
                              code="unsupported_parameter")


def _no_logprobs(param: str):
    return bad_request(f"{param} is not supported: this engine does not return log probabilities", param=param,
                       code="unsupported_parameter")
