"""KV formats and the size syntax (4096, 512M, 2G) both sides of the R-Part accept."""
from __future__ import annotations

KV_FORMATS = ("fp16", "int4")
INT4_GROUPS = (0, 16, 32, 64, 128)          # channels per int4 scale and zero; 0 = the kernel's default

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '512M', '2G' (binary units, optional trailing 'iB'/'B') -> int."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _SUFFIX else ""
    number = t[: len(t) - len(unit)].strip()
    if not number.lstrip("-").isdigit():
        raise ValueError(f"not a whole number or size: {text!r}")
    return int(number) * _SUFFIX[unit]
