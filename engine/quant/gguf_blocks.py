"""GGUF weights kept in the file's own block layout (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), for the CPU kernels
that read it (`kernels/cpu_gguf.py`): no re-quantization, and a quarter to a half of the fp32 bytes a decode step
streams. A weight is a stack of row ranges, each of one type (a fused projection may join differently quantized
parts, as Q4_K_M files quantize v and q differently; plain float parts join as F32 rows)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as Q

from .packed import PackedWeight

# Types the CPU kernels read; anything else is dequantized at load
BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass
class BlockRows:
    qtype: int  # a GGMLQuantizationType value (F32 for float rows)
    data: torch.Tensor  # uint8 [rows, bytes per row]: the stored blocks, rows in the model's order

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@dataclass
class GGUFWeight(PackedWeight):
    parts: tuple[BlockRows, ...]
    in_features: int
    compute_dtype: torch.dtype = torch.float32  # what matmul and rows return: the model's dtype
    out_features: int = field(init=False)

    def __post_init__(self) -> None:
        self.out_features = sum(p.rows for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """x [..., K] @ W.T -> [..., N] (`partial` is for split-K GPU kernels; these sum their own rows)."""
        from ..kernels import cpu_gguf

        return cpu_gguf.linear(x, self)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        from ..kernels import cpu_gguf

        return cpu_gguf.rows(self, ids)


def from_blocks(qtype: int, data: torch.Tensor, in_features: int, compute_dtype: torch.dtype) -> GGUFWeight:
    return GGUFWeight((BlockRows(int(qtype), data),), in_features, compute_dtype)


def float_rows(w: torch.Tensor) -> BlockRows:
    """A plain [N, K] weight as F32 rows (to stack with quantized parts)."""
    return BlockRows(int(Q.F32), w.float().contiguous().view(torch.uint8))


def concat(parts: list) -> GGUFWeight:
    """Weights that read the same input stacked into one (their outputs side by side): GGUF weights and plain
    tensors."""
    rows: list[BlockRows] = []
    for p in parts:
        rows.extend(p.parts if isinstance(p, GGUFWeight) else (float_rows(p),))
    merged: list[BlockRows] = []
    for r in rows:  # neighbours of one type become one range: one kernel call instead of several
        if merged and merged[-1].qtype == r.qtype:
            merged[-1] = BlockRows(r.qtype, torch.cat([merged[-1].data, r.data]))
        else:
            merged.append(r)
    first = next(p for p in parts if isinstance(p, GGUFWeight))
    return GGUFWeight(tuple(merged), first.in_features, first.compute_dtype)


def dequantize(w: GGUFWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: every row decoded by the gguf-layout decoder the loader uses (`loaders/gguf_dequant.py`)."""
    from ..loaders.gguf_dequant import dequantize as decode

    out = [torch.from_numpy(decode(p.data.numpy().reshape(-1), p.qtype, (p.rows, w.in_features))) for p in w.parts]
    return torch.cat(out).to(dtype)
