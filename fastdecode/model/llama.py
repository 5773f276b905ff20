"""The S-Part of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

Everything with weights lives here; attention does not. Each layer is cut in
two around attention so the engine can hand attention to a backend (and run
another mini-batch meanwhile):

    rope = model.rope_tables(positions, h.dtype)     # once a step, for every layer
    q, k, v = model.pre_attention(i, h, rope)        # norm -> fused qkv -> rope
    o = <attention backend or prefill SDPA>(q, k, v)
    h = model.post_attention(i, h, o)                 # o proj + residual, norm -> MLP + residual

Tensors are token-major: h [N, hidden], q [N, H, D], k/v [N, Hkv, D], o [N, H, D].
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from fastdecode.model.packed import PackedLinear

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, c) -> "ModelArgs":
        archs = getattr(c, "architectures", None) or []
        if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c.hidden_act!r} (SwiGLU needs silu)")
        qwen2 = c.model_type == "qwen2"
        heads = c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(getattr(c, "attention_bias", False)),
            o_bias=not qwen2 and bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
        )


def check_context(c, max_len: int) -> None:
    """Refuse a config this S-Part would run wrongly at a context of max_len tokens.

    Attention here is always full causal (prefill SDPA and the backends alike), so a
    sliding window (Mistral; Qwen2 with use_sliding_window) shorter than the context
    would silently be ignored. A window of at least max_len tokens changes nothing."""
    window = getattr(c, "sliding_window", None)
    if window is None:
        return
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return                              # e.g. Qwen2 whose window covers no layer
    if window < max_len:
        raise ValueError(f"config sets sliding_window={window}, smaller than the context limit of {max_len} "
                         f"tokens (max_model_len, or the checkpoint's max_position_embeddings); fastdecode "
                         f"has no sliding-window attention: set max_model_len <= {window}")


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.qkv_proj = nn.Linear(a.hidden_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size, a.mlp_bias)
        self.ops = None                 # fused CPU ops (model/fused.py), set by fuse_layers

    def pre_attention(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        n, d, qk_heads = h.shape[0], self.head_dim, self.num_heads + self.num_kv_heads
        norm = self.input_layernorm
        x = norm(h) if self.ops is None else self.ops.rms_norm(h, norm.weight, norm.eps)
        qkv = self.qkv_proj(x).view(n, qk_heads + self.num_kv_heads, d)
        if self.ops is None:
            qk = apply_rope(qkv[:, :qk_heads], *rope)          # q and k rotated together
        else:
            qk = qkv[:, :qk_heads]
            self.ops.rope_(qk, rope[0][:, 0], rope[1][:, 0])
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, qk_heads:]

    def post_attention(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """h + attention's output projection, then + MLP. The fused path updates h in place."""
        d = self.o_proj(o.reshape(h.shape[0], -1).to(h.dtype))
        if self.ops is None:
            h = h + d
            return h + self.mlp(self.post_attention_layernorm(h))
        norm = self.post_attention_layernorm
        x = self.ops.add_rms_norm(h, d, norm.weight, norm.eps)
        gate_up = self.mlp.gate_up_proj
        a = gate_up.silu_mul(x) if isinstance(gate_up, PackedLinear) else self.ops.silu_mul(gate_up(x))
        return h.add_(self.mlp.down_proj(a))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, hf_config, max_len: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(hf_config, args.head_dim, max_len)
        self.scale = args.head_dim ** -0.5
        self.ops = None                 # fused CPU ops (model/fused.py), set by fuse_layers

    # -- the pieces the engine drives -------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.tables(positions, dtype)

    def pre_attention(self, layer: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """rope = rope_tables(positions, h.dtype) -> q [N, H, D], k, v [N, Hkv, D] (views of one buffer)."""
        return self.layers[layer].pre_attention(h, rope)

    def post_attention(self, layer: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].post_attention(h, o)

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head: logits [N, vocab] in the model's dtype (the sampler upcasts
        only the rows it samples from; a greedy argmax needs no float32 copy), into `out` when
        given."""
        x = self.norm(h) if self.ops is None else self.ops.rms_norm(h, self.norm.weight, self.norm.eps)
        if out is None:
            return self.lm_head(x)
        if isinstance(self.lm_head, PackedLinear):
            return self.lm_head(x, out=out)
        return torch.matmul(x, self.lm_head.weight.t(), out=out)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Causal attention of each prompt over itself (sequences back to back) -> o [N, H, D]."""
        out = torch.empty_like(q)
        starts = list(itertools.accumulate(lens, initial=0))
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            by_len.setdefault(n, []).append(i)
        for n, members in by_len.items():          # the prompts of one length, wherever they are: one call
            g = len(members)
            if members[-1] - members[0] == g - 1:  # back to back: a view
                rows: slice | torch.Tensor = slice(starts[members[0]], starts[members[0]] + g * n)
            else:
                rows = (torch.tensor([starts[i] for i in members])[:, None] + torch.arange(n)).view(-1).to(q.device)

            def heads_first(x: torch.Tensor) -> torch.Tensor:   # [g*n, heads, D] -> [g, heads, n, D]
                return x[rows].view(g, n, x.shape[1], x.shape[2]).transpose(1, 2)
            o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                               is_causal=True, scale=self.scale, enable_gqa=True)
            out[rows] = o.transpose(1, 2).reshape(g * n, q.shape[1], q.shape[2])
        return out

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Whole-prompt forward without any KV-cache (tests, perplexity): logits [N, vocab]."""
        h = self.embed(token_ids)
        rope = self.rope_tables(positions, h.dtype)
        for i in range(self.args.num_layers):
            q, k, v = self.pre_attention(i, h, rope)
            h = self.post_attention(i, h, self.prefill_attention(q, k, v, lens))
        return self.logits(h).float()
