"""What both ends of the R-worker stream agree on besides the proto: tensor encoding
and HTTP/2 settings."""
from __future__ import annotations

import numpy as np

from rworker.proto import rworker_pb2 as pb

WIRE_DTYPES = {"float16": np.float16, "float32": np.float32}

# A step's message is a few hundred KB: with HTTP/2's default 64 KB flow-control window
# each one would wait for window updates, a scheduler wake-up of each side apiece.
HTTP2_OPTIONS = [("grpc.http2.lookahead_bytes", 16 << 20),
                 ("grpc.http2.max_frame_size", (1 << 24) - 1)]    # the largest HTTP/2 allows


def to_tensor(a: np.ndarray) -> pb.Tensor:
    """Raw little-endian bytes + shape + dtype name (x86/Arm hosts are little-endian)."""
    return pb.Tensor(data=a.tobytes(), shape=a.shape, dtype=a.dtype.name)
