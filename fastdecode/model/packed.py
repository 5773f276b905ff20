"""bf16 linear layers on the CPU with their weights packed once for oneDNN.

torch's bf16 `F.linear` on the CPU calls oneDNN, which reorders the weight into its
blocked layout on every call. Packing once at load time runs the same oneDNN matmul on
the same blocked weight, so the products are bit-identical; only the per-call reorder
goes (about a quarter of a small batch's step on a 2-core AVX512-BF16 machine).
Applied to the model as a function, like quantization in gpt-fast: the model code
itself stays a plain Llama.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packing_supported(dtype: torch.dtype, device: str) -> bool:
    return (device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight packed by oneDNN; `weight` stays for state_dict readers."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear of `model` by a PackedLinear; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_supported(child.weight.dtype, child.weight.device.type):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
