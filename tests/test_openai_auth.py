"""API keys on the OpenAI frontend: the app in-process (no Triton needed for the routes hit here),
and the real SDK with a key against a real deployment."""
from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from fastdecode.ops.procs import free_port
from fastdecode.ops.triton import tritonserver_binary
from openai_frontend.__main__ import main as frontend_main, valid_key
from openai_frontend.app import Settings, create_app
from openai_frontend.testing import Frontend
from test_openai_frontend import NAME, chat_model_dir  # noqa: F401
from test_triton import fleet, server  # noqa: F401

KEY = "sk-test-0123456789"


def client(model_dir, api_key=None) -> TestClient:
    app = create_app(Settings(triton_url="127.0.0.1:1", model_dir=str(model_dir), served_model_name=NAME,
                              api_key=api_key))
    return TestClient(app, raise_server_exceptions=False)


def assert_unauthorized(r):
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key" and error["message"]


def test_without_a_key_every_route_is_open(tiny_model_dir):
    with client(tiny_model_dir) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_with_a_key_the_right_bearer_token_passes(tiny_model_dir):
    with client(tiny_model_dir, KEY) as c:
        r = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [NAME]
        assert c.get("/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": ""},
    {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"bearer {KEY}"},
    {"Authorization": f"Bearer {KEY} "},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": "Bearer " + "k" * 100_000},
    {"Authorization": "Bearer \xe9\xff".encode("latin-1")},
    [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
    {"X-Api-Key": KEY},
])
def test_a_missing_or_wrong_key_gets_openai_401_and_the_server_keeps_serving(tiny_model_dir, headers):
    with client(tiny_model_dir, KEY) as c:
        for method, path in (("GET", "/v1/models"), ("GET", f"/v1/models/{NAME}"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1"), ("GET", "/v1/nowhere")):
            assert_unauthorized(c.request(method, path, headers=headers, content=b"\x00garbage"))
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_health_stays_open_for_probes(tiny_model_dir):
    with client(tiny_model_dir, KEY) as c:
        assert c.get("/health").status_code != 401
        assert c.get("/v1x").status_code == 404          # not under /v1/: no key asked, no such route


@pytest.mark.parametrize("key,ok", [(KEY, True), ("a", True), ("", False), ("has space", False), ("tab\tkey", False),
                                    ("ключ", False), ("new\nline", False)])
def test_keys_a_header_cannot_carry_are_refused_at_start(key, ok, tiny_model_dir, monkeypatch, capsys):
    assert valid_key(key) is ok
    if ok:
        return
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the frontend started with a bad key"))
    with pytest.raises(SystemExit) as e:
        frontend_main(["--model-dir", str(tiny_model_dir), "--api-key", key])
    assert e.value.code == 2 and "--api-key" in capsys.readouterr().err
    if not key:                       # FASTDECODE_API_KEY="" is the same as unset: no key
        return
    monkeypatch.setenv("FASTDECODE_API_KEY", key)
    with pytest.raises(SystemExit) as e:
        frontend_main(["--model-dir", str(tiny_model_dir)])
    assert e.value.code == 2 and "FASTDECODE_API_KEY" in capsys.readouterr().err


@pytest.mark.triton
@pytest.mark.skipif(not tritonserver_binary().exists(), reason="tritonserver binary missing")
def test_the_sdk_with_the_key_completes_and_without_it_gets_authentication_error(server, chat_model_dir, tmp_path):
    with Frontend(server.grpc_url, chat_model_dir, free_port(), name=NAME, log_path=tmp_path / "frontend.log",
                  extra=["--api-key", KEY]) as f:
        with openai.OpenAI(base_url=f"{f.url}/v1", api_key=KEY, max_retries=0, timeout=60) as sdk:
            r = sdk.completions.create(model=NAME, prompt="The quick brown fox", temperature=0, max_tokens=5)
            assert r.choices[0].text and r.usage.completion_tokens == 5
        with openai.OpenAI(base_url=f"{f.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60) as wrong:
            with pytest.raises(openai.AuthenticationError) as e:
                wrong.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert not f.killed and f.exit_code == 0, f.log()
