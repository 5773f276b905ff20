"""python -m openai_frontend --triton-url 127.0.0.1:8001 --model-dir DIR [--port 9000] ..."""
from __future__ import annotations

import argparse
import os
import signal
import sys


def valid_key(key: str) -> bool:
    """What an HTTP header carries as is: the SDKs send the key verbatim after 'Bearer '."""
    return bool(key) and all(33 <= ord(c) <= 126 for c in key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m openai_frontend",
                                description="OpenAI-compatible HTTP server in front of a fastdecode Triton deployment")
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC address")
    p.add_argument("--model-dir", required=True, help="the checkpoint Triton serves (its tokenizer's chat template)")
    p.add_argument("--model", default="fastdecode", help="the Triton model to call")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model dir's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="chat completions without max_tokens (default: the model's context length)")
    p.add_argument("--api-key", default=os.environ.get("FASTDECODE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $FASTDECODE_API_KEY; "
                        "unset = no key)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.api_key is not None and not valid_key(args.api_key):
        p.error("--api-key / FASTDECODE_API_KEY must be printable ASCII without spaces")

    import uvicorn

    from openai_frontend.app import Settings, create_app

    app = create_app(Settings(triton_url=args.triton_url, model_dir=args.model_dir, model=args.model,
                              served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens,
                              api_key=args.api_key))
    print(f"openai_frontend: serving {app.title} at http://{args.host}:{args.port}/v1 "
          f"(Triton {args.triton_url}, model {args.model})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again to the handler it found: exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
