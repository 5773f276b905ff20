"""Teacher-forced perplexity through the S-Part and an attention backend.

The text is cut into a few chunks that run as one batch. Each chunk's first
`prefix` tokens are prefilled (attention on the S-worker); every later token
goes through the decode path, so its attention reads the KV the backend stored
(fp16 or int4). Only decode-predicted tokens count.

    python -m fastdecode.eval --model DIR --text FILE --attention local --kv-format int4
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from fastdecode.attention import KVSpec, create_backend
from fastdecode.config import EngineConfig
from fastdecode.engine.engine import share_cores
from fastdecode.engine.model_runner import ModelRunner
from fastdecode.model.loader import load_model


def perplexity(config: EngineConfig, text: str, prefix: int = 8, chunks: int = 8, loaded=None) -> dict:
    threads = torch.get_num_threads()
    try:
        return _perplexity(share_cores(config, config.torch_device), text, prefix, chunks, loaded)
    finally:
        torch.set_num_threads(threads)      # share_cores changed it for this run only


def _perplexity(config: EngineConfig, text: str, prefix: int, chunks: int, loaded) -> dict:
    loaded = loaded or load_model(config.model, config.dtype, config.torch_device, config.max_model_len)
    a = loaded.args
    ids = loaded.tokenizer(text)["input_ids"]
    length = len(ids) // chunks
    if length <= prefix + 1:
        raise ValueError(f"text too short: {len(ids)} tokens for {chunks} chunks with prefix {prefix}")
    rows = [ids[i * length:(i + 1) * length] for i in range(chunks)]
    backend = create_backend(config, KVSpec(a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim))
    runner = ModelRunner(loaded.model, backend, config.torch_device, config.num_minibatches)
    seq_ids = list(range(1, chunks + 1))
    targets = torch.tensor(rows)                          # [chunks, length]
    nll, count = 0.0, 0
    try:
        backend.open(seq_ids)
        with torch.inference_mode():
            logits, lost = runner.prefill(seq_ids, [r[:prefix] for r in rows])
            assert not lost
            for t in range(prefix, length):
                logp = logits.log_softmax(-1)
                nll -= logp.gather(1, targets[:, t:t + 1]).sum().item()
                count += chunks
                if t + 1 == length:
                    break
                res = runner.decode(seq_ids, targets[:, t].tolist(), [t] * chunks)
                assert not res.lost and res.rows == list(range(chunks))
                logits = res.logits
    finally:
        backend.close(seq_ids)
        backend.shutdown()
    return {"perplexity": math.exp(nll / count), "tokens_scored": count, "text_tokens": len(ids),
            "attention": config.attention, "kv_format": config.kv_format, "dtype": config.dtype}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--attention", default="local", choices=("local", "torch", "remote"))
    p.add_argument("--kv-format", default="fp16", choices=("fp16", "int4"))
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    config = EngineConfig(model=a.model, attention=a.attention, kv_format=a.kv_format, dtype=a.dtype)
    with open(a.text, encoding="utf-8") as f:
        print(json.dumps(perplexity(config, f.read()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
