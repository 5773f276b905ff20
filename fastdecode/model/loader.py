"""Load a local Hugging Face checkpoint into our S-Part model.

transformers reads config.json and the tokenizer; the weights come straight
from the safetensors files. The model is built on the meta device and the
loaded tensors are assigned (no random init, no extra copy).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdecode.model.dtype_choice import DtypeChoice, choose_dtype
from fastdecode.model.llama import LlamaModel, ModelArgs, check_context
from fastdecode.model.fused import fuse_layers
from fastdecode.model.packed import pack_linears

# checkpoint name part -> (our fused parameter, shard index). Shards are
# concatenated along dim 0 in shard order.
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object
    hf_config: object
    args: ModelArgs
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: DtypeChoice


def map_name(name: str) -> tuple[str, int | None]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.qkv_proj.weight', 1)."""
    name = name.removeprefix("model.").replace(".self_attn.", ".")  # we keep no such levels
    for part, (fused, shard) in PACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def read_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    shards: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                ours, shard = map_name(name)
                t = st.get_tensor(name).to(dtype)
                if shard is None:
                    state[ours] = t
                else:
                    shards.setdefault(ours, {})[shard] = t
    for name, parts in shards.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    return state


def eos_ids(path: Path, hf_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    if gen.is_file():
        sources.insert(0, json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        for i in (src if isinstance(src, list) else [src]):
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu", max_model_len: int = 0,
               batch: int = 256, cpu_gemm: str = "auto") -> LoadedModel:
    """dtype "auto" is chosen for `device` by model/dtype_choice.py, at `batch` sequences decoding;
    cpu_gemm picks the bf16 products' kernel (model/packed.py)."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    if dtype not in DTYPES and dtype != "auto":
        raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {dtype!r}")
    hf_config = AutoConfig.from_pretrained(path)
    args = ModelArgs.from_hf(hf_config)
    choice = choose_dtype(dtype, device, args, batch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    max_len = max_model_len or args.max_position_embeddings
    check_context(hf_config, max_len)

    with torch.device("meta"):
        model = LlamaModel(args, hf_config, max_len)
    state = read_state_dict(path, DTYPES[choice.dtype])
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    ours = {k for k in model.state_dict() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(ours - state.keys()), sorted(state.keys() - ours)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope.build("cpu")
    model = model.to(device).eval()
    model.requires_grad_(False)
    pack_linears(model, cpu_gemm)
    fuse_layers(model)
    return LoadedModel(model, tokenizer, hf_config, args, max_len, eos_ids(path, hf_config, tokenizer), choice)
