"""Building blocks of the S-Part: RMSNorm, rotary embedding, SwiGLU MLP.

Each computes exactly what transformers' Llama computes (same op order, same
float32 upcasts), so our logits match the reference to float rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, built once (float32).

    inv_freq comes from transformers' ROPE_INIT_FUNCTIONS (default, llama3,
    linear, yarn, ...), so every rope_type the checkpoint names is exact."""

    def __init__(self, hf_config, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.head_dim = head_dim
        self.max_len = max_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device | str) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' changes with the sequence length: not supported")
        positions = torch.arange(self.max_len, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of `positions` as [N, 1, D] in `dtype`: built once a step, used by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated as transformers does: x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    GLU_LINEAR = "gate_up_proj"          # gate rows, then up rows: its product may fuse silu * up (packed.py)

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
