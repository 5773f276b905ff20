"""Decode throughput: our engine (S-Part + local R-Part kernel) vs transformers generate().

    make bench-engine            # batch 32, 128, 512; 256 new tokens; default model
    python bench/bench_engine.py --batches 8 --new-tokens 16 --out /tmp/x.json   # a quick look

Both sides get the same prompts (token ids of equal length, so transformers needs
no padding) and generate exactly --new-tokens tokens each, greedy. Each side runs
at the dtype and torch thread count that a short probe finds fastest on this CPU.
Throughput = generated tokens / decode time (prefill excluded on both sides;
end-to-end numbers are in the JSON too).

transformers at large batch is slow; above --hf-full-max-batch (512: every default
batch runs in full, ~14 minutes in all here) its decode time is estimated from
per-step times measured at the start, middle and end context lengths of the run
(Simpson's rule over the 256 steps), and the JSON says so.
Each of those measurements is generate() resuming from a DynamicCache already
holding that many (zero) tokens, so no long prefill is paid to reach a context.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fastdecode.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from fastdecode.engine.throughput import run_throughput, synthetic_prompts  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_bytes(model_dir: str, batch: int, context: int) -> int:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2      # fp16
    return int(1.25 * batch * (context + 32) * per_token) + (64 << 20)


class HF:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.models: dict[str, object] = {}
        self._cls = AutoModelForCausalLM

    def model(self, dtype: str):
        if dtype not in self.models:
            self.models[dtype] = self._cls.from_pretrained(self.model_dir, dtype=DTYPES[dtype]).eval()
        return self.models[dtype]

    def generate_time(self, dtype: str, ids: torch.Tensor, new_tokens: int) -> float:
        model = self.model(dtype)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=self.tokenizer.eos_token_id)
            elapsed = time.perf_counter() - t
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens)
        return elapsed

    def step_time(self, dtype: str, batch: int, context: int, steps: int) -> float:
        """Seconds per decode step at this context length: generate() resuming from a
        cache of `context` tokens, (t(1 + steps) - t(1)) / steps."""
        from transformers import DynamicCache

        model = self.model(dtype)
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        ids = torch.tensor(synthetic_prompts(self.tokenizer, batch, context + 1))
        assert ids.shape == (batch, context + 1)

        def timed(new_tokens: int) -> float:
            cache = DynamicCache(config=c)
            for layer in range(c.num_hidden_layers):
                z = torch.zeros(batch, c.num_key_value_heads, context, head_dim, dtype=DTYPES[dtype])
                cache.update(z, z.clone(), layer)
            with torch.inference_mode():
                t = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=self.tokenizer.eos_token_id)
                elapsed = time.perf_counter() - t
            assert out.shape == (batch, context + 1 + new_tokens)
            del cache
            gc.collect()
            return elapsed

        timed(1)                                  # warm up at this shape
        return max(1e-9, timed(1 + steps) - timed(1)) / steps

    def run(self, dtype: str, batch: int, new_tokens: int, prompt_len: int, full: bool, probe_steps: int) -> dict:
        if full:
            ids = torch.tensor(synthetic_prompts(self.tokenizer, batch, prompt_len))
            prefill = self.generate_time(dtype, ids, 1)
            gc.collect()
            total = self.generate_time(dtype, ids, new_tokens)
            decode = max(1e-9, total - prefill)
            return {"method": "full generate(); decode time = t(new_tokens) - t(1 token)", "total_s": total,
                    "decode_s": decode, "tokens_per_s": batch * new_tokens / total,
                    "decode_tokens_per_s": batch * (new_tokens - 1) / decode}
        points = [prompt_len, prompt_len + new_tokens // 2, prompt_len + new_tokens - probe_steps]
        per_step = [self.step_time(dtype, batch, c, probe_steps) for c in points]
        gc.collect()
        decode = (new_tokens - 1) * (per_step[0] + 4 * per_step[1] + per_step[2]) / 6
        return {"method": f"estimated: per-step time of {probe_steps} decode steps measured at contexts {points}, "
                          f"integrated over {new_tokens - 1} steps (Simpson)",
                "per_step_s": dict(zip(map(str, points), per_step)), "decode_s": decode,
                "decode_tokens_per_s": batch * (new_tokens - 1) / decode}


def ours(model_dir: str, dtype: str, threads: int, batch: int, new_tokens: int, prompt_len: int) -> dict:
    torch.set_num_threads(threads)
    cores = os.cpu_count() or 1
    config = EngineConfig(model=model_dir, attention="local", dtype=dtype, max_running=batch,
                          max_prefill_tokens=batch * prompt_len, kernel_threads=max(1, cores - threads) if threads < cores else cores,
                          kv_capacity_bytes=kv_bytes(model_dir, batch, prompt_len + new_tokens))
    result = run_throughput(config, batch, new_tokens, prompt_len)
    gc.collect()
    return result


def probe(model_dir: str, hf: HF, prompt_len: int) -> dict:
    """Fastest (dtype, torch threads) for each side: decode tokens/s at batch 32, 8 new tokens."""
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    res = {"ours": {}, "hf": {}}
    for dtype in DTYPES:
        for t in threads:
            res["ours"][f"{dtype}/{t}"] = ours(model_dir, dtype, t, 32, 8, prompt_len)["decode_tokens_per_s"]
            torch.set_num_threads(t)
            res["hf"][f"{dtype}/{t}"] = hf.run(dtype, 32, 8, prompt_len, True, 0)["decode_tokens_per_s"]
            print(f"probe {dtype} threads {t}: ours {res['ours'][f'{dtype}/{t}']:.1f} tok/s, "
                  f"transformers {res['hf'][f'{dtype}/{t}']:.1f} tok/s", flush=True)
    best = {side: max(v, key=v.get) for side, v in res.items()}
    return {"decode_tokens_per_s": res, "chosen": {s: {"dtype": b.split("/")[0], "threads": int(b.split("/")[1])}
                                                   for s, b in best.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--batches", default="32,128,512")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--hf-full-max-batch", type=int, default=512,
                   help="above this batch, transformers' decode time is estimated from probes")
    p.add_argument("--hf-probe-steps", type=int, default=8)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "engine.json"))
    p.add_argument("--merge", action="store_true",
                   help="add these batches to the existing --out file, reusing its dtype/thread choice")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    if not (Path(a.model) / "config.json").is_file():
        print(f"error: no model in {a.model}; run `make model`", file=sys.stderr)
        return 1

    hf = HF(a.model)
    out = Path(a.out)
    if a.merge and out.is_file():
        result = json.loads(out.read_text())
        choice = result["probe"]
    else:
        choice = probe(a.model, hf, a.prompt_len)
        result = {"model": Path(a.model).name, "new_tokens": a.new_tokens, "prompt_len": a.prompt_len,
                  "cpu_count": os.cpu_count(), "probe": choice, "runs": {}}
    o, h = choice["chosen"]["ours"], choice["chosen"]["hf"]
    print(f"chosen: ours {o}, transformers {h}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    for b in batches:
        mine = ours(a.model, o["dtype"], o["threads"], b, a.new_tokens, a.prompt_len)
        torch.set_num_threads(h["threads"])
        theirs = hf.run(h["dtype"], b, a.new_tokens, a.prompt_len, b <= a.hf_full_max_batch, a.hf_probe_steps)
        speedup = mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        result["runs"][str(b)] = {"ours": mine, "transformers": theirs, "speedup": speedup}
        result[f"speedup_vs_hf_b{b}"] = speedup
        print(f"batch {b}: ours {mine['decode_tokens_per_s']:.1f} tok/s ({o['dtype']}), transformers "
              f"{theirs['decode_tokens_per_s']:.1f} tok/s ({h['dtype']}, {theirs['method'].split(';')[0]}): "
              f"speedup {speedup:.2f}x", flush=True)
        out.write_text(json.dumps(result, indent=2) + "\n")     # partial results survive a long run
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
