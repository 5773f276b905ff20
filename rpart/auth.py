"""Shared-token check and TLS credentials, for R-worker ports others can reach.

The token travels as `authorization: Bearer <token>` metadata on every call
(the stream is one call). The standard health service is exempt so load
balancers and kubelet probes need no secret; it reveals nothing else.
"""
from __future__ import annotations

import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
METADATA_KEY = "authorization"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        got = dict(handler_call_details.invocation_metadata).get(METADATA_KEY, "")
        if hmac.compare_digest(got.encode(), self._expected):
            return handler
        reason = "missing R-worker token" if not got else "wrong R-worker token"
        return _deny(handler, reason)


def _deny(handler, reason: str):
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with the server's cert/key; with client_ca, clients must present a cert it signed (mTLS)."""
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def read_token(token: str = "", token_file: str = "") -> str:
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
    return token
