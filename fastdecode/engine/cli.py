"""`python -m fastdecode generate|bench`: the engine from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fastdecode.config import ATTENTION_BACKENDS, DTYPES, KV_FORMATS, EngineConfig, config_from_settings


# flag -> EngineConfig field; a flag not given leaves the setting to FASTDECODE_* or the default
FLAGS = {"model": "model", "attention": "attention", "rworkers": "rworkers", "dtype": "dtype",
         "kv_format": "kv_format", "device": "device", "minibatches": "num_minibatches"}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"local HF model directory (default {EngineConfig.model})")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS,
                   help=f"default {EngineConfig.attention}; remote when --rworkers is given")
    p.add_argument("--rworkers", help="comma-separated host:port of R-workers (attention=remote)")
    p.add_argument("--dtype", choices=DTYPES, help=f"default {EngineConfig.dtype}")
    p.add_argument("--kv-format", choices=KV_FORMATS, help=f"default {EngineConfig.kv_format}")
    p.add_argument("--device", help=f"default {EngineConfig.device}")
    p.add_argument("--minibatches", choices=("1", "2"), help=f"default {EngineConfig.num_minibatches}")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="any EngineConfig setting")


def _config(a: argparse.Namespace, **extra) -> EngineConfig:
    settings = {field: getattr(a, flag) for flag, field in FLAGS.items() if getattr(a, flag) is not None}
    for item in a.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param wants KEY=VALUE, got {item!r}")
        settings[key.strip()] = value
    try:
        return config_from_settings({**settings, **extra}, root=Path.cwd())
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode generate", description="stream a completion")
    p.add_argument("prompt")
    _engine_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    a = p.parse_args(argv)

    from fastdecode.engine import Engine, InvalidRequestError, SamplingParams

    engine = Engine(_config(a))
    try:
        params = SamplingParams.from_dict(dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                               top_k=a.top_k, seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos))
        prompt = a.prompt
        if a.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True, tokenize=False)
        last = None
        for out in engine.generate(prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            last = out
        sys.stdout.write("\n")
        print(f"[{last.finish_reason}: {last.num_prompt_tokens} prompt + {last.num_output_tokens} generated tokens"
              + (f"; {last.error}" if last.error else "") + "]", file=sys.stderr)
        return 0 if last.finish_reason != "error" else 1
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.stop()


def bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode bench", description="engine decode throughput")
    _engine_args(p)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    if a.batch < 1 or a.new_tokens < 1 or a.prompt_len < 1:
        p.error("--batch, --new-tokens and --prompt-len must be >= 1")

    from fastdecode.engine.throughput import run_throughput

    engine_config = _config(a, max_running=max(a.batch, 1), max_prefill_tokens=max(4096, a.prompt_len))
    result = run_throughput(engine_config, a.batch, a.new_tokens, a.prompt_len)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"batch {a.batch}, {a.new_tokens} new tokens: {result['decode_tokens_per_s']:.1f} tokens/s decode, "
              f"{result['tokens_per_s']:.1f} tokens/s overall, median step {1000 * result['median_step_s']:.1f} ms")
    return 0


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    return {"generate": generate, "bench": bench}[command](rest)
