"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every failure."""
from __future__ import annotations

import ast
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_ready(message: str) -> APIError:
    return APIError(503, message, code="model_not_ready")


def from_triton(message: str) -> APIError:
    """A Triton error message -> the client's error. The gRPC stream carries only the message, so
    the model's prefixes (python_backend/errors.py) tell the client's faults from ours."""
    if message.startswith("invalid request:"):
        text = message[len("invalid request:"):].strip().removeprefix("sampling_parameters:").strip()
        unknown = re.search(r"unknown sampling parameter\(s\) (\[.*?\])", text)
        if unknown:
            names = ast.literal_eval(unknown.group(1))
            listed = ", ".join(repr(n) for n in names)
            return bad_request(f"sampling parameter{'s' * (len(names) > 1)} {listed} not supported by this engine",
                               param=names[0], code="unsupported_parameter")
        for name in ("prompt", "logit_bias"):    # the engine's checks of these (the prompt: empty, too long, ids)
            if text.startswith(name):
                return bad_request(text, param=name)
        param = re.search(r"\b(\w+) must ", text)
        return bad_request(text, param=param.group(1) if param else None)
    if message.startswith("server overloaded"):
        return APIError(503, message, code="overloaded")
    if message.startswith("model unavailable") or "unknown model" in message or "not ready" in message \
            or "is not found" in message:
        return not_ready(message)
    return APIError(500, message, code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           code="invalid_json")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p))
    if not where:
        return bad_request(f"request body must be a JSON object: {first.get('msg', 'invalid')}")
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {first['input']!r:.100})"
    return bad_request(message, param=where)


TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict"}


def _union_tag(part) -> bool:
    """pydantic names the member of a union that failed ('str', 'list[str]'): not a field of the request."""
    return isinstance(part, str) and (not part.isidentifier() or part in TYPE_NAMES)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
