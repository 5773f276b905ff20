"""The Triton side: one asyncio gRPC channel, one bidirectional stream per generation.

Each generation gets its own stream so that cancelling it (a client that went away) cancels that
request alone: Triton then marks it cancelled, the model aborts it and the engine frees its KV.
A stream is cancelled only while its request still runs; after the final response it is closed
by half-closing the request side and draining, never by a cancel (a cancel racing the final
response keeps Triton 2.51's request alive; see fastdecode.ops.client.generate).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass

import grpc
import tritonclient.grpc.aio as aioclient

from fastdecode.ops.client import build_inputs
from openai_frontend.errors import APIError, from_triton, not_ready

FLAGS = {"exclude_input_in_output": True, "return_finish_reason": True, "return_num_input_tokens": True,
         "return_num_output_tokens": True}
READY_TTL_S = 1.0
DRAIN_TIMEOUT_S = 10.0


@dataclass
class Chunk:
    text: str
    finish_reason: str | None      # set on the final chunk
    num_input_tokens: int
    num_output_tokens: int         # tokens since the previous chunk (streamed) or in all (not streamed)
    logprobs: list[dict] | None = None   # one entry per token of the chunk, when the request asked
    prompt_logprobs: list[dict] | None = None   # one entry per prompt token, on the first chunk, when asked


class Triton:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self._client: aioclient.InferenceServerClient | None = None
        self._ready_until = 0.0
        self._ready_check: asyncio.Future | None = None
        self._ids = itertools.count()
        self._drains: set[asyncio.Task] = set()
        self._max_model_len: int | None = None

    @property
    def client(self) -> aioclient.InferenceServerClient:
        if self._client is None:       # made on first use: the channel binds to the running event loop
            self._client = aioclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        for task in list(self._drains):
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        """Triton's model readiness, asked at most once a second while ready; concurrent callers share one ask."""
        if time.monotonic() < self._ready_until:
            return True
        if self._ready_check is None:
            self._ready_check = asyncio.ensure_future(self._ask_ready())
        check = self._ready_check
        try:
            return await asyncio.shield(check)
        finally:
            if self._ready_check is check and check.done():
                self._ready_check = None

    async def _ask_ready(self) -> bool:
        try:
            ready = await self.client.is_model_ready(self.model, client_timeout=5)
        except Exception:
            ready = False
        self._ready_until = time.monotonic() + READY_TTL_S if ready else 0.0
        return ready

    async def require_ready(self) -> None:
        if not await self.ready():
            raise not_ready(f"model {self.model!r} is not ready on Triton at {self.url}")

    async def max_model_len(self) -> int:
        """The model's `max_model_len` parameter (0: unset, the checkpoint's context applies)."""
        if self._max_model_len is None:
            try:
                config = await self.client.get_model_config(self.model, as_json=True, client_timeout=5)
            except Exception:
                return 0
            value = config.get("config", {}).get("parameters", {}).get("max_model_len", {}).get("string_value", "")
            self._max_model_len = int(value) if value.strip().isdigit() else 0
        return self._max_model_len

    def mark_unready(self) -> None:
        self._ready_until = 0.0

    def generate(self, prompt: str | list[int], sampling: dict, stream: bool, request_id: str) -> "Generation":
        return Generation(self, prompt, sampling, stream, f"{request_id}-{next(self._ids)}")

    def keep(self, task: asyncio.Task) -> None:
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)


class Generation:
    """One request's responses: `await next()` gives a Chunk, or None after the final one."""

    def __init__(self, triton: Triton, prompt: str | list[int], sampling: dict, stream: bool, request_id: str):
        self.triton = triton
        self.ended = False
        self._sent = asyncio.Event()       # set: the request side of the stream may close
        inputs = build_inputs(prompt, sampling, stream, FLAGS)

        async def requests():
            yield {"model_name": triton.model, "request_id": request_id, "inputs": inputs}
            await self._sent.wait()

        self._call = triton.client.stream_infer(requests())

    async def next(self) -> Chunk | None:
        if self.ended:
            return None
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self._end()
            raise APIError(502, f"Triton closed the stream of model {self.triton.model!r} before its final response",
                           code="upstream_error") from None
        except grpc.aio.AioRpcError as e:
            self._end()
            self.triton.mark_unready()
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise not_ready(f"Triton at {self.triton.url} unavailable: {e.details()}") from None
            raise APIError(502, f"Triton error: {e.code().name}: {e.details()}", code="upstream_error") from None
        if error is not None:
            self._end()
            api_error = from_triton(error.message())
            if api_error.status == 503:
                self.triton.mark_unready()
            raise api_error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        try:
            out = Outputs(result)
            chunk = Chunk(text=out.string("text_output"), finish_reason=None,
                          num_input_tokens=out.uint("num_input_tokens"),
                          num_output_tokens=out.uint("num_output_tokens"))
            if out.has("logprobs"):
                chunk.logprobs = json.loads(out.string("logprobs"))
            if out.has("prompt_logprobs"):
                chunk.prompt_logprobs = json.loads(out.string("prompt_logprobs"))
            if final:
                chunk.finish_reason = out.string("finish_reason") or "stop"
        except APIError:
            self._end() if final else self.cancel()
            raise
        if final:
            self._end()
        return chunk

    def cancel(self) -> None:
        """Stop the request if it still runs (the client went away); idempotent."""
        if not self.ended:
            self.ended = True
            self._call.cancel()
        self._sent.set()

    def _end(self) -> None:
        self.ended = True
        self._sent.set()
        self.triton.keep(asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                async for _ in self._call:
                    pass
        except TimeoutError:
            self._call.cancel()      # long after the final response: no race left to lose
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass


class Outputs:
    """The first element of a response's output tensors (one generation per choice: each holds one),
    read from the raw bytes Triton sends (BYTES: a 4-byte little-endian length, then the bytes;
    UINT32: 4 bytes) instead of a numpy array per tensor per token. Tensors sent in `contents`
    instead go through tritonclient's as_numpy; a malformed one is an upstream error (502)."""

    def __init__(self, result):
        self.result = result
        response = result.get_response()
        raw = response.raw_output_contents
        self.raw = {o.name: (o.datatype, raw[i]) for i, o in enumerate(response.outputs)} \
            if len(raw) == len(response.outputs) else None

    def has(self, name: str) -> bool:
        return name in self.raw if self.raw is not None else self.result.as_numpy(name) is not None

    def string(self, name: str) -> str:
        if self.raw is None:
            array = self.result.as_numpy(name)
            if array is None or array.size == 0:
                return ""
            value = array.reshape(-1)[0]
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        datatype, data = self.raw.get(name, ("BYTES", b"\0\0\0\0"))
        size = int.from_bytes(data[:4], "little")
        if datatype != "BYTES" or len(data) < 4 + size:
            raise _malformed(name, datatype)
        try:
            return data[4:4 + size].decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(name, datatype) from None

    def uint(self, name: str) -> int:
        if self.raw is None:
            array = self.result.as_numpy(name)
            return 0 if array is None or array.size == 0 else int(array.reshape(-1)[0])
        datatype, data = self.raw.get(name, ("UINT32", b"\0\0\0\0"))
        if datatype != "UINT32" or len(data) < 4:
            raise _malformed(name, datatype)
        return int.from_bytes(data[:4], "little")


def _malformed(name: str, datatype: str) -> APIError:
    return APIError(502, f"Triton sent a malformed {name!r} output ({datatype})", code="upstream_error")
