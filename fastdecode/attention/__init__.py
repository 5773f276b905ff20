"""Attention backends: a small registry; each backend is imported only when chosen."""
from __future__ import annotations

from fastdecode.attention.base import (AttentionBackend, AttentionError, KVCapacityError, KVSpec,
                                       SequencesLost)


def create_backend(config, spec: KVSpec) -> AttentionBackend:
    if config.attention == "local":
        from fastdecode.attention.local import LocalAttention
        return LocalAttention(spec, config)
    if config.attention == "remote":
        from fastdecode.attention.remote.backend import RemoteAttention
        return RemoteAttention(spec, config)
    if config.attention == "torch":
        from fastdecode.attention.torch_ref import TorchAttention
        return TorchAttention(spec, config)
    raise ValueError(f"unknown attention backend {config.attention!r}")


__all__ = ["AttentionBackend", "AttentionError", "KVCapacityError", "KVSpec", "SequencesLost",
           "create_backend"]
