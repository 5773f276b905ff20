"""Exceptions -> what a Triton client sees: a message and a Triton error code."""
from __future__ import annotations

from dataclasses import dataclass

# Names of pb_utils.TritonError codes (python_backend maps them to the real constants).
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
CANCELLED = "CANCELLED"


class BadRequest(ValueError):
    """The request's tensors or parameters are unusable (missing, wrong shape, bad JSON, not UTF-8)."""


@dataclass(frozen=True)
class ErrorInfo:
    message: str
    code: str = INTERNAL


def map_exception(e: BaseException) -> ErrorInfo:
    """The engine's InvalidRequestError and our BadRequest are the client's fault; a full queue
    (EngineOverloadedError: retry later) and a crashed engine (EngineDeadError) make the model
    unavailable; anything else is ours. Matched by class name: this module imports no engine."""
    names = {c.__name__ for c in type(e).__mro__}
    if names & {"BadRequest", "InvalidRequestError"}:
        return ErrorInfo(f"invalid request: {e}", INVALID_ARG)
    if "EngineOverloadedError" in names:
        return ErrorInfo(f"server overloaded, retry later: {e}", UNAVAILABLE)
    if "EngineDeadError" in names:
        return ErrorInfo(f"model unavailable: {e}", UNAVAILABLE)
    return ErrorInfo(f"internal error: {type(e).__name__}: {e}", INTERNAL)
