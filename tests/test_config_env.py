"""FASTDECODE_* environment variables: EngineConfig.from_env and the Triton model's config path
(the README's FASTDECODE_RWORKER_TOKEN route to the R-workers' secret)."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig
from python_backend.config import build_configs


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("FASTDECODE_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_from_env_reads_every_type(clean_env):
    clean_env.setenv("FASTDECODE_KV_CAPACITY_BYTES", "512M")
    clean_env.setenv("FASTDECODE_RWORKER_TIMEOUT_S", "2.5")
    clean_env.setenv("FASTDECODE_KV_INT4_FP16_TAIL", "off")
    clean_env.setenv("FASTDECODE_RWORKERS", "a:1, b:2,")
    clean_env.setenv("FASTDECODE_SCHEDULER", "sls")
    c = EngineConfig.from_env()
    assert c.kv_capacity_bytes == 512 << 20
    assert c.rworker_timeout_s == 2.5
    assert c.kv_int4_fp16_tail is False
    assert c.rworkers == ("a:1", "b:2")
    assert c.scheduler == "sls"
    assert EngineConfig.from_env().max_running == EngineConfig().max_running    # unset: the default


def test_from_env_overrides_win_and_other_prefixes_are_ignored(clean_env):
    clean_env.setenv("FASTDECODE_MAX_RUNNING", "64")
    clean_env.setenv("OTHER_MAX_RUNNING", "7")
    assert EngineConfig.from_env().max_running == 64
    assert EngineConfig.from_env(max_running=8).max_running == 8
    assert EngineConfig.from_env(prefix="OTHER_").max_running == 7


@pytest.mark.parametrize("key, value", [
    ("FASTDECODE_MAX_RUNNING", "many"),
    ("FASTDECODE_MAX_RUNNING", "1.5"),
    ("FASTDECODE_RWORKER_TIMEOUT_S", "soon"),
    ("FASTDECODE_KV_INT4_FP16_TAIL", "maybe"),
    ("FASTDECODE_KV_CAPACITY_BYTES", "12Q"),
])
def test_from_env_garbage_names_the_variable(clean_env, key, value):
    clean_env.setenv(key, value)
    field = key.removeprefix("FASTDECODE_").lower()
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_env()


def test_rworker_token_from_the_environment_reaches_the_engine_config(clean_env):
    """config.pbtxt leaves the token unset; the variable fills it; a model parameter still wins."""
    clean_env.setenv("FASTDECODE_RWORKER_TOKEN", "s3cret")
    engine, _ = build_configs({"rworkers": "127.0.0.1:1"})
    assert engine.rworker_token == "s3cret" and engine.attention == "remote"
    engine, _ = build_configs({"rworkers": "127.0.0.1:1", "rworker_token": "explicit"})
    assert engine.rworker_token == "explicit"
    clean_env.delenv("FASTDECODE_RWORKER_TOKEN")
    assert build_configs({})[0].rworker_token == ""
