"""Run fastdecode on Triton: local R-workers + tritonserver + one streamed completion.

    python -m fastdecode.ops.serve start --model DIR --rworkers N --run-dir DIR
                                     [--grpc-port 8001 --http-port 8000 --metrics-port 8002]
                                     [--host 127.0.0.1] [--param KEY=VALUE ...] [--timeout S]
    python -m fastdecode.ops.serve stop --run-dir DIR

`start` runs the R-Part in-process by default (the local attention backend: the same kernel, on
the S-Part's cores); --rworkers N launches N local R-workers (fastdecode.ops.fleet.LocalFleet) and
--rworkers-at HOST:PORT,... uses R-workers that already run elsewhere. It writes
DIR/model_repository (the repository's config.pbtxt with the model parameters filled in, the
model code linked, not copied), starts tritonserver in the background (log and pid in DIR),
waits for /v2/health/ready, streams one completion and prints how to call the server.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from fastdecode.config import EngineConfig, config_from_settings
from fastdecode.ops import openai_process
from fastdecode.ops.procs import alive
from fastdecode.ops.triton import DEFAULT_MODEL_NAME, TritonServer, stop_process, write_model_repository


def _engine_parameters(args) -> dict[str, str]:
    params = {"model": str(args.model)}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param wants KEY=VALUE, got {item!r}")
        params[key.strip()] = value
    return params


def _check_settings(params: dict[str, str], local_rworkers: int) -> None:
    """Bad settings fail here, before a directory or an R-worker is made, not as a model that will
    not load. Local R-workers are not started yet: stand-in addresses take their place."""
    settings = dict(params)
    if local_rworkers > 0 and "rworkers" not in settings:
        settings["rworkers"] = ",".join(["127.0.0.1:1"] * local_rworkers)
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    config_from_settings({k: v for k, v in settings.items() if k in engine_keys}, plan=params.get("plan", ""))


def cmd_start(args) -> int:
    params = _engine_parameters(args)
    if args.rworkers_at:
        params["rworkers"] = args.rworkers_at
    try:
        _check_settings(params, args.rworkers)
    except ValueError as e:
        print(f"fastdecode.ops.serve: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "tritonserver.pid").exists():
        pid = int((run_dir / "tritonserver.pid").read_text())
        if alive(pid):
            print(f"tritonserver already runs (pid {pid}) with run dir {run_dir}; `make stop` first", file=sys.stderr)
            return 1
    fleet = None
    if not args.rworkers_at and args.rworkers > 0:
        from fastdecode.ops.fleet import LocalFleet

        print(f"starting {args.rworkers} local R-worker(s) ...", file=sys.stderr)
        fleet = LocalFleet(args.rworkers, run_dir / "rworkers", kv_capacity=args.kv_capacity).start()
        params["rworkers"] = ",".join(fleet.addresses)
        print(f"R-workers: {','.join(fleet.addresses)}", file=sys.stderr)
    repo = write_model_repository(run_dir / "model_repository", params)
    server = TritonServer(repo, run_dir, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port)
    print(f"starting tritonserver (log {server.log_path}) ...", file=sys.stderr)
    try:
        server.start(timeout=args.timeout)
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"fastdecode.ops.serve: {e}", file=sys.stderr)
        if fleet is not None:
            fleet.stop()
        return 1
    server.proc = None   # keep it running after we exit; `stop` ends it through the pid file
    (run_dir / "serve.json").write_text(json.dumps({"http": server.http_url, "grpc": server.grpc_url,
                                                    "metrics": server.metrics_url, "parameters": params}, indent=1))
    from fastdecode.ops import client

    prompt = "The sea is"
    print(f"\nready. one streamed completion from model {DEFAULT_MODEL_NAME!r}:", file=sys.stderr)
    print(prompt, end="", flush=True)
    try:
        text = client.stream_completion(prompt, url=server.grpc_url,
                                        sampling={"max_tokens": 32, "temperature": 0.0}, out=sys.stdout)
    except Exception as e:  # noqa: BLE001 -- any failure of the first completion fails the command
        text, reason = "", f"{type(e).__name__}: {e}"
    else:
        reason = "" if text else "the completion streamed no text"
    if reason:
        print(f"\nfastdecode.ops.serve: the server started but its first completion failed ({reason}); it keeps "
              f"running for a look at {server.log_path}; `make stop` ends it", file=sys.stderr)
        return 1
    openai = ""
    if args.openai_port:
        try:
            url = openai_process.start(run_dir, server.grpc_url, str(Path(args.model).resolve()), server.host,
                                       args.openai_port)
        except RuntimeError as e:
            print(f"\nfastdecode.ops.serve: {e}\ntritonserver keeps running; `make stop` ends it", file=sys.stderr)
            return 1
        auth = " -H \"Authorization: Bearer $FASTDECODE_API_KEY\"" if os.environ.get("FASTDECODE_API_KEY") else ""
        openai = f"""
OpenAI API: {url}/v1 (model {Path(args.model).name!r})
  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "{Path(args.model).name}", "messages": [{{"role": "user", "content": "Hello"}}]}}'"""
    print(f"""

tritonserver runs on {server.host}: HTTP {server.http_port}, gRPC {server.grpc_port}, metrics {server.metrics_port}
  python -m fastdecode.ops.client "Hello" --url {server.grpc_url} --max-tokens 64
  curl -s -X POST http://{server.http_url}/v2/models/{DEFAULT_MODEL_NAME}/generate \\
       -d '{{"text_input": "Hello", "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
  curl -sN -X POST http://{server.http_url}/v2/models/{DEFAULT_MODEL_NAME}/generate_stream \\
       -d '{{"text_input": "Hello", "stream": true, "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
  curl -s {server.metrics_url} | grep fastdecode_{openai}
stop with: make stop   (python -m fastdecode.ops.serve stop --run-dir {run_dir})""")
    return 0


def cmd_stop(args) -> int:
    run_dir = Path(args.run_dir)
    if (pid := openai_process.stop(run_dir)) is not None:
        print(f"stopped the OpenAI frontend (pid {pid})", file=sys.stderr)
    pid_file = run_dir / "tritonserver.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        if alive(pid):
            clean = stop_process(pid, timeout=args.timeout)
            print(f"stopped tritonserver (pid {pid})" + ("" if clean else
                  f"; it did not exit cleanly, leftovers were killed (log {run_dir / 'tritonserver.log'})"),
                  file=sys.stderr)
        pid_file.unlink(missing_ok=True)
    else:
        print(f"no tritonserver recorded in {run_dir}", file=sys.stderr)
    if (run_dir / "rworkers" / "fleet.json").exists():
        from fastdecode.ops.fleet import LocalFleet

        fleet = LocalFleet.load(run_dir / "rworkers")
        if fleet is not None:
            fleet.stop()
            print(f"stopped {fleet.n} R-worker(s)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode.ops.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start")
    s.add_argument("--model", default="models/smollm2-135m-instruct", help="HF model directory")
    s.add_argument("--rworkers", type=int, default=0, help="local R-workers; 0 = in-process attention (default)")
    s.add_argument("--rworkers-at", default="", help="HOST:PORT,... of R-workers already running elsewhere")
    s.add_argument("--kv-capacity", default="1G", help="KV pool of each local R-worker")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--host", default="127.0.0.1", help="address tritonserver binds to")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API beside Triton; 0 = off")
    s.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a model parameter (EngineConfig field, e.g. scheduler=sls, dtype=bfloat16)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    t = sub.add_parser("stop")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--timeout", type=float, default=40.0)
    args = p.parse_args(argv)
    return cmd_start(args) if args.command == "start" else cmd_stop(args)


if __name__ == "__main__":
    sys.exit(main())
