"""The OpenAI-compatible frontend (openai_frontend) over raw HTTP, in front of a real tritonserver
with the tiny test model (test_triton's `server` fixture: one per module). Wire format, errors,
fan-out and cancellation; tests/test_openai_sdk.py drives it with the openai SDK."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fastdecode.ops.procs import free_port
from fastdecode.ops.triton import tritonserver_binary
from openai_frontend.testing import Frontend, engine_load, post, wait_for, with_chat_template
from test_triton import fleet, server  # noqa: F401  (test_triton's deployment fixtures)

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not tritonserver_binary().exists(),
                                 reason=f"tritonserver binary missing ({tritonserver_binary()})")]

NAME = "tiny"
PROMPT = "Hello, world! Привет, мир! 🙂"


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def api(server, chat_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai_frontend") / "frontend.log"
    with Frontend(server.grpc_url, chat_model_dir, free_port(), name=NAME, log_path=log) as f:
        yield f
    assert not f.killed and f.exit_code == 0, f.log()


def url(api, path):
    return f"{api.url}/v1/{path}"


def triton_text(server, prompt, **sampling):
    """Triton's own generate endpoint, greedy."""
    status, body = post(f"http://{server.http_url}/v2/models/fastdecode/generate",
                        {"text_input": prompt, "exclude_input_in_output": True,
                         "parameters": {"temperature": 0.0, **sampling}})
    assert status == 200, body
    return body["text_output"]


def sse_events(api, path, body, timeout=60) -> list:
    events = []
    with httpx.stream("POST", url(api, path), json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_openai_error(status, body, expected_status, param=None):
    assert status == expected_status, body
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


# ---- happy paths

def test_models_lists_the_served_model(api):
    listing = httpx.get(url(api, "models")).json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [NAME]
    assert httpx.get(url(api, f"models/{NAME}")).json()["id"] == NAME
    r = httpx.get(url(api, "models/other"))
    assert_openai_error(r.status_code, r.json(), 404, "model")


def test_greedy_completion_equals_triton_generate(api, server):
    status, body = post(url(api, "completions"), {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == triton_text(server, PROMPT, max_tokens=24) and choice["text"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    usage = body["usage"]
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] > 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24


def test_streamed_completion_is_sse_chunks_with_usage(api):
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    _, whole = post(url(api, "completions"), request)
    events = sse_events(api, "completions", {**request, "stream": True, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert len(chunks) > 1
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in events)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"] == whole["usage"]

    continuous = sse_events(api, "completions", {**request, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = continuous
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    generated = [c["usage"]["completion_tokens"] for c in chunks]
    assert generated == sorted(generated) and 1 <= generated[0] and generated[-1] == 24
    assert all(c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for c in chunks)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(chunks, generated))
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    without = sse_events(api, "completions", {**request, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in without)        # usage only with include_usage, as in vLLM


def test_echo_prepends_the_prompt(api):
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    _, plain = post(url(api, "completions"), request)
    _, echoed = post(url(api, "completions"), {**request, "echo": True})
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


def test_prompts_of_token_ids_complete_as_their_text(api, chat_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    other = "The quick brown fox"
    ids, other_ids = tok(PROMPT)["input_ids"], tok(other)["input_ids"]
    request = {"model": NAME, "max_tokens": 8, "temperature": 0}
    _, by_text = post(url(api, "completions"), {**request, "prompt": [PROMPT, other]})
    status, by_ids = post(url(api, "completions"), {**request, "prompt": [ids, other_ids]})
    assert status == 200, by_ids
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    assert by_ids["usage"] == by_text["usage"]
    status, one = post(url(api, "completions"), {**request, "prompt": ids, "echo": True})
    assert status == 200, one
    assert one["choices"][0]["text"] == tok.decode(ids) + by_text["choices"][0]["text"]


def test_chat_renders_the_checkpoint_template(api, server, chat_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    prompt = AutoTokenizer.from_pretrained(chat_model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert "<|assistant|>" in prompt
    status, body = post(url(api, "chat/completions"), {"model": NAME, "messages": messages, "max_tokens": 16,
                                                       "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": triton_text(server, prompt, max_tokens=16)}
    assert body["usage"]["completion_tokens"] == 16
    # content as a list of text parts, and max_completion_tokens over max_tokens
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": PROMPT[:6]},
                                                       {"type": "text", "text": PROMPT[6:]}]}]
    _, same = post(url(api, "chat/completions"), {"model": NAME, "messages": parts, "max_tokens": 4,
                                                  "max_completion_tokens": 16, "temperature": 0})
    assert same["choices"][0]["message"] == choice["message"]


def test_streamed_chat_starts_with_the_role(api):
    request = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
    _, whole = post(url(api, "chat/completions"), request)
    chunks = sse_events(api, "chat/completions", {**request, "stream": True})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_chat_without_max_tokens_runs_to_the_context(api, server):
    status, body = post(url(api, "chat/completions"), {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                       "temperature": 0})
    assert status == 200, body
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == 512


def test_n_fans_out_one_request_per_choice(api):
    greedy = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "n": 2}
    _, body = post(url(api, "completions"), greedy)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    assert body["usage"]["completion_tokens"] == 24
    _, single = post(url(api, "completions"), {**greedy, "n": 1})
    assert body["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]   # one prompt, counted once

    sampled = {"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 3}
    _, a = post(url(api, "completions"), sampled)
    _, b = post(url(api, "completions"), sampled)
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]]             # seeded: reproducible
    assert len(set(texts)) > 1                                      # each choice its own seed
    chunks = sse_events(api, "completions", {**sampled, "stream": True})
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)]
    assert streamed == texts

    _, two_prompts = post(url(api, "completions"), {**greedy, "prompt": [PROMPT, "Another one"]})
    assert [c["index"] for c in two_prompts["choices"]] == [0, 1, 2, 3]
    assert two_prompts["choices"][0]["text"] == body["choices"][0]["text"]


def test_stop_and_seed_pass_through(api, server):
    _, base = post(url(api, "completions"), {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    text = base["choices"][0]["text"]
    at = next(i for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    _, stopped = post(url(api, "completions"), {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                "stop": [stop]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == triton_text(server, PROMPT, max_tokens=24, stop=stop)
    assert len(stopped["choices"][0]["text"]) < len(text)


# ---- bad input

GOOD = {"model": NAME, "prompt": "ok", "max_tokens": 2}
GOOD_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}

GARBAGE = [
    ("completions", b"{not json", 400, None),
    ("completions", b"", 400, None),
    ("completions", b"[1, 2, 3]", 400, None),
    ("completions", {"prompt": "x"}, 400, "model"),
    ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),                  # 0 needs echo
    ("completions", {**GOOD, "max_tokens": 0, "echo": True, "min_tokens": 2}, 400, "min_tokens"),
    ("completions", {**GOOD, "max_tokens": 0, "echo": [1]}, 400, "echo"),
    ("completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**GOOD, "n": 0}, 400, "n"),
    ("completions", {**GOOD, "seed": -3}, 400, "seed"),
    ("completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": None}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [-1, 2, 3]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [[1, 2], "x"]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": ["x", [1, 2]]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [1, 2**40]}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [1, 10**9]}, 400, "prompt"),                 # beyond the vocabulary: the engine's check
    ("completions", {**GOOD, "prompt": [1.5, 2]}, 400, "prompt"),
    ("completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("completions", {**GOOD, "logprobs": -1}, 400, "logprobs"),
    ("completions", {**GOOD, "logprobs": "two"}, 400, "logprobs"),
    ("completions", {**GOOD, "logprobs": 21, "echo": True}, 400, "logprobs"),
    ("completions", {**GOOD, "logprobs": "x", "echo": True}, 400, "logprobs"),
    ("completions", {**GOOD, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {**GOOD, "presence_penalty": "x"}, 400, "presence_penalty"),
    ("completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),   # the engine's checks, relayed
    ("completions", {**GOOD, "repetition_penalty": "NaN"}, 400, "repetition_penalty"),
    ("completions", {**GOOD, "min_p": 1.5}, 400, "min_p"),
    ("completions", {**GOOD, "min_tokens": -1}, 400, "min_tokens"),
    ("completions", {**GOOD, "min_tokens": 5}, 400, "min_tokens"),                  # more than max_tokens 2
    ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("completions", {**GOOD, "stream": "yes please"}, 400, "stream"),
    ("completions", {**GOOD, "stream": True, "stream_options": "all"}, 400, "stream_options"),
    ("completions", {**GOOD, "stream": True, "stream_options": {"include_usage": [1]}}, 400,
     "stream_options.include_usage"),
    ("completions", {**GOOD, "stream": True, "stream_options": {"continuous_usage_stats": "sometimes"}}, 400,
     "stream_options.continuous_usage_stats"),
    ("completions", {**GOOD, "top_k": "x"}, 400, "top_k"),           # the engine's own check, relayed
    ("completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"5": "high"}}, 400, "logit_bias"),
    ("completions", {**GOOD, "logit_bias": {"100000": 1}}, 400, "logit_bias"),     # beyond the vocabulary
    ("completions", {**GOOD, "logit_bias": [5]}, 400, "logit_bias"),
    ("chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("chat/completions", {**GOOD_CHAT, "logprobs": "yes please"}, 400, "logprobs"),
    ("chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),     # without logprobs: true
    ("chat/completions", {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {**GOOD_CHAT, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("chat/completions", {**GOOD_CHAT, "model": "nope"}, 404, "model"),
    ("chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
]


@pytest.mark.parametrize("path,body,status,param", GARBAGE,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(GARBAGE)])
def test_garbage_gets_an_openai_error_and_the_server_keeps_serving(api, path, body, status, param):
    got, error = post(url(api, path), body)
    assert_openai_error(got, error, status, param)
    if isinstance(body, dict) and "stream" not in body:     # the same garbage streamed: refused before any event
        got, error = post(url(api, path), {**body, "stream": True})
        assert_openai_error(got, error, status, param)
    good = GOOD_CHAT if path.startswith("chat") else GOOD
    ok, reply = post(url(api, path), good)
    assert ok == 200, reply


def test_unknown_routes_and_methods_are_openai_errors(api):
    r = httpx.get(url(api, "completions"))
    assert_openai_error(r.status_code, r.json(), 405)
    r = httpx.post(url(api, "embeddings"), json={"model": NAME, "input": "x"})
    assert_openai_error(r.status_code, r.json(), 404)


def test_a_body_is_json_whatever_its_content_type(api):
    """`curl -d` sends application/x-www-form-urlencoded."""
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(url(api, "completions"), content=json.dumps(GOOD), headers={"Content-Type": content_type})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("param,value", [("frequency_penalty", 1.5), ("presence_penalty", 1.5),
                                         ("repetition_penalty", 2.0), ("min_p", 0.1), ("min_tokens", 3)])
def test_sampling_parameter_served_as_the_engine_applies_it(api, server, param, value):
    """Passed through to the engine: the same output as Triton's generate endpoint with the same parameter
    (the engine's tests compare each one with its definition); the penalties change greedy output."""
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, param: value}
    status, body = post(url(api, "completions"), request)
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert text == triton_text(server, PROMPT, max_tokens=16, **{param: value})
    if param.endswith("penalty"):
        _, plain = post(url(api, "completions"), {**request, param: 1.0 if param == "repetition_penalty" else 0.0})
        assert plain["choices"][0]["text"] != text
    noop = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0}
    status, body = post(url(api, "completions"), {**GOOD, param: noop[param]})
    assert status == 200, body


def test_logit_bias_forces_and_bans_tokens(api, server, chat_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    status, forced = post(url(api, "completions"), {**request, "logit_bias": {"17": 100}})
    assert status == 200, forced
    assert forced["choices"][0]["text"] == tok.decode([17] * 4)
    status, body = post(f"http://{server.http_url}/v2/models/fastdecode/generate",    # Triton's own endpoint
                        {"text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters":
                         json.dumps({"max_tokens": 4, "temperature": 0, "logit_bias": {"17": 100}})})
    assert status == 200 and body["text_output"] == forced["choices"][0]["text"], body
    _, plain = post(url(api, "completions"), request)
    _, ids = post(f"http://{server.http_url}/v2/models/fastdecode/generate",
                  {"text_input": PROMPT, "exclude_input_in_output": True,
                   "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0, "logprobs": 0})})
    entries = json.loads(ids["logprobs"])
    assert tok.decode([e["token_id"] for e in entries]) == plain["choices"][0]["text"]
    first = entries[0]["token_id"]
    _, banned = post(url(api, "completions"), {**request, "logit_bias": {str(first): -100}})
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
            "logit_bias": {"17": 100}}
    status, body = post(url(api, "chat/completions"), chat)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == tok.decode([17] * 3)


def test_completion_logprobs_in_openai_shape(api):
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    status, body = post(url(api, "completions"), request)
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    joined = "".join(lp["tokens"])
    assert joined == choice["text"] or "\ufffd" in joined     # a token holding part of a character decodes to U+FFFD
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 1 <= len(top) <= 4 and top[token] == value    # fewer: tokens of the same text
        assert value == max(top.values())                    # greedy: the sampled token is the most likely
    events = sse_events(api, "completions", {**request, "stream": True})
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    _, none = post(url(api, "completions"), {**request, "logprobs": None})
    assert none["choices"][0]["logprobs"] is None


def test_echo_with_logprobs_scores_the_prompt_tokens_first(api, tiny_model_dir):
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    _, plain = post(url(api, "completions"), request)
    status, body = post(url(api, "completions"), {**request, "echo": True})
    assert status == 200, body
    choice, prompt_tokens = body["choices"][0], body["usage"]["prompt_tokens"]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp, tail = choice["logprobs"], plain["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == prompt_tokens + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None     # nothing predicts the first
    assert all(v <= 0 for v in lp["token_logprobs"][1:prompt_tokens])
    assert all(1 <= len(top) <= 3 and top[t] >= v for t, v, top in   # >=: a likelier token of the same text
               zip(lp["tokens"][1:prompt_tokens], lp["token_logprobs"][1:prompt_tokens], lp["top_logprobs"][1:]))
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][prompt_tokens:] == tail[key]
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    # the prompt tokens' log probabilities are the model's: transformers on the same token ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import torch

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT)["input_ids"]
    assert len(ids) == prompt_tokens
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for t in range(1, prompt_tokens):       # the server runs bf16 where the CPU has it
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, ids[t]].item(), rel=0.02, abs=0.05)
    streamed = [e["choices"][0]["logprobs"] for e in sse_events(api, "completions", {**request, "echo": True,
                                                                                       "stream": True})]
    assert [t for x in streamed for t in x["tokens"]] == lp["tokens"]
    assert streamed[0]["token_logprobs"][0] is None


def test_max_tokens_0_with_echo_scores_the_prompt_without_generating(api):
    """What evaluation harnesses send for log-likelihoods: the prompt back, scored, nothing after it."""
    request = {"model": NAME, "prompt": PROMPT, "echo": True, "logprobs": 2, "temperature": 0}
    _, generating = post(url(api, "completions"), {**request, "max_tokens": 4})
    status, body = post(url(api, "completions"), {**request, "max_tokens": 0})
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens == generating["usage"]["prompt_tokens"] > 1
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp, full = choice["logprobs"], generating["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == prompt_tokens
    assert lp["tokens"] == full["tokens"][:prompt_tokens]
    assert lp["text_offset"] == full["text_offset"][:prompt_tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(full["token_logprobs"][1:prompt_tokens], rel=0.02, abs=0.05)

    events = sse_events(api, "completions", {**request, "max_tokens": 0, "stream": True,
                                             "stream_options": {"include_usage": True}})
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
    assert choices[-1]["finish_reason"] == "length"
    assert events[-1]["usage"] == body["usage"]

    _, plain = post(url(api, "completions"), {"model": NAME, "prompt": PROMPT, "echo": True, "max_tokens": 0, "n": 2})
    assert [c["text"] for c in plain["choices"]] == [PROMPT, PROMPT]
    assert all(c["logprobs"] is None for c in plain["choices"])
    assert plain["usage"]["completion_tokens"] == 0


def test_chat_logprobs_in_openai_shape(api):
    request = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0.7,
               "seed": 3, "logprobs": True, "top_logprobs": 2}
    status, body = post(url(api, "chat/completions"), request)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and body["usage"]["completion_tokens"] == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"] >= -9999
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"]
    chunks = sse_events(api, "chat/completions", {**request, "stream": True})
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content                              # seeded: the same tokens, streamed
    _, bare = post(url(api, "chat/completions"), {**request, "top_logprobs": None})
    assert all(e["top_logprobs"] == [] for e in bare["choices"][0]["logprobs"]["content"])
    _, off = post(url(api, "chat/completions"), {**request, "logprobs": False, "top_logprobs": None})
    assert off["choices"][0]["logprobs"] is None


def test_engine_messages_map_to_openai_errors():
    from openai_frontend.errors import from_triton

    e = from_triton("invalid request: unknown sampling parameter(s) ['frequency_penalty', 'min_p']; known: ['seed']")
    assert (e.status, e.param, e.code) == (400, "frequency_penalty", "unsupported_parameter")
    assert "'frequency_penalty', 'min_p'" in e.message and "not supported" in e.message
    e = from_triton("invalid request: top_k must be an integer >= 1, or 0 / -1 for off, got 'x'")
    assert (e.status, e.param) == (400, "top_k")
    e = from_triton("invalid request: prompt token ids must be integers in [0, 320); got [1000000000]")
    assert (e.status, e.param) == (400, "prompt")
    assert from_triton("server overloaded, retry later: 9 requests are waiting").status == 503
    assert from_triton("model unavailable: engine is not healthy").status == 503
    assert from_triton("internal error: KeyError: 3").status == 500


# ---- readiness and cancellation

def test_not_ready_is_503(chat_model_dir):
    from openai_frontend.app import Settings, create_app

    app = create_app(Settings(triton_url=f"127.0.0.1:{free_port()}", model_dir=str(chat_model_dir),
                              served_model_name=NAME))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as c:
            replies = [await c.get("/health"),
                       await c.post("/v1/completions", json=GOOD),
                       await c.post("/v1/chat/completions", json={**GOOD_CHAT, "stream": True}),
                       await c.get("/v1/models")]
        await app.state.triton.close()
        return replies

    health, completion, chat, models = asyncio.run(run())
    for r in (health, completion, chat):
        assert_openai_error(r.status_code, r.json(), 503)
        assert r.json()["error"]["code"] == "model_not_ready"
    assert models.status_code == 200


def idle(server) -> bool:
    load = engine_load(server.metrics_url)
    return load["running"] == load["waiting"] == load["kv_tokens"] == 0


def cancelled(server) -> float:
    return engine_load(server.metrics_url)["cancelled"]


LONG = {"model": NAME, "prompt": "Tell a long story.", "max_tokens": 450, "ignore_eos": True, "temperature": 0}


def test_client_leaving_a_stream_cancels_its_requests(api, server):
    assert wait_for(lambda: idle(server))
    before = cancelled(server)
    with httpx.stream("POST", url(api, "completions"), json={**LONG, "stream": True, "n": 2}, timeout=60) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line)
        for _ in range(6):
            assert next(events).startswith("data: {")
        assert wait_for(lambda: engine_load(server.metrics_url)["running"] == 2)
    # the connection is closed here, mid-stream
    assert wait_for(lambda: idle(server)), engine_load(server.metrics_url)
    assert wait_for(lambda: cancelled(server) == before + 2, timeout=30), (cancelled(server), before)
    status, body = post(url(api, "completions"), GOOD)
    assert status == 200, body


def post_then_leave(api, path: str, body: dict, until) -> None:
    """POST `body` on a socket of its own, wait until `until()` holds, then close the connection
    without reading a byte (a client that went away while waiting for a whole reply)."""
    import socket
    from urllib.parse import urlsplit

    where, data = urlsplit(api.url), json.dumps(body).encode()
    head = (f"POST /v1/{path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(head + data)
        assert wait_for(until), "the request never ran"


def test_client_leaving_a_non_streamed_request_cancels_it(api, server):
    assert wait_for(lambda: idle(server))
    before = cancelled(server)
    # left while it runs (seen in the metrics, pushed every 100 ms), long before its 450 tokens are done
    post_then_leave(api, "chat/completions", {**GOOD_CHAT, "max_tokens": 450, "ignore_eos": True},
                    lambda: engine_load(server.metrics_url)["running"] >= 1)
    assert wait_for(lambda: idle(server)), engine_load(server.metrics_url)
    assert wait_for(lambda: cancelled(server) == before + 1, timeout=30), (cancelled(server), before)


# ---- last: crashes the engine, then reloads the model

def test_a_crashed_engine_ends_streams_with_an_error_and_is_503_until_reloaded(api, server):
    import tritonclient.grpc as grpcclient

    triton = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        # read a few events of a stream, then crash the engine under it
        with httpx.stream("POST", url(api, "completions"), json={**LONG, "stream": True}, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            for _ in range(3):
                assert next(lines).startswith("data: {")
            server.crash_flag.write_text("crash")
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])
        assert set(error) == {"error"} and error["error"]["message"], rest[-2]

        assert wait_for(lambda: not triton.is_model_ready("fastdecode"))
        assert wait_for(lambda: post(url(api, "completions"), GOOD)[0] == 503, timeout=30)
        status, body = post(url(api, "chat/completions"), GOOD_CHAT)
        assert_openai_error(status, body, 503)
        assert body["error"]["code"] == "model_not_ready"
        assert httpx.get(f"{api.url}/health").status_code == 503
    finally:
        server.crash_flag.unlink(missing_ok=True)
    triton.load_model("fastdecode")
    assert triton.is_model_ready("fastdecode")
    status, body = post(url(api, "completions"), GOOD)
    assert status == 200, body


def _result(outputs: list[tuple[str, str, bytes]], raw: bool = True):
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult

    response = service_pb2.ModelInferResponse()
    for name, datatype, data in outputs:
        o = response.outputs.add()
        o.name, o.datatype = name, datatype
        o.shape.append(1)
        if raw:
            response.raw_output_contents.append(data)
        else:
            o.contents.bytes_contents.append(data[4:])
    return InferResult(response)


def test_outputs_read_raw_tensors_as_tritonclient_would_and_refuse_malformed_ones():
    from openai_frontend.errors import APIError
    from openai_frontend.triton import Outputs

    text = "héllo".encode()
    good = [("text_output", "BYTES", len(text).to_bytes(4, "little") + text),
            ("num_output_tokens", "UINT32", (7).to_bytes(4, "little"))]
    out = Outputs(_result(good))
    assert out.string("text_output") == "héllo" and out.uint("num_output_tokens") == 7
    assert out.string("finish_reason") == "" and out.uint("num_input_tokens") == 0
    assert out.has("text_output") and not out.has("logprobs")
    out = Outputs(_result(good[:1], raw=False))    # in `contents`: tritonclient reads only BYTES there
    assert out.string("text_output") == "héllo" and out.has("text_output") and not out.has("logprobs")
    malformed = [("text_output", "BYTES", (99).to_bytes(4, "little") + b"abc"),   # length beyond the data
                 ("text_output", "BYTES", b"\x02\x00"),                           # no whole length prefix
                 ("text_output", "BYTES", (2).to_bytes(4, "little") + b"\xff\xfe"),  # not UTF-8
                 ("text_output", "UINT32", (1).to_bytes(4, "little")),
                 ("num_output_tokens", "UINT32", b"\x01"),
                 ("num_output_tokens", "BYTES", (1).to_bytes(4, "little") + b"x")]
    for name, datatype, data in malformed:
        out = Outputs(_result([(name, datatype, data)]))
        with pytest.raises(APIError, match="malformed") as e:
            out.string(name) if name == "text_output" else out.uint(name)
        assert e.value.status == 502
