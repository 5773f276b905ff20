"""The seam between the S-Part (engine) and the R-Part (KV-cache + attention).

The engine sees only this interface. Every implementation owns the KV-cache of
the sequences it has opened and passes the same test suite
(tests/test_attention_backends.py):

- local:  the C++ kernel in this process (fastdecode.attention.local)
- remote: the R-worker fleet over gRPC (fastdecode.attention.remote)
- torch:  a plain-torch reference, slow, for tests (fastdecode.attention.torch_ref)

Tensors crossing this seam are CPU torch tensors (any strides). Inputs may be
float32, bfloat16 or float16; outputs are float32. Shapes:
    q: [B, num_heads, head_dim]      k, v: [B, num_kv_heads, head_dim]
    prefill k, v: [sum(lens), num_kv_heads, head_dim], sequences back to back
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from rpart.errors import AttentionError, KVCapacityError

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionBackend", "AttentionError", "KVCapacityError", "KVRoom", "KVSpec", "SequencesLost"]


@dataclass(frozen=True)
class KVSpec:
    """What an attention backend must know of the model: shapes, never weights."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"KVSpec: all sizes must be >= 1: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"KVSpec: num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass(frozen=True)
class KVRoom:
    """Free KV of a backend that can tell, in pages: the KV of page_tokens tokens of one
    sequence in every layer. A sequence of n tokens holds ceil(n / page_tokens) pages."""

    page_tokens: int
    free_pages: int
    total_pages: int


class SequencesLost(AttentionError):
    """The KV of these sequences is gone (an R-worker died). The engine rebuilds
    them with `open` + `prefill` of every token so far, then retries the step."""

    def __init__(self, seq_ids: Sequence[int], reason: str = "", output: "torch.Tensor | None" = None) -> None:
        self.seq_ids = list(seq_ids)
        # For a failed submit_decode: o of the whole batch, valid for every row whose
        # sequence is not in seq_ids, so the engine can finish the step for the survivors.
        self.output = output
        super().__init__(f"KV lost for {len(self.seq_ids)} sequence(s): {reason}")


class AttentionBackend(ABC):
    # True when submit_decode works beside the caller (another thread, process or machine) on
    # resources the S-Part does not use: then the engine splits a step into mini-batches that
    # overlap with it. False when the work runs on the S-Part's own cores: overlap gains nothing.
    overlaps = True
    # The longest the engine waits for one decode result before failing its rows: a backstop
    # behind the backend's own deadlines, so a call that never resolves cannot hang the engine.
    decode_backstop_s = 300.0

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec

    @abstractmethod
    def open(self, seq_ids: Sequence[int]) -> None:
        """Create empty KV-caches. Raises KVCapacityError when they cannot be placed."""

    @abstractmethod
    def close(self, seq_ids: Sequence[int]) -> None:
        """Free the KV of these sequences now. Unknown ids are ignored (idempotent)."""

    @abstractmethod
    def prefill(self, layer: int, seq_ids: Sequence[int], lens: Sequence[int],
                k: torch.Tensor, v: torch.Tensor) -> None:
        """Append lens[i] tokens of k, v to sequence seq_ids[i] of `layer`.
        The S-worker has computed the prefill attention itself."""

    @abstractmethod
    def submit_decode(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> "Future[torch.Tensor]":
        """Append one token (k, v) per sequence to `layer`, then return (as a future)
        o = softmax(q K^T * scale) V over the whole cache including that token: float32, or
        bfloat16 where q is (rounded from float32 as torch rounds; the local backend does).
        Must return quickly: the engine runs the S-Part of the other mini-batch
        while this runs."""

    def decode(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.submit_decode(layer, seq_ids, q, k, v).result()

    def kv_room(self) -> KVRoom | None:
        """Free KV now, when this backend alone owns a pool it can count (None: it cannot tell;
        capacity then shows only as KVCapacityError). Called every step: must be cheap."""
        return None

    def available(self) -> bool:
        """Whether new sequences can be opened now (e.g. some R-worker is live); never blocks."""
        return True

    def stats(self) -> dict:
        """At least {"sequences": int, "kv_tokens": int, "kv_bytes": int, "capacity_bytes": int},
        and for the remote backend "workers": [{address, sequences, kv_tokens, ...}]."""
        return {}

    def shutdown(self) -> None:
        """Release resources (threads, channels). The backend is unusable after."""
