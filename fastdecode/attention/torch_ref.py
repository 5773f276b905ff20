"""Plain-torch attention backend: the reference the kernel backends are tested against.

Keeps each sequence's K and V per layer as growing fp32 tensors. Slow (it
concatenates), simple, and synchronous (its futures are already done).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import torch

from fastdecode.attention.base import AttentionBackend, KVSpec


def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], k/v [T, Hkv, D] -> o [H, D], in the dtype of q; GQA by repeating kv heads."""
    group = q.shape[0] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, T, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,htd->ht", q, kk) * scale
    return torch.einsum("ht,htd->hd", scores.softmax(dim=-1), vv)


class TorchAttention(AttentionBackend):
    def __init__(self, spec: KVSpec, config=None) -> None:
        super().__init__(spec)
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.spec.num_kv_heads, self.spec.head_dim)

    def open(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            if s in self.k:
                raise ValueError(f"sequence {s} is already open")
        for s in seq_ids:
            self.k[s] = [self._empty() for _ in range(self.spec.num_layers)]
            self.v[s] = [self._empty() for _ in range(self.spec.num_layers)]

    def close(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self.k.pop(s, None)
            self.v.pop(s, None)

    def _check(self, seq_ids: Sequence[int]) -> None:
        missing = [s for s in seq_ids if s not in self.k]
        if missing:
            raise KeyError(f"unknown sequence id(s) {missing[:8]}")

    def _check_shape(self, name: str, t: torch.Tensor, rows: int, heads: int) -> None:
        want = (rows, heads, self.spec.head_dim)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")

    def prefill(self, layer, seq_ids, lens, k, v) -> None:
        self._check(seq_ids)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        if len(lens) != len(seq_ids) or min(lens, default=1) < 1:
            raise ValueError(f"prefill: need one positive length per sequence, got {list(lens)}")
        self._check_shape("prefill k", k, offsets[-1], self.spec.num_kv_heads)
        self._check_shape("prefill v", v, offsets[-1], self.spec.num_kv_heads)
        for i, s in enumerate(seq_ids):
            a, b = offsets[i], offsets[i + 1]
            self.k[s][layer] = torch.cat([self.k[s][layer], k[a:b].float()])
            self.v[s][layer] = torch.cat([self.v[s][layer], v[a:b].float()])

    def submit_decode(self, layer, seq_ids, q, k, v) -> Future:
        self._check(seq_ids)
        self._check_shape("q", q, len(seq_ids), self.spec.num_heads)
        self._check_shape("k", k, len(seq_ids), self.spec.num_kv_heads)
        self._check_shape("v", v, len(seq_ids), self.spec.num_kv_heads)
        out = torch.empty(q.shape, dtype=torch.float32)
        for i, s in enumerate(seq_ids):
            self.k[s][layer] = torch.cat([self.k[s][layer], k[i : i + 1].float()])
            self.v[s][layer] = torch.cat([self.v[s][layer], v[i : i + 1].float()])
            out[i] = reference_decode_attention(q[i].float(), self.k[s][layer], self.v[s][layer], self.spec.scale)
        fut: Future = Future()
        fut.set_result(out)
        return fut

    def stats(self) -> dict:
        tokens = sum(t[0].shape[0] for t in self.k.values())
        per_token = 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * 4
        return {"sequences": len(self.k), "kv_tokens": tokens, "kv_bytes": tokens * per_token,
                "capacity_bytes": 0}
