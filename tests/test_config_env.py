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
    ("FASTDECODE_CPU_GEMM", "mkl"),
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


# ---- one way from text to an EngineConfig: the CLI, Triton's parameters and `make serve` share it

def test_cli_and_triton_parameters_give_the_same_config(clean_env, tmp_path):
    import argparse

    from fastdecode.engine.cli import _config, _engine_args

    clean_env.setenv("FASTDECODE_MAX_RUNNING", "7")
    p = argparse.ArgumentParser()
    _engine_args(p)
    a = p.parse_args(["--model", str(tmp_path), "--rworkers", "127.0.0.1:1,127.0.0.1:2", "--param", "sls_f=3"])
    from_cli = _config(a)
    from_triton, _ = build_configs({"model": str(tmp_path), "rworkers": "127.0.0.1:1,127.0.0.1:2", "sls_f": "3"})
    assert from_cli == from_triton
    assert from_cli.attention == "remote" and from_cli.max_running == 7 and from_cli.sls_f == 3
    assert _config(p.parse_args(["--model", str(tmp_path)])).attention == EngineConfig.attention


@pytest.mark.parametrize("argv, words", [(["--param", "sls_f"], "KEY=VALUE"), (["--param", "nope=1"], "nope"),
                                         (["--param", "max_running=lots"], "max_running"),
                                         (["--attention", "remote"], "R-worker address")])
def test_cli_garbage_settings_exit_with_the_reason(clean_env, argv, words):
    import argparse

    from fastdecode.engine.cli import _config, _engine_args

    p = argparse.ArgumentParser()
    _engine_args(p)
    with pytest.raises(SystemExit) as e:
        _config(p.parse_args(argv))
    assert words in str(e.value)


def test_serve_refuses_bad_settings_before_starting_anything(tmp_path, capsys):
    from fastdecode.ops import serve

    code = serve.main(["start", "--run-dir", str(tmp_path), "--openai-port", "0", "--param", "scheduler=lifo"])
    assert code == 2 and "scheduler must be one of" in capsys.readouterr().err
    assert not (tmp_path / "tritonserver.pid").exists() and not (tmp_path / "model_repository").exists()


@pytest.mark.parametrize("settings, words", [
    ({"rworker_tls_cert": "c.pem"}, "go together"), ({"rworker_tls_key": "k.pem"}, "go together"),
    ({"rworker_tls_cert": "c.pem", "rworker_tls_key": "k.pem"}, "needs rworker_tls_ca")])
def test_half_a_tls_setup_is_an_error_not_plaintext(clean_env, settings, words):
    with pytest.raises(ValueError, match=words):
        build_configs({"rworkers": "127.0.0.1:1", **settings})
