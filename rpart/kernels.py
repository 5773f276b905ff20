"""Typed wrapper over the C++ R-Part kernel (csrc/ -> rpart._kernels).

`KVStore` is the KV-cache of one R-worker: a block pool allocated once
(huge pages where the OS allows), per (sequence, layer) block tables, fp16 or
int4 storage, and decode attention with fp32 math on a thread pool (GIL
released). Arrays may be numpy arrays or CPU torch tensors (float32 or
float16); contiguous inputs are passed to C++ without copies.

`reference_attention` below is what every kernel path computes.

Kernel paths (chosen at run time from the CPU's features, or forced with
`isa=`): "avx512vnni" (as avx512, with int4 key scores and value sums as AVX512-VNNI
integer dot products), "avx512" (AVX-512 F/BW/VL/DQ, 16 lanes), "avx2" (AVX2 + FMA +
F16C, 8 lanes; the paper's ISA) and "scalar" (any CPU). All compute in fp32, except
that avx512vnni holds q for int4 key scores in 24-bit fixed point per key group
(three signed-byte limbs; error at most half an fp32 ulp of the group's largest
|q|), sums q . u in int32 and converts once per group; and, for the values, holds
each chunk's weights p_t * scale_t (2 or 4 blocks of one kv head) in 24-bit fixed point per
value group (three byte limbs, error at most half an fp32 ulp of the chunk's largest),
sums them against the nibbles of 4 tokens at a time in int32, and converts once per
chunk.

int4 format: asymmetric, per token, in groups of channels with an fp16 scale and
zero point each: `k_group` channels for keys (default 32), `v_group` for values
(default 64), each 16, 32, 64 or 128 and dividing head_dim (the default falls to
the largest such group below it; the AVX-512 paths need value groups of 32 or
more; int4 value nibbles lie in lines of 32 channels, so a head_dim of 16 mod 32 pads
its last line). At head_dim 128 a token of one kv head takes 152 bytes at the defaults
(3.37x less than fp16's 512), 160 at 32/32, 144 at 64/64. Keys lose more than
values to larger groups (bench/results/int4_grouping.json, simulated on the
default model with the newest block in fp16: perplexity over fp16 KV +3.3% at
32/32, +4.2% at 32/64, +7.8% at 64/32); the kernel with the defaults reads 5%
fewer bytes than at 32/32 and is 2-7% faster (bench/kernel_ab.py).
fp16 tails (`fp16_tail=True`, the default; int4 only): the newest, unfinished
block of every (sequence, layer) is also kept in fp16, in a staging area of 1/8
of the capacity, and attention reads that block from there; when the block
fills, its tail goes back to the area and the block is read as int4. Every
token is still quantized once on append. When the area is full, new blocks
have no tail (their tokens read as int4) until tails are returned.
Measured cost (bench/results/perplexity.json, `python -m fastdecode.eval
--compare`): SmolLM2-135M perplexity 11.215 (fp16 KV) -> 11.644 (int4 KV, default
groups, with fp16 tails, +3.8%), 12.187 without tails (+8.7%), on 8 chunks of 1024 tokens of
English prose (pydoc_data "The standard type hierarchy"), 8128 decoded tokens
scored, each attending over every earlier K and V of its chunk in this format
(fp32 KV reference: 11.215).
Groupings compared (`make bench-int4-grouping`, bench/results/int4_grouping.json,
same text, simulated in torch): keys per channel over 16-token blocks with the
newest unfinished block in fp16 (KIVI) cost +0.8%, the fp16 newest block of keys
alone with per-token keys +3.9% (the store keeps keys and values of that block in
fp16: +3.5% in the kernel at 32/32 groups),
per-channel keys re-quantized from per-token int4 (no fp16) +7.8%. Per-channel
keys would need q scaled by each block's channel scales before the integer dot
products (a fixed-point conversion of q per block and head), about as much work
again as the key scores themselves.
The kernels never dequantize: q . k = sum_g s_g (q . u)_g + z_g sum_g(q), and
sum_t p_t v_t = sum_t (p_t s_t) u_t + sum_t p_t z_t.
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from rpart import _kernels
from rpart.errors import KVCapacityError
from rpart.formats import KV_FORMATS

ISAS = ("auto", "avx512vnni", "avx512", "avx2", "scalar")


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Decode attention of one sequence in float64.

    q [H, D], k/v [T, Hkv, D] -> o [H, D]; query head j reads kv head j // (H // Hkv).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[1]
    kk = np.repeat(k, group, axis=1).transpose(1, 0, 2)  # [H, T, D]
    vv = np.repeat(v, group, axis=1).transpose(1, 0, 2)
    s = np.einsum("hd,htd->ht", q, kk) * (q.shape[1] ** -0.5 if scale is None else scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(axis=-1, keepdims=True), vv)


def cpu_supports(isa: str) -> bool:
    """Whether this CPU (and this build) can run the given kernel path."""
    return isa == "auto" or _kernels.cpu_supports(isa)


def _rows_contiguous(shape, strides, item: int) -> bool:
    """Each row (index of the first dimension) C-contiguous, rows apart by at least their size."""
    expect = item
    for n, st in zip(reversed(shape[1:]), reversed(strides[1:])):
        if n > 1 and st != expect:
            return False
        expect *= n
    return len(shape) == 0 or shape[0] <= 1 or (strides[0] >= expect and strides[0] % item == 0)


def _floats(x, name: str) -> np.ndarray:
    """numpy view of a float32/float16 array or CPU torch tensor; a torch bfloat16 tensor as its bits
    (uint16, which the extension reads as bfloat16). Rows (the first dimension) may lie apart, as in
    a view of a wider buffer; anything else is copied into a contiguous array."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # torch.Tensor, without importing torch
            if x.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
            x = x.detach()
            if x.dim() == 0 or not _rows_contiguous(tuple(x.shape), tuple(x.stride()), 1):
                x = x.contiguous()
            if str(x.dtype) == "torch.bfloat16":
                return x.view(sys.modules["torch"].uint16).numpy()   # torch is loaded: x is its tensor
            x = x.numpy()
        else:
            x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16):
        raise ValueError(f"{name} must be float32 or float16, got {x.dtype}")
    if x.flags.c_contiguous or (x.ndim > 0 and _rows_contiguous(x.shape, x.strides, x.itemsize)):
        return x
    return np.ascontiguousarray(x)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _flag(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {x!r}")
    return bool(x)


def _int(x, name: str) -> int:
    """One id or index as a Python int in int64's range; bools, floats and strings are refused
    (int() would silently turn True into 1 and 1.5 into 1, aliasing another sequence)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {x!r} ({type(x).__name__})")
    x = int(x)
    if not _INT64_MIN <= x <= _INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {x}")
    return x


def _ints(x, name: str) -> np.ndarray:
    """A 1-D int64 array of integers in int64's range. Refused, not converted: bools, floats,
    strings, and values outside int64 (a uint64 id >= 2**63 would wrap to a negative one)."""
    if hasattr(x, "detach") and hasattr(x, "numpy"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise ValueError(f"{name} must be a 1-D sequence of integers, got {type(x).__name__}")
    else:
        x = x if isinstance(x, (list, tuple)) else list(x)
        if set(map(type, x)) <= {int}:              # the common case, checked at C speed
            try:
                return np.array(x, dtype=np.int64)
            except OverflowError:
                pass                                # beyond int64: the precise error below
        a = np.array(x) if len(x) else np.zeros(0, np.int64)
        if a.dtype.kind not in "iu" or any(isinstance(v, (bool, np.bool_)) for v in x):
            a = np.array([_int(v, name) for v in x], dtype=np.int64)   # checks each: the precise error
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got {a.dtype}")
    if a.size and a.dtype.kind == "u" and a.max() > _INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {a.max()}")
    return np.ascontiguousarray(a, dtype=np.int64)


class KVStore:
    """Paged KV-cache + decode attention (see module docstring).

    populate: a thread of the store commits the pool's pages from the start, front to back (the order
    blocks are handed out), so that appends do not stall on first-touch page faults; it stops 1 GiB
    short of the memory left. wait_populated() waits for it.

    Errors: KeyError (unknown sequence id), ValueError (shape, dtype, NaN/inf,
    layer out of range, duplicate ids in one call), KVCapacityError (pool
    exhausted; nothing of the call was stored).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_bytes: int,
                 block_size: int = 16, kv_format: str = "fp16", num_threads: int = 0, isa: str = "auto",
                 fp16_tail: bool = True, k_group: int = 0, v_group: int = 0, openmp: bool = False,
                 populate: bool = True) -> None:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
        _flag(fp16_tail, "fp16_tail")
        _flag(populate, "populate")
        for name, group in (("k_group", k_group), ("v_group", v_group)):
            if isinstance(group, (bool, np.bool_)) or not isinstance(group, (int, np.integer)):
                raise ValueError(f"{name} must be an int (16, 32, 64, 128 or 0 for the default), got {group!r}")
        self._s = _kernels.KVStore(int(num_layers), int(num_kv_heads), int(head_dim), int(capacity_bytes),
                                   int(block_size), kv_format, int(num_threads), isa, bool(fp16_tail),
                                   int(k_group), int(v_group), bool(openmp), bool(populate))
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.block_size = int(block_size)
        self.kv_format = kv_format

    @property
    def isa(self) -> str:
        """The kernel path in use: "avx512vnni" | "avx512" | "avx2" | "scalar"."""
        return self._s.isa

    @property
    def num_threads(self) -> int:
        return self._s.num_threads

    @property
    def openmp(self) -> bool:
        """True: attention runs on the process's OpenMP team (torch's), not on a pool of its own."""
        return self._s.openmp

    @property
    def block_bytes(self) -> int:
        return self._s.block_bytes

    @property
    def groups(self) -> tuple[int, int]:
        """int4: channels per scale and zero point of keys and of values; fp16: (0, 0)."""
        return self._s.k_group, self._s.v_group

    def set_threads(self, num_threads: int) -> None:
        """Resize the kernel's thread pool (0 = all CPUs this process may use)."""
        self._s.set_threads(int(num_threads))

    def create(self, seq_ids: Sequence[int]) -> None:
        self._s.create(_ints(seq_ids, "seq_ids"))

    def free(self, seq_ids: Sequence[int]) -> None:
        self._s.free(_ints(seq_ids, "seq_ids"))

    def has(self, seq_id: int) -> bool:
        return self._s.has(_int(seq_id, "seq_id"))

    def length(self, seq_id: int, layer: int = 0) -> int:
        return self._s.length(_int(seq_id, "seq_id"), _int(layer, "layer"))

    def block_ids(self, seq_id: int, layer: int = 0) -> list[int]:
        """Where the sequence's blocks of `layer` are in the pool, in token order. Free blocks are
        handed out lowest first."""
        return self._s.block_ids(_int(seq_id, "seq_id"), _int(layer, "layer"))

    def append(self, layer: int, seq_ids: Sequence[int], k, v) -> None:
        """One new token per sequence: k, v [B, Hkv, D]."""
        self._call(self._s.append, _int(layer, "layer"), _ints(seq_ids, "seq_ids"), _floats(k, "k"),
                   _floats(v, "v"))

    def append_span(self, layer: int, seq_ids: Sequence[int], lens: Sequence[int], k, v) -> None:
        """lens[i] tokens per sequence, back to back: k, v [sum(lens), Hkv, D]."""
        self._call(self._s.append_span, _int(layer, "layer"), _ints(seq_ids, "seq_ids"), _ints(lens, "lens"),
                   _floats(k, "k"), _floats(v, "v"))

    def attend(self, layer: int, seq_ids: Sequence[int], q, scale: float | None = None,
               bf16_out: bool = False) -> np.ndarray:
        """q [B, H, D] -> o float32 [B, H, D] over each sequence's cache at `layer`; with bf16_out,
        o in bfloat16 (its bits, uint16; rounded to nearest even, as torch rounds)."""
        return self._call(self._s.attend, _int(layer, "layer"), _ints(seq_ids, "seq_ids"), _floats(q, "q"), scale,
                          _flag(bf16_out, "bf16_out"))

    def decode(self, layer: int, seq_ids: Sequence[int], q, k, v, scale: float | None = None,
               bf16_out: bool = False) -> np.ndarray:
        """append(k, v) then attend(q), in one call."""
        return self._call(self._s.decode, _int(layer, "layer"), _ints(seq_ids, "seq_ids"), _floats(q, "q"),
                          _floats(k, "k"), _floats(v, "v"), scale, _flag(bf16_out, "bf16_out"))

    def read(self, seq_id: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The cache as the kernel sees it (fp16 widened, int4 dequantized): k, v float32 [T, Hkv, D]."""
        return self._s.read(_int(seq_id, "seq_id"), _int(layer, "layer"))

    def wait_populated(self, timeout_s: float = 600.0) -> bool:
        """Until the pool's pages are committed (or committing stopped short of the memory left); False on
        timeout. Attention waits meanwhile: call it at startup."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"timeout_s must be a number, got {timeout_s!r}")
        return self._s.wait_populated(float(timeout_s))

    def stats(self) -> dict:
        """sequences, kv_tokens (per sequence: its longest layer), blocks_used, blocks_total, bytes_used, capacity_bytes,
        tail_blocks_used, tail_blocks_total, populated_bytes (committed ahead of use; 0 without populate or where
        the OS cannot)."""
        return self._s.stats()

    def close(self) -> None:
        """Release the pool now; the store is unusable after."""
        self._s.close()

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except _kernels.CapacityError as e:
            raise KVCapacityError(str(e)) from None
