"""The real `openai` SDK, sync and async, streamed and not, against openai_frontend in front of a
real tritonserver with the tiny test model (test_triton's `server` fixture: one per module)."""
from __future__ import annotations

import asyncio

import openai
import pytest

from fastdecode.ops.triton import tritonserver_binary
from openai_frontend.testing import engine_load, post, wait_for
from test_openai_frontend import NAME, api, chat_model_dir  # noqa: F401  (the frontend before the same deployment)
from test_triton import fleet, server  # noqa: F401  (test_triton's deployment fixtures)

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not tritonserver_binary().exists(),
                                 reason=f"tritonserver binary missing ({tritonserver_binary()})")]

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Hello, world! 🙂"}]
GREEDY = {"temperature": 0, "max_tokens": 20}




@pytest.fixture(scope="module")
def sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def async_sdk(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_prompt(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                             tokenize=False)


def triton_text(server, prompt, max_tokens=GREEDY["max_tokens"]):
    """Triton's own generate endpoint, greedy: what the OpenAI endpoint must reproduce."""
    status, body = post(f"http://{server.http_url}/v2/models/fastdecode/generate",
                        {"text_input": prompt, "exclude_input_in_output": True,
                         "parameters": {"temperature": 0.0, "max_tokens": max_tokens}})
    assert status == 200, body
    return body["text_output"]


def test_models_list(sdk):
    assert [m.id for m in sdk.models.list()] == [NAME]
    assert sdk.models.retrieve(NAME).id == NAME


def test_completions_create_equals_triton_generate(sdk, server):
    r = sdk.completions.create(model=NAME, prompt=PROMPT, **GREEDY)
    assert r.choices[0].text == triton_text(server, PROMPT) and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == GREEDY["max_tokens"] and r.usage.prompt_tokens > 0


def test_completions_create_streamed(sdk, server):
    stream = sdk.completions.create(model=NAME, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                    **GREEDY)
    chunks = list(stream)
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == triton_text(server, PROMPT)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]


def test_completions_score_a_prompt_with_max_tokens_0(sdk):
    r = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


def test_chat_completions_create_equals_triton_generate(sdk, server, chat_prompt):
    r = sdk.chat.completions.create(model=NAME, messages=MESSAGES, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == triton_text(server, chat_prompt)
    assert r.usage.completion_tokens == GREEDY["max_tokens"]
    r = sdk.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_completion_tokens=5)
    assert r.choices[0].message.content == triton_text(server, chat_prompt, max_tokens=5)


def test_chat_completions_create_streamed(sdk, server, chat_prompt):
    with sdk.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **GREEDY) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == triton_text(server, chat_prompt)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_streamed_and_not_concurrently(api, server, chat_prompt):
    prompts = [f"{PROMPT} #{i}" for i in range(6)]
    expected = [triton_text(server, p) for p in prompts]

    async def streamed(c, prompt):
        stream = await c.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def whole(c, prompt):
        return (await c.completions.create(model=NAME, prompt=prompt, **GREEDY)).choices[0].text

    async def chat(c, stream):
        if not stream:
            return (await c.chat.completions.create(model=NAME, messages=MESSAGES, **GREEDY)).choices[0].message.content
        parts = []
        async for chunk in await c.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, **GREEDY):
            parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    async def run():
        async with async_sdk(api) as c:
            return await asyncio.gather(*(streamed(c, p) for p in prompts), *(whole(c, p) for p in prompts),
                                        chat(c, True), chat(c, False))

    results = asyncio.run(run())
    assert results[:6] == expected and results[6:12] == expected
    assert results[12] == results[13] == triton_text(server, chat_prompt)


def test_n_and_seed(sdk):
    r = sdk.completions.create(model=NAME, prompt=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=12)
    again = sdk.completions.create(model=NAME, prompt=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    chat = sdk.chat.completions.create(model=NAME, messages=MESSAGES, n=2, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 16


def test_sdk_errors_and_the_server_keeps_serving(sdk):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=NAME, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, temperature=-1)
    assert sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_async_stream_closed_early_frees_the_request(api, server):
    def load():
        return engine_load(server.metrics_url)

    def idle():
        return load()["running"] == load()["waiting"] == load()["kv_tokens"] == 0

    assert wait_for(idle)
    before = load()["cancelled"]

    async def run():
        async with async_sdk(api) as c:
            stream = await c.chat.completions.create(model=NAME, messages=MESSAGES, stream=True, temperature=0,
                                                     max_tokens=450, extra_body={"ignore_eos": True})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 5:
                    break
            running = await asyncio.to_thread(wait_for, lambda: load()["running"] == 1 and load()["kv_tokens"] > 0)
            await stream.close()
            return running

    assert asyncio.run(run())
    assert wait_for(idle), load()
    assert wait_for(lambda: load()["cancelled"] == before + 1, timeout=30)
