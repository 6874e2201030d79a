"""Storage cost of each weight format; the memory plan and the bandwidth floors count bytes with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int  # per weight code
    group: int  # weights sharing one scale
    scale_bytes: int  # per group (one fp16/bf16 scale)

    def nbytes(self, numel: int) -> int:
        groups = -(-numel // self.group)
        return -(-numel * self.bits // 8) + groups * self.scale_bytes


# Symmetric round-to-nearest per group of 64 along the input dimension, one 16-bit scale per group.
FORMATS = {f.name: f for f in (QuantFormat("q8", 8, 64, 2), QuantFormat("q5", 5, 64, 2), QuantFormat("q4", 4, 64, 2))}


def tensor_bytes(numel: int, fmt: str, dtype_bytes: int) -> int:
    """Bytes a tensor of `numel` weights takes in format `fmt` ("auto" = compute dtype, "bf16", or a q format)."""
    if fmt == "auto":
        return numel * dtype_bytes
    if fmt == "bf16":
        return numel * 2
    return FORMATS[fmt].nbytes(numel)
