"""Teacher-forced perplexity through the S-Part and an attention backend.

The text is cut into `chunks` chunks of `context` tokens (fewer when the text is
short) that run as one batch. Each chunk's first `prefix` tokens are prefilled
(attention on the S-worker; their K, V go to the backend); every later token
goes through the decode path, so its attention reads the KV the backend stored
(fp16 or int4) over up to `context` tokens. Only decode-predicted tokens count.

The default text is "The standard type hierarchy" of the Python Language
Reference as CPython ships it (pydoc_data.topics, ~8.9k tokens of English
prose): always installed, never downloaded.

    python -m fastdecode.eval --attention local --kv-format int4       # one perplexity, printed
    python -m fastdecode.eval --compare      # fp32 KV (torch) / fp16 / int4 -> bench/results/perplexity.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from fastdecode.attention import KVSpec, create_backend
from fastdecode.config import REPO_ROOT, EngineConfig
from fastdecode.engine.model_runner import ModelRunner
from fastdecode.model.loader import load_model

CONTEXT = 1024          # tokens per chunk
CHUNKS = 8
PREFIX = 8              # prefilled tokens per chunk; the rest are decoded
RESULTS = REPO_ROOT / "bench" / "results" / "perplexity.json"


def default_text() -> tuple[str, str]:
    """(name, text) of the default evaluation text (see the module docstring)."""
    from pydoc_data.topics import topics

    return f"pydoc_data.topics['types'] (Python {'.'.join(map(str, sys.version_info[:3]))})", topics["types"]


def perplexity(config: EngineConfig, text: str, prefix: int = PREFIX, chunks: int = CHUNKS, loaded=None,
               context: int = CONTEXT, make_backend=None) -> dict:
    """make_backend(spec) -> AttentionBackend replaces config's backend (bench/bench_int4_grouping.py)."""
    return _perplexity(config, text, prefix, chunks, loaded, context, make_backend)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed -log p(target) over the rows, a 0-d tensor on the logits' device.
    logits [B, V] on any device; targets [B] int64 (moved to the logits' device)."""
    return -logits.float().log_softmax(-1).gather(1, targets.to(logits.device)[:, None]).sum()


def _perplexity(config: EngineConfig, text: str, prefix: int, chunks: int, loaded, context: int,
                make_backend) -> dict:
    loaded = loaded or load_model(config.model, config.dtype, config.torch_device, config.max_model_len,
                                  chunks)
    a = loaded.args
    ids = loaded.tokenizer(text)["input_ids"]
    length = min(context, len(ids) // chunks, loaded.max_model_len)
    if length <= prefix + 1:
        raise ValueError(f"text too short: {len(ids)} tokens for {chunks} chunks with prefix {prefix}")
    rows = [ids[i * length:(i + 1) * length] for i in range(chunks)]
    spec = KVSpec(a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim)
    backend = make_backend(spec) if make_backend else create_backend(config, spec)
    runner = ModelRunner(loaded.model, backend, config.torch_device, config.num_minibatches)
    seq_ids = list(range(1, chunks + 1))
    targets = torch.tensor(rows)                          # [chunks, length], CPU: token_nll moves each column
    nll, count = 0.0, 0
    store = getattr(backend, "store", None)                # the local backend's kernel store
    groups = list(store.groups) if config.kv_format == "int4" and hasattr(store, "groups") else None
    try:
        backend.open(seq_ids)
        with torch.inference_mode():
            logits, lost = runner.prefill(seq_ids, [r[:prefix] for r in rows])
            assert not lost
            for t in range(prefix, length):
                nll = nll + token_nll(logits, targets[:, t])      # stays on the device: no sync per step
                count += chunks
                if t + 1 == length:
                    break
                res = runner.decode(seq_ids, [r[t] for r in rows], [t] * chunks)
                assert not res.lost and res.rows == list(range(chunks))
                logits = res.logits
    finally:
        backend.close(seq_ids)
        backend.shutdown()
    return {"perplexity": math.exp(float(nll) / count), "tokens_scored": count, "text_tokens": len(ids),
            "context": length, "chunks": chunks, "prefix": prefix,
            "attention": config.attention, "dtype": loaded.dtype.dtype,
            "kv_format": "fp32" if config.attention == "torch" else config.kv_format,   # torch keeps KV as computed
            "int4_fp16_tail": config.kv_format == "int4" and config.kv_int4_fp16_tail,
            "int4_groups": groups}                          # [key, value] channels per scale and zero


def compare(model: str, text: str, text_name: str, context: int = CONTEXT, chunks: int = CHUNKS,
            prefix: int = PREFIX, dtype: str = "float32") -> dict:
    """fp32 KV (the torch reference), fp16 and int4 KV (the local kernel) on the same chunks."""
    base = EngineConfig(model=model, attention="local", dtype=dtype)
    loaded = load_model(base.model, base.dtype, base.torch_device, base.max_model_len)
    runs = {"fp32_kv_torch": base.replace(attention="torch"), "fp16_kv": base.replace(kv_format="fp16"),
            "int4_kv": base.replace(kv_format="int4"),
            "int4_kv_no_fp16_tail": base.replace(kv_format="int4", kv_int4_fp16_tail=False)}
    out = {"text": text_name, "model": Path(model).name}
    for key, config in runs.items():
        out[key] = perplexity(config, text, prefix, chunks, loaded, context)
    out["context"] = out["fp16_kv"]["context"]
    out["int4_over_fp16"] = out["int4_kv"]["perplexity"] / out["fp16_kv"]["perplexity"]
    out["int4_no_fp16_tail_over_fp16"] = out["int4_kv_no_fp16_tail"]["perplexity"] / out["fp16_kv"]["perplexity"]
    return out


def write_results(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--text", default="", help="a UTF-8 text file (default: the built-in text, see above)")
    p.add_argument("--attention", default="local", choices=("local", "torch", "remote"))
    p.add_argument("--kv-format", default="fp16", choices=("fp16", "int4"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=CONTEXT, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=CHUNKS)
    p.add_argument("--prefix", type=int, default=PREFIX, help="prefilled tokens per chunk")
    p.add_argument("--compare", action="store_true",
                   help="fp32 KV (torch), fp16 and int4 KV (local); written to --out")
    p.add_argument("--out", default=str(RESULTS), help="where --compare writes its JSON")
    a = p.parse_args(argv)
    if a.text:
        name = Path(a.text).name
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    else:
        name, text = default_text()
    if a.compare:
        result = compare(a.model, text, name, a.context, a.chunks, a.prefix, a.dtype)
        print(json.dumps(result, indent=2))
        print(f"wrote {write_results(result, a.out)}", file=sys.stderr)
        return 0
    config = EngineConfig(model=a.model, attention=a.attention, kv_format=a.kv_format, dtype=a.dtype)
    print(json.dumps(perplexity(config, text, a.prefix, a.chunks, context=a.context), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
