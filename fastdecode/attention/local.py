"""In-process R-Part: the C++ KV store and kernel (rpart.kernels) behind
the AttentionBackend interface.

With the S-Part on a GPU, submit_decode hands the kernel call to one worker
thread and returns at once; the kernel releases the GIL, so the engine runs
the S-Part of the other mini-batch while this one attends. With the S-Part on
the CPU the two would only take cores from each other: the call runs in the
caller's thread between the S-Part's ops, on torch's own OpenMP threads
(`overlaps` False; see csrc/thread_pool.h).
"""
from __future__ import annotations

import operator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from fastdecode.attention.base import AttentionBackend, KVRoom, KVSpec
from rpart.kernels import KVStore

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_input(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as the kernel takes it: float32, float16 or bfloat16 (read as such, not widened). A view of a
    wider buffer (q, k and v of one projection) is read in place, row by row (rpart.kernels)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {x.device}")
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _ints(values: Sequence[int], name: str) -> list[int]:
    try:
        return [operator.index(x) for x in values]
    except TypeError:
        raise ValueError(f"{name} must be integers") from None


class LocalAttention(AttentionBackend):
    def __init__(self, spec: KVSpec, config) -> None:
        super().__init__(spec)
        self.overlaps = config.torch_device != "cpu"
        self.store = KVStore(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.kv_capacity_bytes,
                             block_size=config.kv_block_size, kv_format=config.kv_format,
                             num_threads=config.kernel_threads or (0 if self.overlaps else torch.get_num_threads()),
                             fp16_tail=config.kv_int4_fp16_tail, openmp=not self.overlaps,
                             populate=config.kv_populate,
                             **({"k_group": config.kv_int4_k_group, "v_group": config.kv_int4_v_group}
                                if config.kv_format == "int4" else {}))
        if config.kv_populate:
            self.store.wait_populated()     # startup, not the first steps, pays for committing the pool
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdecode-rpart") if self.overlaps else None
        self._open: set[int] = set()  # checked at submit without waiting for a running kernel call

    def open(self, seq_ids: Sequence[int]) -> None:
        ids = _ints(seq_ids, "seq_ids")
        self.store.create(ids)
        self._open.update(ids)

    def close(self, seq_ids: Sequence[int]) -> None:
        ids = _ints(seq_ids, "seq_ids")
        self.store.free(ids)
        self._open.difference_update(ids)

    def prefill(self, layer: int, seq_ids: Sequence[int], lens: Sequence[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
        self.store.append_span(layer, _ints(seq_ids, "seq_ids"), _ints(lens, "lens"),
                               _kernel_input(k, "k"), _kernel_input(v, "v"))

    def submit_decode(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> "Future[torch.Tensor]":
        q, k, v = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v")
        if self._worker is not None:
            ids = _ints(seq_ids, "seq_ids")
            self._check_decode(layer, ids, q, k)
            self._check_ids(ids)
            return self._worker.submit(self._decode, layer, ids, q, k, v)
        # Here and now: the store checks the ids itself (unknown, repeated, not integers) before it
        # changes anything, so they are not checked twice (at batch 512, 30 layers a step, that took
        # about 3% of the step); whatever it refuses raises here, in the caller's thread.
        if not isinstance(seq_ids, (list, tuple)):
            seq_ids = _ints(seq_ids, "seq_ids")
        self._check_decode(layer, seq_ids, q, k)
        future: Future[torch.Tensor] = Future()
        future.set_result(self._decode(layer, seq_ids, q, k, v))
        return future

    def _decode(self, layer: int, ids: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """o [B, H, D], in bfloat16 where q is (the kernel rounds it as torch would), else float32."""
        if q.dtype == torch.bfloat16:
            o = self.store.decode(layer, ids, q, k, v, scale=self.spec.scale, bf16_out=True)
            return torch.from_numpy(o).view(torch.bfloat16)
        return torch.from_numpy(self.store.decode(layer, ids, q, k, v, scale=self.spec.scale))

    def _check_decode(self, layer: int, ids: list[int], q: torch.Tensor, k: torch.Tensor) -> None:
        """The cheap checks, done at submit so bad input fails in the caller's thread.
        The kernel repeats them (and checks capacity and NaN) when it runs."""
        s = self.spec
        if not 0 <= layer < s.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {s.num_layers})")
        if q.dim() != 3 or q.shape[0] != len(ids) or q.shape[1] != s.num_heads or q.shape[2] != s.head_dim:
            raise ValueError(f"q must be [{len(ids)}, {s.num_heads}, {s.head_dim}], got {list(q.shape)}")
        if k.dim() != 3 or tuple(k.shape) != (len(ids), s.num_kv_heads, s.head_dim):
            raise ValueError(f"k, v must be [{len(ids)}, {s.num_kv_heads}, {s.head_dim}], got {list(k.shape)}")

    def _check_ids(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate sequence ids in one call")
        missing = [i for i in ids if i not in self._open]
        if missing:
            raise KeyError(f"unknown sequence id(s) {missing[:8]}")

    def kv_room(self) -> KVRoom:
        st, layers = self.store.stats(), self.spec.num_layers     # a page: one block of every layer
        return KVRoom(self.store.block_size, (st["blocks_total"] - st["blocks_used"]) // layers,
                      st["blocks_total"] // layers)

    def stats(self) -> dict:
        st = self.store.stats()
        return {"sequences": st["sequences"], "kv_tokens": st["kv_tokens"], "kv_bytes": st["bytes_used"],
                "capacity_bytes": st["capacity_bytes"], "blocks_used": st["blocks_used"],
                "blocks_total": st["blocks_total"], "kv_format": self.store.kv_format, "isa": self.store.isa,
                "threads": self.store.num_threads, "openmp": self.store.openmp}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.store.close()
