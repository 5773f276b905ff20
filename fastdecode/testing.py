"""Tiny random-init Llama-family checkpoints for tests: no download, built in seconds."""
from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "FastDecode splits the model into an S-Part on the GPU and an R-Part on CPUs.",
    "Hello, world! Привет, мир! 你好，世界！ ¿Qué tal? 🙂",
    "def f(x):\n    return x * 2  # numbers 0123456789",
] * 8


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (any UTF-8 text round-trips) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_llama(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 128, tie_word_embeddings: bool = False,
                    rope_scaling: dict | None = None, attention_bias: bool = False, max_position_embeddings: int = 512,
                    seed: int = 0, arch: str = "llama") -> Path:
    """Save a random-init model + tokenizer as a local HF directory and return its path.

    arch="llama" builds LlamaForCausalLM (rope_scaling e.g. {"rope_type": "llama3", ...});
    arch="qwen2" builds Qwen2ForCausalLM (q/k/v bias)."""
    import torch
    import transformers

    path = Path(path)
    tokenizer = make_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5)
    if arch == "llama":
        config = transformers.LlamaConfig(attention_bias=attention_bias, **common)
        if rope_scaling is not None:
            config.rope_scaling = rope_scaling
            config.rope_parameters = {**rope_scaling, "rope_theta": 10000.0}
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # random init with std 0.02 gives near-uniform logits: widen it so greedy is decisive
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
