"""Stream a completion from a fastdecode Triton server over gRPC (tritonclient).

    python -m fastdecode.ops.client "prompt" [--url 127.0.0.1:8001] [--model fastdecode]
                                [--max-tokens 64] [--temperature 0] [--top-p 1] [--top-k 0] [--seed S]
                                [--stop STR ...] [--no-stream] [--timeout 300]
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
from typing import Iterator, TextIO

import numpy as np

DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "fastdecode"


class GenerationError(RuntimeError):
    pass


def build_inputs(prompt: str | list[int], sampling: dict | None = None, stream: bool = True,
                 extra: dict | None = None):
    """The vLLM-backend tensors: text_input (input_ids for a prompt of token ids), stream,
    sampling_parameters, and BOOL flags in `extra` (exclude_input_in_output, return_finish_reason,
    return_num_input_tokens, ...)."""
    import tritonclient.grpc as grpcclient

    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    if isinstance(prompt, str):
        first = tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")
    else:
        first = tensor("input_ids", np.array(prompt, dtype=np.int64), "INT64")
    inputs = [first, tensor("stream", np.array([stream]), "BOOL")]
    if sampling:
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"))
    for name, value in (extra or {}).items():
        inputs.append(tensor(name, np.array([bool(value)]), "BOOL"))
    return inputs


def generate(prompt: str, *, url: str = DEFAULT_URL, model: str = DEFAULT_MODEL, sampling: dict | None = None,
             stream: bool = True, extra: dict | None = None, timeout: float = 300.0) -> Iterator[dict]:
    """Yield one dict per response: {"text_output": str, and the other outputs present}.
    Raises GenerationError with the server's message."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    ended = False          # the server ended the request (final response or error): nothing to cancel
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer(model, build_inputs(prompt, sampling, stream, extra),
                                      enable_empty_final_response=True)
        except Exception as e:   # the stream broke (server unreachable): its callback got the reason
            try:
                _, error = responses.get(timeout=1.0)
            except queue.Empty:
                error = e
            raise GenerationError(f"cannot send to {url}: {error}") from None
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise GenerationError(f"no response from {url} in {timeout:.0f} s") from None
            if error is not None:
                ended = True
                raise GenerationError(str(error))
            final = result.get_response().parameters["triton_final_response"].bool_param
            ended = final
            out = decode_result(result)
            if out:
                yield out
            if final:
                return
    finally:
        # Cancel only a request still running (timeout, caller stopped early). Cancelling the stream
        # of a request that has ended races Triton 2.51's gRPC frontend: a cancel that lands while
        # the final response is being written marks that request CANCELLATION_ISSUED and waits for
        # a callback that already came, so the request -- and with it the model -- is never freed
        # (the model then stays UNLOADING and never gets finalize()).
        client.stop_stream(cancel_requests=not ended)
        client.close()


def decode_result(result) -> dict:
    out = {}
    for name in ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens"):
        array = result.as_numpy(name)
        if array is None:
            continue
        value = array.reshape(-1)[0]
        out[name] = value.decode("utf-8") if isinstance(value, bytes) else int(value)
    return out


def stream_completion(prompt: str, *, url: str = DEFAULT_URL, model: str = DEFAULT_MODEL,
                      sampling: dict | None = None, out: TextIO = sys.stdout) -> str:
    parts = []
    for response in generate(prompt, url=url, model=model, sampling=sampling):
        text = response.get("text_output", "")
        parts.append(text)
        out.write(text)
        out.flush()
    out.write("\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode.ops.client", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    p.add_argument("--url", default=DEFAULT_URL, help="gRPC address of tritonserver")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    sampling = {"max_tokens": args.max_tokens}
    for key in ("temperature", "top_p", "top_k", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    try:
        if args.no_stream:
            for r in generate(args.prompt, url=args.url, model=args.model, sampling=sampling, stream=False,
                              extra={"exclude_input_in_output": True}, timeout=args.timeout):
                print(r.get("text_output", ""))
        else:
            stream_completion(args.prompt, url=args.url, model=args.model, sampling=sampling)
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # anything else from the transport: one line, not a traceback
        print(f"error: {args.url}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
