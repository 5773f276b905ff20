"""The R-Part's errors, defined once: the kernel, the R-worker and the S-worker's backends raise these."""
from __future__ import annotations

from typing import Any, Sequence


class AttentionError(RuntimeError):
    """The R-Part failed for a reason that is not the caller's input."""


class KVCapacityError(AttentionError):
    """Out of KV capacity: nothing of the failed call was stored. With seq_ids (an R-worker
    refused its share of a call): nothing of those sequences, and for a failed submit_decode
    `output` is o of the whole batch, valid for every row whose sequence is not in seq_ids."""

    def __init__(self, message: str = "", seq_ids: Sequence[int] | None = None, output: Any = None) -> None:
        super().__init__(message)
        self.seq_ids = None if seq_ids is None else list(seq_ids)
        self.output = output
