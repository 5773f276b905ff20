"""What both ends of the R-worker stream agree on besides the proto: tensor encoding
and HTTP/2 settings."""
from __future__ import annotations

import numpy as np

from rworker.proto import rworker_pb2 as pb

# bfloat16 travels as its uint16 bit patterns (numpy has no bfloat16).
WIRE_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}

# A step's message is a few hundred KB: with HTTP/2's default 64 KB flow-control window
# each one would wait for window updates, a scheduler wake-up of each side apiece.
HTTP2_OPTIONS = [("grpc.http2.lookahead_bytes", 16 << 20),
                 ("grpc.http2.max_frame_size", (1 << 24) - 1)]    # the largest HTTP/2 allows


def to_tensor(a: np.ndarray, dtype: str = "") -> pb.Tensor:
    """Raw little-endian bytes + shape + dtype name (x86/Arm hosts are little-endian)."""
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=dtype or a.dtype.name)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even like torch's .to(bfloat16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)
