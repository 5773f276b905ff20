"""Decode throughput of the engine on synthetic prompts (CLI `bench`, bench/bench_engine.py)."""
from __future__ import annotations

import statistics
import time

from fastdecode.config import EngineConfig


def synthetic_prompts(tokenizer, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `prompt_len` token ids cut from a fixed English text."""
    text = ("The history of science is the study of the development of science and scientific knowledge, "
            "including both the natural and social sciences. Science is a body of empirical, theoretical, "
            "and practical knowledge about the natural world, produced by scientists who emphasize the "
            "observation, explanation, and prediction of real-world phenomena. ") * 8
    ids = tokenizer(text)["input_ids"]
    return [ids[(seed + 7 * i) % 64:][:prompt_len] for i in range(batch)]


def run_throughput(config: EngineConfig, batch: int, new_tokens: int, prompt_len: int, engine=None) -> dict:
    from fastdecode.engine import Engine, SamplingParams

    engine = engine or Engine(config)
    prompts = synthetic_prompts(engine.tokenizer, batch, prompt_len)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first_step = len(engine.trace) and engine.trace[-1]["step"] + 1
    for p in prompts:
        engine.add_request(p, params)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.token_ids) for o in engine.step())
    total = time.perf_counter() - start
    steps = [r for r in engine.trace if r["step"] >= first_step]
    decode = [r for r in steps if r["num_prefill"] == 0]
    decode_time = sum(r["step_time"] for r in decode)
    decode_tokens = sum(r["batch_size"] for r in decode)
    return {"batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len, "dtype": engine.dtype,
            "attention": config.attention, "kv_format": config.kv_format, "generated_tokens": generated,
            "total_s": total, "tokens_per_s": generated / total,
            "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
            "median_step_s": statistics.median(r["step_time"] for r in decode) if decode else 0.0,
            "steps": len(steps)}
