"""Peer benchmark: vLLM (CPU build) on the shared fixed-length decode workload.

Run with the python of `make vllm-venv` (build/vllm-venv), never fastdecode's venv;
this file imports nothing from fastdecode. bench/bench_peers.py runs it with --serve: one
engine for the whole run, one batch per line on stdin, so the peers take turns per batch.

For each batch size B, B requests are submitted at once to one AsyncLLM engine
(created once, vLLM defaults otherwise). Request i has the plain-text prompt
f"Request {i}: write a short story about {topics[i % 8]}." (tokenized with the
model's tokenizer, no chat template) and generates exactly seq_len - len(prompt)
tokens, greedy, ignore_eos. Every streamed output is timestamped, giving:
  ttft   time from submission to the request's first output
  itl    gap between successive outputs, split evenly over the new tokens in it
  tokens_per_s  all generated tokens / (last final output - first submission)
"""

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time

TOPICS = ["the sea", "a mountain", "bread", "a robot", "rain", "a library", "trains", "the moon"]


def prompt_text(i: int) -> str:
    return f"Request {i}: write a short story about {TOPICS[i % 8]}."


def set_cpu_env(threads: int) -> None:
    """Pin vLLM's CPU worker to `threads` cores, none reserved; fix the KV cache size.

    Set before importing vllm.

    In its default "auto" mode vLLM reserves one core per worker for the engine
    process, which on a 2-core machine leaves a single OpenMP thread. An explicit
    core list is used as given; values already in the environment win.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        print(f"warning: --threads {threads} > {len(cpus)} usable cores", file=sys.stderr)
    ids = cpus[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, ids)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # By default vLLM sizes the KV cache as 92% of the NUMA node's memory and refuses
    # to start when that much is not free; an explicit size (in GiB) skips that check.
    # 4 GiB holds 512 x 128 tokens of SmolLM2-135M several times over.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


async def one_request(engine, tok_ids, text, max_tokens, req_id, t_submit):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first, last, n_prev, itl = None, None, 0, []
    async for out in engine.generate({"prompt_token_ids": tok_ids, "prompt": text}, sp, req_id):
        now = time.perf_counter()
        n = len(out.outputs[0].token_ids)  # cumulative output kind
        new = n - n_prev
        if new > 0:
            if first is None:
                first = now
            else:
                itl.extend([(now - last) / new] * new)
            last, n_prev = now, n
        if out.finished:
            break
    return {"ttft": first - t_submit, "itl": itl, "tokens": n_prev, "end": last}


async def run_batch(engine, tokenizer, b, seq_len, tag):
    reqs = []
    for i in range(b):
        text = prompt_text(i)
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= seq_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens >= seq_len {seq_len}")
        reqs.append((ids, text, seq_len - len(ids)))
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one_request(engine, ids, text, mt, f"{tag}-{i}", t0)
                                 for i, (ids, text, mt) in enumerate(reqs)))
    wall = max(r["end"] for r in res) - t0
    tokens = sum(r["tokens"] for r in res)
    expected = sum(mt for _, _, mt in reqs)
    ttft = [r["ttft"] for r in res]
    itl = [x for r in res for x in r["itl"]]
    row = {"batch": b, "seq_len": seq_len, "tokens": tokens, "wall_s": wall,
           "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
           "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}
    if tokens != expected:
        row["error"] = f"generated {tokens} tokens, expected {expected}"
    return row


MARK = "PEERS_VLLM "   # prefix of the protocol lines on stdout (vLLM logs there too)


async def serve(engine, tokenizer, args, info) -> None:
    """--serve: say ready, then run one {"batch", "seq_len"} line from stdin at a time, answering each
    with its row, until stdin closes. The caller runs the other peers between them."""
    print(MARK + json.dumps({"ready": True, **info}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        b, seq_len = int(cmd["batch"]), int(cmd["seq_len"])
        try:
            row = await asyncio.wait_for(run_batch(engine, tokenizer, b, seq_len, f"L{seq_len}b{b}"), args.timeout_s)
        except Exception as e:  # noqa: BLE001 -- the caller records why
            row = {"batch": b, "seq_len": seq_len, "error": f"{type(e).__name__}: {e}"}
            for _ in range(600):
                if engine.get_num_unfinished_requests() == 0:
                    break
                await asyncio.sleep(0.1)
        print(MARK + json.dumps(row), flush=True)


async def main_async(args):
    import torch
    import vllm
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=args.model))
    try:
        env_keys = ("VLLM_CPU_", "OMP_", "KMP_", "GOMP_", "MKL_", "LD_PRELOAD")
        result = {
            "peer": "vllm", "model": os.path.abspath(args.model), "threads": args.threads,
            "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "engine_start_s": time.perf_counter() - t, "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            # as vLLM left them after configuring its CPU worker
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(env_keys)},
            "results": [],
        }
        t = time.perf_counter()  # warm-up, not measured
        warm = {"prompt_token_ids": tokenizer("Hello")["input_ids"]}
        async for _ in engine.generate(warm, SamplingParams(temperature=0.0, max_tokens=8), "w"):
            pass
        result["warmup_s"] = time.perf_counter() - t
        if args.serve:
            await serve(engine, tokenizer, args, result)
            return result
        for b in args.batches:
            try:
                row = await asyncio.wait_for(
                    run_batch(engine, tokenizer, b, args.seq_len, f"b{b}"), args.timeout_s)
            except Exception as e:  # record it and go on with the other batches
                err = (f"timeout after {args.timeout_s} s" if isinstance(e, TimeoutError)
                       else f"{type(e).__name__}: {e}")
                row = {"batch": b, "seq_len": args.seq_len, "error": err}
                for _ in range(600):  # let the engine drop the aborted requests first
                    if engine.get_num_unfinished_requests() == 0:
                        break
                    await asyncio.sleep(0.1)
            print(json.dumps(row), flush=True)
            result["results"].append(row)
    finally:
        engine.shutdown()
        # AsyncLLM.__del__ shuts down again: collected here, not at interpreter exit, where the
        # module globals it uses are gone and it raises.
        del engine
        gc.collect()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32,128,512")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", default="", help="the JSON of all batches (not with --serve)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=None, help="per batch")
    ap.add_argument("--serve", action="store_true", help="take batches from stdin (bench_peers.py interleaves peers)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",") if x]
    set_cpu_env(args.threads)
    result = asyncio.run(main_async(args))
    if args.serve:
        return
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
