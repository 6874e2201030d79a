"""GGUF weights kept in the file's own block layout, for the kernels that read it: no re-quantization, and a
quarter to a half of the fp32 bytes a decode step streams. The CPU's C kernels (`kernels/cpu_gguf.py`) read Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K and Q6_K; a GPU's Triton kernels (`kernels/gguf_matmul.py`) Q8_0 and the K-quants. A weight
is a stack of row ranges, each of one type (a fused projection may join differently quantized parts, as Q4_K_M
files quantize v and q differently; plain float parts join as F32 rows)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .packed import PackedWeight

# Types the CPU kernels read, and those the GPU kernels read; anything else is dequantized at load
BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
GPU_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def kept_types(device: torch.device) -> tuple[int, ...]:
    """The quantized types a model on `device` keeps in their blocks: those its kernels read (none on a CPU
    without a C compiler, where the C kernels cannot be built)."""
    if device.type == "cuda":
        return GPU_TYPES
    if device.type != "cpu":
        return ()
    from ..kernels import cpu_gguf

    return BLOCK_TYPES if cpu_gguf.available() else ()


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

    def matmul(self, x: torch.Tensor, partial: bool = False):
        """x [..., K] @ W.T -> [..., N]; on a GPU, with `partial`, maybe a split-K launch's unsummed `SplitK`."""
        if self.device.type == "cpu":
            from ..kernels import cpu_gguf

            return cpu_gguf.linear(x, self)
        from ..kernels import gguf_matmul

        return gguf_matmul.linear(x, self, partial)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self.device.type == "cpu":
            from ..kernels import cpu_gguf

            return cpu_gguf.rows(self, ids)
        from ..kernels import gguf_matmul

        return gguf_matmul.rows(self, ids)


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

    out = [torch.from_numpy(decode(p.data.cpu().numpy().reshape(-1), p.qtype, (p.rows, w.in_features)))
           for p in w.parts]
    return torch.cat(out).to(dtype)


# Byte offsets of each block's fp16 scale fields (d, and Q4_K's and Q5_K's dmin)
_SCALE_FIELDS = {Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: int, n: int, k: int, scale: float = 2.0 ** -8, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Random blocks [n, bytes per row] of a GPU type for tests and benchmarks (the gguf package quantizes only
    Q8_0 among them): random bytes, each fp16 scale field a finite value of either sign, |value| in
    [0.5, 1.5) * `scale`, never zero."""
    block, size = GGML_QUANT_SIZES[Q(qtype)]
    b = k // block
    raw = torch.randint(0, 256, (n, b, size), generator=generator, dtype=torch.uint8, device=device)
    for at in _SCALE_FIELDS[Q(qtype)]:
        mag = torch.rand(n, b, generator=generator, device=device) + 0.5
        sign = torch.where(torch.rand(n, b, generator=generator, device=device) < 0.2, -1.0, 1.0)
        raw[:, :, at:at + 2] = (mag * sign * scale).to(torch.float16).view(torch.uint8).view(n, b, 2)
    return raw.view(n, b * size)
