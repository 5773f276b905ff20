"""Tensors as they travel to R-workers, and calls split into messages of bounded size.

k, v travel as fp16 when the store keeps fp16 (so this loses nothing); q and o travel in
q's dtype (fp32, fp16 or bf16 bits; o is rounded on the worker to that dtype, which the
S-Part casts it to anyway), so results match the local backend bit for bit in the
engine's dtype.
"""
from __future__ import annotations

import numpy as np
import torch

MAX_MESSAGE_BYTES = 16 << 20        # the client splits bigger calls; the server accepts 64 MiB


def check_tensor(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"tensors must be on the CPU, got {x.device}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"expected float32, bfloat16 or float16, got {x.dtype}")


def to_fp16(x: torch.Tensor) -> np.ndarray:
    """x as float16 (round to nearest even), converted in pieces below torch's parallel grain
    (32768 elements): vectorised on this thread, no wake-up of the intra-op thread pool
    (which costs milliseconds on a busy machine) and ~10x faster than numpy's astype."""
    out = torch.empty(x.shape, dtype=torch.float16)
    rows = max(1, 32768 // max(1, x[0].numel())) if len(x) else 1
    for a in range(0, x.shape[0], rows):
        out[a:a + rows].copy_(x[a:a + rows])
    return out.numpy()


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A contiguous float32/float16 numpy view of a CPU tensor (bfloat16 widened to float32)."""
    check_tensor(x)
    if x.dtype == torch.bfloat16:
        x = x.float()
    return np.ascontiguousarray(x.detach().numpy())


def q_wire(q: torch.Tensor) -> tuple[np.ndarray, str]:
    """q as sent, and its wire dtype: bfloat16 as its bits (widened on the worker), else as given."""
    if q.dtype == torch.bfloat16:
        return np.ascontiguousarray(q.detach().contiguous().view(torch.int16).numpy().view(np.uint16)), "bfloat16"
    qn = to_numpy(q)
    return qn, qn.dtype.name


def kv_wire(x: torch.Tensor, kv_format: str) -> np.ndarray:
    """k, v as sent: fp16 for an fp16 store (what it keeps anyway), else fp32/fp16 as given."""
    if kv_format == "fp16" and x.dtype != torch.float16:
        check_tensor(x)
        return to_fp16(x.detach())
    return to_numpy(x)


def decode_chunk_rows(row_bytes: int, shards: int) -> int:
    """Rows of a decode batch per message, where a row (q, k, v of one sequence, all heads)
    takes row_bytes and each of `shards` workers gets its share of the heads."""
    return max(1, MAX_MESSAGE_BYTES // max(1, row_bytes // shards))


def prefill_chunks(rows, ids, lens, starts, token_bytes: int):
    """Split one group's prefill into messages of at most MAX_MESSAGE_BYTES, where a token
    takes token_bytes; a long prompt spans several. Yields (seq ids, lens, token indices)."""
    budget = max(1, MAX_MESSAGE_BYTES // token_bytes)      # tokens per message
    chunk_ids, chunk_lens, chunk_tok, used = [], [], [], 0
    for i, s in zip(rows, ids):
        a, n = int(starts[i]), lens[i]
        while True:
            take = min(n, budget - used)
            chunk_ids.append(s)
            chunk_lens.append(take)
            chunk_tok.append(np.arange(a, a + take))
            used += take
            a, n = a + take, n - take
            if used >= budget:
                yield chunk_ids, chunk_lens, np.concatenate(chunk_tok)
                chunk_ids, chunk_lens, chunk_tok, used = [], [], [], 0
            if n == 0:
                break
    if chunk_ids:
        yield chunk_ids, chunk_lens, np.concatenate(chunk_tok)
