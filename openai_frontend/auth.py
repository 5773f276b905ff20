"""API keys: with a key set, every /v1 route wants `Authorization: Bearer <key>` (the openai SDK's
`api_key`); /health stays open for probes. A missing or wrong key gets OpenAI's 401 error."""
from __future__ import annotations

import hmac

from openai_frontend.errors import APIError

PROTECTED = "/v1"


class BearerAuth:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _protected(scope["path"]) and not self._authorized(scope["headers"]):
            response = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                code="invalid_api_key").response()
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers) -> bool:
        given = [v for k, v in headers if k == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self.expected)


def _protected(path: str) -> bool:
    return path == PROTECTED or path.startswith(PROTECTED + "/")

