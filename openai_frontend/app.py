"""The FastAPI app: routes, request -> Triton generations -> OpenAI responses."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from openai_frontend import errors
from openai_frontend.auth import BearerAuth
from openai_frontend.chat import ChatTemplate
from openai_frontend.errors import APIError, bad_request
from openai_frontend.generation import Run
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from openai_frontend.responses import DONE, ChatFormat, CompletionFormat, TokenTexts, sse
from openai_frontend.sampling import per_choice, sampling_parameters
from openai_frontend.triton import Triton


@dataclass
class Settings:
    triton_url: str
    model_dir: str
    model: str = "fastdecode"                # the Triton model
    served_model_name: str | None = None     # what clients call it; default: the model dir's name
    default_max_tokens: int | None = None    # chat without max_tokens; default: the model's context length
    api_key: str | None = None               # required as a Bearer token on /v1 routes when set

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


def create_app(settings: Settings) -> FastAPI:
    triton = Triton(settings.triton_url, settings.model)
    template = ChatTemplate(settings.model_dir)
    token_text = TokenTexts(template.tokenizer)
    context = _context_length(settings.model_dir)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await triton.close()

    app = FastAPI(title="fastdecode OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(JSONBodies)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    errors.install(app)
    app.state.triton = triton

    def check_model(req: SamplingRequest) -> None:
        if req.model != settings.name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{settings.name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if not await triton.ready():
            raise errors.not_ready(f"model {settings.model!r} is not ready on Triton at {settings.triton_url}")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(settings.name, created)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != settings.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return _model_card(settings.name, created)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)
        prompts = _prompts(req.prompt)
        echoed = [p if isinstance(p, str) else token_text.text(p) for p in prompts] if req.echo else None
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise bad_request("max_tokens 0 generates nothing: it needs echo (the prompt back, scored with logprobs)",
                              param="max_tokens")
        # vLLM's way to score a prompt: generate one token, then leave it out of the reply
        params = sampling_parameters(req, 1 if echo_only else req.max_tokens)
        if echo_only and params.get("min_tokens", 0) > 0:
            raise bad_request("min_tokens needs max_tokens above 0", param="min_tokens")
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", settings.name, echoed, req.n, token_text,
                               generated=not echo_only)
        choices = [(p, s) for p in prompts for s in per_choice(params, req.n)]
        return await _respond(triton, request, req, fmt, choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req)
        prompt = template.render(req.messages, req.chat_template_kwargs)
        max_tokens = req.max_completion_tokens or req.max_tokens or settings.default_max_tokens
        if max_tokens is None:    # up to the context: the engine stops there
            max_tokens = min(context, await triton.max_model_len() or context)
        params = sampling_parameters(req, max_tokens)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", settings.name, token_text=token_text)
        return await _respond(triton, request, req, fmt, [(prompt, s) for s in per_choice(params, req.n)])

    return app


class JSONBodies:
    """Read every POST body as JSON, whatever its Content-Type (`curl -d` sends a form's)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


async def _respond(triton: Triton, request: Request, req: SamplingRequest, fmt: CompletionFormat,
                   choices: list[tuple[str, dict]]):
    await triton.require_ready()
    run = Run(triton, choices, req.stream, fmt.id)
    if not req.stream:
        chunks = await _unless_disconnected(request, run)
        body = [fmt.choice(i, c.text, c.finish_reason, c.logprobs, c.prompt_logprobs) for i, c in enumerate(chunks)]
        return JSONResponse(fmt.response(body, fmt.usage(run.usage(req.n))))
    try:
        await run.start()
    except BaseException:
        run.cancel()
        raise
    return StreamingResponse(_events(run, fmt, req), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(run: Run, fmt: CompletionFormat, req: SamplingRequest):
    """The SSE body. Leaving it early (the client disconnected: Starlette cancels this generator)
    cancels every generation still running."""
    usage, continuous = req.include_usage, req.continuous_usage

    def so_far() -> dict | None:
        return fmt.usage(run.usage(req.n)) if continuous else None
    try:
        heads = [h for h in (fmt.head(i) for i in range(len(run.gens))) if h is not None]
        if heads:
            yield sse(fmt.chunk(heads, so_far(), usage))
        held: dict[int, list[dict]] = {}      # logprobs of a choice's tokens of no text: sent with its next text
        async for i, chunk in run.events():
            logprobs = chunk.logprobs
            if i in held and logprobs is not None:
                logprobs = held.pop(i) + logprobs
            if chunk.text or chunk.finish_reason or chunk.prompt_logprobs is not None:
                yield sse(fmt.chunk([fmt.delta(i, chunk.text, chunk.finish_reason, logprobs,
                                               chunk.prompt_logprobs)], so_far(), usage))
            elif logprobs:
                held[i] = logprobs
        if usage:
            yield sse(fmt.chunk([], fmt.usage(run.usage(req.n)), True))
        yield DONE
    except APIError as e:
        yield sse(e.body())
        yield DONE
    finally:
        run.cancel()


async def _unless_disconnected(request: Request, run: Run):
    work = asyncio.ensure_future(run.collect())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            run.cancel()
    if not work.done() or work.cancelled():
        raise APIError(499, "client closed the request", code="client_closed_request")
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompts(prompt) -> list[str | list[int]]:
    """A completion's prompts: a string, a list of token ids, or a list of strings or of token-id
    lists (one per prompt; the request model refuses a list mixing the two, as OpenAI's API does)."""
    if isinstance(prompt, str) or (prompt and all(_is_token(t) for t in prompt)):
        prompts = [prompt]
    elif prompt and all(isinstance(p, str) or isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must not be empty", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise bad_request("prompt must not be empty" if len(prompts) == 1 else f"prompt {i} is empty",
                              param="prompt")
        if isinstance(p, list) and not all(_is_token(t) and 0 <= t < 2**31 for t in p):
            raise bad_request(f"prompt {i} must be a string or a list of token ids (integers from 0)",
                              param="prompt")
    return prompts


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "fastdecode"}


def _context_length(model_dir: str) -> int:
    """The model's context (the engine caps each request at what is left of it after the prompt)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 4096
    return int(config.get("max_position_embeddings") or 4096)
