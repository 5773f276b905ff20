"""fastdecode.ops.serve without a server (repository writing, CLI arguments), and `serve start/stop`
end to end (slow: it starts R-workers and tritonserver like `make serve`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastdecode.ops import procs, serve, triton
from fastdecode.config import REPO_ROOT
from python_backend.config import build_configs, model_parameters


def parse_config(text: str):
    """A config.pbtxt parsed as Triton parses it (protobuf text format into ModelConfig)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def parse_pbtxt_parameters(text: str) -> dict[str, str]:
    return {k: v.string_value for k, v in parse_config(text).parameters.items()}


def test_write_model_repository_sets_parameters_and_links_code(tmp_path):
    repo = triton.write_model_repository(tmp_path / "repo", {"model": 'odd "dir"/мир', "rworkers": "a:1,b:2"})
    text = (repo / "fastdecode" / "config.pbtxt").read_text()
    params = parse_pbtxt_parameters(text)
    assert params["model"] == 'odd "dir"/мир' and params["rworkers"] == "a:1,b:2"
    assert text.count('key: "model"') == 1                    # replaced, not duplicated
    assert params["scheduler"] == ""                           # untouched defaults stay
    assert (repo / "fastdecode" / "1").resolve() == (REPO_ROOT / "model_repository" / "fastdecode" / "1")
    assert (repo / "ensemble" / "config.pbtxt").read_text() == \
        (REPO_ROOT / "model_repository" / "ensemble" / "config.pbtxt").read_text()
    # what the model would build from it
    engine, _ = build_configs(model_parameters({"parameters": {k: {"string_value": v} for k, v in params.items()}}))
    assert engine.rworkers == ("a:1", "b:2") and engine.attention == "remote"
    triton.write_model_repository(tmp_path / "repo", {"model": "again"})      # rewriting is fine
    assert parse_pbtxt_parameters((repo / "fastdecode" / "config.pbtxt").read_text())["model"] == "again"


def test_shipped_config_builds_the_default_engine_config():
    text = (REPO_ROOT / "model_repository" / "fastdecode" / "config.pbtxt").read_text()
    params = parse_pbtxt_parameters(text)
    engine, host = build_configs(model_parameters({"parameters": {k: {"string_value": v} for k, v in params.items()}}))
    assert engine.model == str(REPO_ROOT / "models" / "smollm2-135m-instruct")
    assert engine.attention == "local" and engine.rworkers == ()
    config = parse_config(text)
    assert config.model_transaction_policy.decoupled and config.backend == "python"
    assert [g.count for g in config.instance_group] == [1]
    assert [i.name for i in config.input][:4] == ["text_input", "input_ids", "stream", "sampling_parameters"]
    assert all(i.optional for i in config.input)        # the prompt comes as text_input or as input_ids
    assert [o.name for o in config.output] == ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                                                 "logprobs", "prompt_logprobs"]


def test_cli_rejects_garbage(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        serve.main(["start", "--run-dir", str(run_dir), "--param", "no-equals-sign"])
    with pytest.raises(SystemExit):
        serve.main(["start", "--run-dir", str(run_dir), "--rworkers", "many"])
    with pytest.raises(SystemExit):
        serve.main(["launch"])
    assert not run_dir.exists()                     # refused before anything was created


@pytest.mark.parametrize("extra", [["--param", "dtype=float8"], ["--param", "max_running=-3"],
                                   ["--rworkers", "2", "--param", "kv_format=int9"],
                                   ["--rworkers-at", "127.0.0.1:1", "--param", "attention=warp"]])
def test_cli_refuses_bad_settings_before_making_anything(tmp_path, capsys, extra):
    run_dir = tmp_path / "run"
    assert serve.main(["start", "--run-dir", str(run_dir), *extra]) == 2
    assert "fastdecode.ops.serve:" in capsys.readouterr().err
    assert not run_dir.exists()                     # no run dir, so no R-worker was started either


def test_stop_without_a_server_is_harmless(tmp_path, capsys):
    assert serve.main(["stop", "--run-dir", str(tmp_path)]) == 0
    assert "no tritonserver recorded" in capsys.readouterr().err


def test_server_env_puts_this_python_first():
    env = triton.server_env()
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[-1].endswith("nvidia_pytriton.libs")


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.skipif(not triton.tritonserver_binary().exists(), reason="tritonserver binary missing")
def test_serve_start_and_stop_like_make_serve(tiny_model_dir, tmp_path):
    ports = [str(procs.free_port()) for _ in range(3)]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastdecode.ops.serve"]
    start = subprocess.run([*cmd, "start", "--model", tiny_model_dir, "--rworkers", "1", "--kv-capacity", "64M",
                            "--run-dir", str(run_dir), "--http-port", ports[0], "--grpc-port", ports[1],
                            "--metrics-port", ports[2], "--openai-port", "0"], capture_output=True, text=True, timeout=300,
                           cwd=REPO_ROOT)
    try:
        assert start.returncode == 0, start.stderr
        assert "ready. one streamed completion" in start.stderr and f"127.0.0.1:{ports[1]}" in start.stdout
        pid = int((run_dir / "tritonserver.pid").read_text())
        assert triton.http_ok(f"http://127.0.0.1:{ports[0]}/v2/health/ready")
        again = subprocess.run([*cmd, "start", "--model", tiny_model_dir, "--run-dir", str(run_dir)],
                               capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert again.returncode == 1 and "already runs" in again.stderr
    finally:
        stop = subprocess.run([*cmd, "stop", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120,
                              cwd=REPO_ROOT)
    assert stop.returncode == 0, stop.stderr
    assert "stopped tritonserver" in stop.stderr and "stopped 1 R-worker" in stop.stderr
    deadline = time.monotonic() + 10
    while procs.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not procs.alive(pid) and procs.group_members(pid) == []      # no stub left behind
    assert not triton.http_ok(f"http://127.0.0.1:{ports[0]}/v2/health/ready")


def _serve_start(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    ports = [str(procs.free_port()) for _ in range(4)]
    return subprocess.run([sys.executable, "-m", "fastdecode.ops.serve", "start", "--run-dir", str(run_dir),
                           "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                           "--openai-port", ports[3], *extra],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)


def _serve_stop(run_dir: Path) -> None:
    stop = subprocess.run([sys.executable, "-m", "fastdecode.ops.serve", "stop", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert stop.returncode == 0 and "stopped tritonserver" in stop.stderr, stop.stderr


@pytest.mark.triton
@pytest.mark.skipif(not triton.tritonserver_binary().exists(), reason="tritonserver binary missing")
def test_make_serve_streams_its_first_completion(tmp_path):
    """What `make serve` runs, at its defaults (the default model, the R-Part in-process): it exits 0
    only after the first completion streamed text, and prints that text; the OpenAI API it prints
    answers the openai SDK, and `stop` ends it too."""
    from openai import OpenAI

    run_dir = tmp_path / "run"
    start = _serve_start(run_dir)
    try:
        assert start.returncode == 0, start.stderr
        completion = start.stdout.split("The sea is", 1)[1].split("tritonserver runs on", 1)[0]
        assert len(completion.strip()) >= 10, start.stdout
        params = json.loads((run_dir / "serve.json").read_text())["parameters"]
        assert "rworkers" not in params and "attention" not in params         # embedded by default
        base_url = start.stdout.split("OpenAI API: ", 1)[1].split()[0]
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Name a colour."}])
        assert reply.choices[0].message.content.strip() and reply.usage.completion_tokens >= 1
        frontend_pid = int((run_dir / "openai_frontend.pid").read_text())
    finally:
        _serve_stop(run_dir)
    assert not procs.alive(frontend_pid) and not (run_dir / "openai_frontend.pid").exists()


@pytest.mark.triton
@pytest.mark.skipif(not triton.tritonserver_binary().exists(), reason="tritonserver binary missing")
def test_make_serve_fails_when_its_first_completion_fails(tiny_model_dir, tmp_path):
    fault = tmp_path / "fault"
    fault.write_text("")                       # every engine step fails while this file exists
    run_dir = tmp_path / "run"
    start = _serve_start(run_dir, "--model", tiny_model_dir, "--param", f"fault_step_error_file={fault}")
    try:
        assert start.returncode == 1, (start.stdout, start.stderr)
        assert "first completion failed" in start.stderr and "injected engine fault" in start.stderr, start.stderr
    finally:
        _serve_stop(run_dir)
