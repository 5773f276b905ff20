"""Fused ops for the S-Part on the CPU (csrc/spart/fused_ops.cpp -> fastdecode._spart_ops).

Where the model runs on the CPU (bf16 or fp32), each decoder layer runs 4 fused ops instead of
about 25 small torch ops: at a batch of 128 a step spends more time issuing and looping over
those than in the attention kernel. The torch code each one replaces is the reference, beside it:

    rms_norm(x, w, eps)          RMSNorm(x)                            (layers.py)
    add_rms_norm(h, d, w, eps)   h = h + d; RMSNorm(h)    (h updated in place)
    rope_(qk, cos, sin)          qk = apply_rope(qk, cos, sin)         (in place)
    silu_mul(gate_up)            F.silu(gate) * up
    argmax_rows(logits)          logits.max(-1).indices
    sample_rows(logits, ...)     multinomial draw from softmax(logits / T)  (engine/sampling.py)

In bf16 they round to bf16 where torch does, so in either dtype they agree with it but for
float32 summation order (tests/test_fused_ops.py). Applied to a model as a function, like
pack_linears.
"""
from __future__ import annotations

import torch
from torch import nn


def fused_supported(dtype: torch.dtype, device: str) -> bool:
    return device == "cpu" and dtype in (torch.bfloat16, torch.float32)


_ops = None


def load_ops():
    global _ops
    if _ops is None:
        try:
            from fastdecode import _spart_ops
        except ImportError as e:
            raise RuntimeError(f"the S-Part's fused CPU ops are not built ({e}); run `make build`") from None
        _ops = _spart_ops
    return _ops


def fuse_layers(model: nn.Module) -> bool:
    """Give every decoder layer of a bf16 or fp32 CPU model the fused ops; True when it did."""
    weight = model.embed_tokens.weight
    if not fused_supported(weight.dtype, weight.device.type):
        return False
    ops = load_ops()
    model.ops = ops
    for layer in model.layers:
        layer.ops = ops
    return True


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum (torch.max's choice), fused for bf16 and fp32 CPU logits."""
    if fused_supported(logits.dtype, logits.device.type) and logits.dim() == 2 and logits.stride(1) == 1 \
            and logits.shape[1] > 0:
        return (_ops or load_ops()).argmax_rows(logits)
    return logits.max(dim=-1).indices


def can_sample(logits: torch.Tensor) -> bool:
    return fused_supported(logits.dtype, logits.device.type) and logits.dim() == 2 and logits.stride(1) == 1


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token of each of `rows` drawn from softmax(logits[row] / T) by inverting its cumulative sum at u."""
    return (_ops or load_ops()).sample_rows(logits, rows, temperatures, u)
