"""CPU linear layers with their weights packed once for the library that multiplies them.

torch's `F.linear` on the CPU packs the weight into the GEMM library's own layout on every
call: oneDNN's blocked layout in bf16, MKL's panels in fp32 (cblas_sgemm). At a decode batch
that copy is a large part of the product (fp32, batch 8: about 45%). Packing once at load runs
the same library on the same packed weight: in bf16 oneDNN's products are bit-identical; in fp32
they equal F.linear's but for the summation order of long rows (1e-6 relative), and a row's
result does not depend on how many rows share the call once they are 12 or more, or a multiple
of 4 (MKL on a Zen 4 takes other kernels for 1-11 rows: 1 row as a matrix-vector product, three
times as fast as 4 rows; those agree to 1e-6). Applied to the model as a function,
like quantization in gpt-fast: the model code itself stays a plain Llama.

In fp32, pack_linears keeps only the packed copy of a weight no other module shares (a tied LM
head keeps the embedding's): the model then holds its weights once. Whoever reads such a weight
(`layer.weight`, `state_dict()`) gets it back from the packed copy, exactly: the product of the
identity with the packed weight, each element one product by 1 among exact zeros. bf16 layers
keep both: oneDNN's packed product has no `out`, and the LM head writes its logits into a kept
buffer through the plain weight (a fresh buffer at each step was faulted in page by page).
One bf16 row (a decode batch of one) goes to gemv_bf16 (csrc/spart/gemv_bf16.cpp) on that plain
weight where the CPU has AVX512-BF16: oneDNN's product streamed the weights at about half the
machine's bandwidth there.

Where the CPU has AVX512-BF16 but no AMX (Zen 4 and 5, Cooper Lake), bf16 layers
without a bias pack for gemm_bf16 (csrc/spart/gemm_bf16.cpp) instead of oneDNN: on the model's
short rows oneDNN's kernels ran at 80-90% of the dot-product peak, ours closer to it. With AMX,
oneDNN multiplies on the tile unit, far faster than any AVX-512 loop, and keeps the products.
`cpu_gemm` ("auto", "onednn", "avx512bf16") overrides the choice. A module names its gate-up
layer in `GLU_LINEAR` (layers.SwiGLU): packed for gemm_bf16, it also computes silu(gate) * up in
the product's own pass (PackedLinear.silu_mul), the same bits as fused_ops' silu_mul of its output.
"""
from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from fastdecode.model.fused import load_ops


def _ops():
    try:
        return load_ops()
    except RuntimeError:            # not built: the model keeps F.linear
        return None


def packing_supported(dtype: torch.dtype, device: str) -> bool:
    if device != "cpu":
        return False
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float32:
        ops = _ops()
        return ops is not None and ops.mkl_packing_available()
    return False


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


@functools.cache
def _cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_flags()


def own_gemm_wanted(ops, out_features: int, in_features: int, cpu_gemm: str = "auto") -> bool:
    """Whether a bf16 layer of this shape (no bias) multiplies with gemm_bf16 rather than oneDNN."""
    if cpu_gemm not in ("auto", "onednn", "avx512bf16"):
        raise ValueError(f"cpu_gemm must be auto, onednn or avx512bf16, got {cpu_gemm!r}")
    if cpu_gemm == "onednn" or ops is None or not ops.gemm_bf16_available():
        return False
    return ops.gemm_bf16_shape_supported(out_features, in_features) and (cpu_gemm == "avx512bf16"
                                                                         or not _cpu_has_amx())


class PackedLinear(nn.Module):
    """nn.Linear's forward on a packed weight. With keep_weight the layer also holds `weight`;
    without, `weight` and `state_dict()` unpack it when read."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64, keep_weight: bool = True,
                 cpu_gemm: str = "auto", glu: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.dtype = linear.weight.dtype
        w = linear.weight.detach()
        self._ops = None if self.dtype == torch.bfloat16 else load_ops()
        ops = _ops() if self.dtype == torch.bfloat16 else None
        self._gemv = ops.gemv_bf16 if ops is not None and ops.gemv_bf16_available() else None
        self._gemm = (ops.gemm_bf16 if self.bias is None and own_gemm_wanted(ops, *w.shape, cpu_gemm)
                      else None)
        # a gate-up layer (gate rows, then up rows) on gemm_bf16 also fuses silu_mul (silu_mul())
        self.glu = glu and self._gemm is not None
        self._gemm_silu_mul = ops.gemm_bf16_silu_mul if self.glu else None
        if self._gemm is not None:
            packed = ops.pack_gemm_bf16(w, self.glu)
        else:
            packed = (torch.ops.mkldnn._reorder_linear_weight(w, batch_hint) if self._ops is None
                      else self._ops.pack_linear_weight(w))
        self.register_buffer("packed", packed, persistent=False)
        if keep_weight:
            self._parameters["weight"] = linear.weight    # (register_parameter would read the property)

    @property
    def weight(self) -> torch.Tensor:
        kept = self._parameters.get("weight")
        return kept if kept is not None else self.unpacked_weight()

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        self._parameters["weight"] = value

    def unpacked_weight(self, rows: int = 1024) -> torch.Tensor:
        """The weight [out_features, in_features], computed from the packed copy `rows` input
        channels at a time (the identity's rows: a whole one would be in_features squared)."""
        k = self.in_features
        weight = torch.empty(self.out_features, k, dtype=self.dtype)
        for i in range(0, k, rows):
            n = min(rows, k - i)
            eye = torch.zeros(n, k, dtype=self.dtype)
            eye.diagonal(offset=i).fill_(1)
            weight[:, i:i + n] = self._packed_product(eye, None).t()
        return weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "weight" not in self._parameters:
            destination[prefix + "weight"] = self.unpacked_weight()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias, into `out` (rows x out_features, contiguous rows) when given."""
        if x.dtype != self.dtype or x.device.type != "cpu":
            y = F.linear(x, self.weight, self.bias)
            return y if out is None else out.copy_(y)
        if self.dtype == torch.bfloat16:
            kept = self._parameters.get("weight")
            if self._gemv is not None and out is None and self.bias is None and kept is not None \
                    and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and kept.is_contiguous():
                return self._gemv(x, kept)       # one row: the weights streamed once (gemv_bf16.cpp)
            if self._gemm is not None and x.dim() == 2 and x.stride(1) == 1:
                return self._gemm(x, self.packed, out, self.glu)
            if out is not None and self.bias is None and kept is not None:
                return torch.matmul(x, self.weight.t(), out=out)
            y = self._packed_product(x, self.bias)
            return y if out is None else out.copy_(y)
        rows = x.reshape(-1, self.in_features)
        y = self._ops.packed_linear(rows, self.packed, self.bias, out)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate-up layer's product (fused_ops' silu_mul of forward(x)), in
        the product's own pass where it was packed with glu."""
        if self._gemm_silu_mul is not None and x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.dtype \
                and x.device.type == "cpu":
            return self._gemm_silu_mul(x, self.packed)
        return load_ops().silu_mul(self(x))

    def _packed_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._gemm is not None:               # no bias: such layers keep oneDNN
            rows = x.reshape(-1, self.in_features).contiguous()
            return self._gemm(rows, self.packed, None, self.glu).view(*x.shape[:-1], self.out_features)
        if self.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return self._ops.packed_linear(x, self.packed, bias)


def pack_linears(model: nn.Module, cpu_gemm: str = "auto") -> int:
    """Replace every CPU nn.Linear of `model` whose dtype packs (bf16, fp32) by a PackedLinear; in
    fp32 it holds only the packed weight unless another module shares that weight. Returns how many."""
    uses = Counter(id(p) for module in model.modules() for p in module._parameters.values() if p is not None)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_supported(child.weight.dtype, child.weight.device.type):
                keep = child.weight.dtype == torch.bfloat16 or uses[id(child.weight)] > 1
                glu = getattr(parent, "GLU_LINEAR", None) == name
                setattr(parent, name, PackedLinear(child, keep_weight=keep, cpu_gemm=cpu_gemm, glu=glu))
                count += 1
    return count
