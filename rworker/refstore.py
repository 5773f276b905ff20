"""A plain-numpy KV store with the rpart.kernels.KVStore contract.

Used by the R-worker only when the compiled kernel is missing (`--store numpy`
or a build without csrc/). Slow; fp16 storage like the kernel.
"""
from __future__ import annotations

import numpy as np

from rpart.errors import KVCapacityError


class NumpyKVStore:
    isa = "numpy"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_bytes: int,
                 block_size: int = 16, kv_format: str = "fp16", num_threads: int = 0, isa: str = "auto") -> None:
        if kv_format != "fp16":
            raise ValueError(f"NumpyKVStore supports kv_format 'fp16' only, got {kv_format!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.block_bytes = 2 * num_layers * num_kv_heads * head_dim * 2 * block_size
        self.blocks_total = capacity_bytes // self.block_bytes
        self.k: dict[int, list[np.ndarray]] = {}
        self.v: dict[int, list[np.ndarray]] = {}

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _blocks_used(self) -> int:
        return sum(self._blocks(max(x.shape[0] for x in ks)) for ks in self.k.values())

    def create(self, seq_ids) -> None:
        ids = [int(s) for s in seq_ids]
        dup = [s for s in ids if s in self.k]
        if dup or len(set(ids)) != len(ids):
            raise ValueError(f"sequence id(s) already exist: {dup[:8] or ids}")
        empty = np.zeros((0, self.num_kv_heads, self.head_dim), np.float16)
        for s in ids:
            self.k[s] = [empty] * self.num_layers
            self.v[s] = [empty] * self.num_layers

    def free(self, seq_ids) -> None:
        for s in seq_ids:
            self.k.pop(int(s), None)
            self.v.pop(int(s), None)

    def has(self, seq_id: int) -> bool:
        return int(seq_id) in self.k

    def length(self, seq_id: int, layer: int = 0) -> int:
        return self._get(seq_id)[layer].shape[0]

    def _get(self, s):
        if int(s) not in self.k:
            raise KeyError(f"unknown sequence id {int(s)}")
        return self.k[int(s)]

    def _check(self, layer, x, rows) -> np.ndarray:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range")
        x = np.asarray(x)
        if x.shape != (rows, self.num_kv_heads, self.head_dim):
            raise ValueError(f"k/v shape {x.shape}, expected {(rows, self.num_kv_heads, self.head_dim)}")
        if not np.isfinite(x).all():
            raise ValueError("k/v contain NaN or Inf")
        return x.astype(np.float16)

    def append_span(self, layer, seq_ids, lens, k, v) -> None:
        lens = [int(n) for n in lens]
        k, v = self._check(layer, k, sum(lens)), self._check(layer, v, sum(lens))
        for s in seq_ids:
            self._get(s)
        grow = sum(self._blocks(self.k[int(s)][layer].shape[0] + n) - self._blocks(self.k[int(s)][layer].shape[0])
                   for s, n in zip(seq_ids, lens) if layer == 0)
        if self._blocks_used() + grow > self.blocks_total:
            raise KVCapacityError("KV pool exhausted")
        a = 0
        for s, n in zip(seq_ids, lens):
            s = int(s)
            self.k[s][layer] = np.concatenate([self.k[s][layer], k[a:a + n]])
            self.v[s][layer] = np.concatenate([self.v[s][layer], v[a:a + n]])
            a += n

    def append(self, layer, seq_ids, k, v) -> None:
        self.append_span(layer, seq_ids, [1] * len(seq_ids), k, v)

    def attend(self, layer, seq_ids, q) -> np.ndarray:
        q = np.asarray(q, np.float32)
        out = np.empty(q.shape, np.float32)
        group = q.shape[1] // self.num_kv_heads
        for i, s in enumerate(seq_ids):
            kk = np.repeat(self._get(s)[layer].astype(np.float32), group, axis=1)  # [T, H, D]
            vv = np.repeat(self.v[int(s)][layer].astype(np.float32), group, axis=1)
            scores = np.einsum("hd,thd->ht", q[i], kk) / np.sqrt(self.head_dim)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[i] = np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), vv)
        return out

    def decode(self, layer, seq_ids, q, k, v) -> np.ndarray:
        self.append(layer, seq_ids, k, v)
        return self.attend(layer, seq_ids, q)

    def stats(self) -> dict:
        used = self._blocks_used()
        tokens = sum(ks[0].shape[0] for ks in self.k.values())
        return {"sequences": len(self.k), "kv_tokens": tokens, "blocks_used": used,
                "blocks_total": self.blocks_total, "bytes_used": used * self.block_bytes,
                "capacity_bytes": self.blocks_total * self.block_bytes}
