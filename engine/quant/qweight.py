"""Group-wise symmetric integer weights (q8, q5, q4): quantize at load (round to nearest per group of 64 along
the input dimension, one bf16/fp16 scale per group), the plain-torch dequantize that is the reference, and the
matmul that picks the Triton kernel on a GPU.

Layout (rows are output features; every row's bytes are contiguous for 16-byte loads):
- q8: int8 codes [N, K].
- q4: uint8 [N, K/2], two codes per byte (low nibble = even k), stored as code + 8.
- q5: the q4 nibble plane [N, K/2] for the low 4 bits of code + 16, and a bit plane [N, K/8] for the 5th bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FORMATS

GROUP = 64
_QMAX = {"q8": 127, "q5": 15, "q4": 7}


@dataclass
class QuantizedWeight:
    fmt: str
    codes: torch.Tensor  # int8 [N, K] (q8) or uint8 nibbles [N, K/2] (q4, q5)
    scales: torch.Tensor  # [N, K/GROUP], bf16 or fp16
    high: torch.Tensor | None = None  # q5: uint8 [N, K/8], bit i of byte j = 5th bit of code 8j + i
    out_features: int = 0
    in_features: int = 0
    compute_dtype: torch.dtype = torch.float32  # what rows() returns: the model's dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight computes in (what the model around it uses)."""
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.high is None else self.high.nbytes)

    def matmul(self, x: torch.Tensor, partial: bool = False):
        """x [..., K] @ W.T -> [..., N] (or, with `partial`, a split-K launch's unsummed `SplitK`)."""
        from ..kernels.qmatmul import qlinear

        return qlinear(x, self, partial)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        sub = QuantizedWeight(self.fmt, self.codes[ids], self.scales[ids],
                              None if self.high is None else self.high[ids], len(ids), self.in_features)
        return dequantize(sub, self.compute_dtype)


def concat_rows(parts: list):
    """Stack weights that read the same input into one (their outputs side by side): plain tensors, or
    quantized ones of one format (rows are independent, so codes, scales and bit planes stack as they are)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    if not all(isinstance(p, QuantizedWeight) and p.fmt == parts[0].fmt for p in parts):
        raise ValueError("weights fused into one projection must share one storage format")
    high = None if parts[0].high is None else torch.cat([p.high for p in parts])
    return QuantizedWeight(parts[0].fmt, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           high, sum(p.out_features for p in parts), parts[0].in_features, parts[0].compute_dtype)


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest per group of GROUP weights along K; the scale maps the group's absmax onto the top code."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
    qmax = _QMAX[fmt]
    groups = w.float().reshape(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / qmax).clamp_min(1e-12)
    codes = torch.round(groups / scale[..., None]).clamp_(-qmax - (fmt != "q8"), qmax).to(torch.int16)
    codes = codes.reshape(n, k)
    # 16-bit scales whatever the compute dtype (the byte count the memory plan uses): bf16 with bf16 models,
    # fp16 (more mantissa) otherwise.
    scales = scale.to(torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float16)
    if fmt == "q8":
        return QuantizedWeight(fmt, codes.to(torch.int8), scales, None, n, k, w.dtype)
    offset = 8 if fmt == "q4" else 16
    u = (codes + offset).to(torch.uint8)  # 0..15 (q4) or 0..31 (q5)
    low = u & 0xF
    nibbles = (low[:, 0::2] | (low[:, 1::2] << 4)).contiguous()
    high = None
    if fmt == "q5":
        bits = (u >> 4).reshape(n, k // 8, 8).to(torch.int32)
        high = (bits << torch.arange(8, device=w.device, dtype=torch.int32)).sum(-1).to(torch.uint8)
    return QuantizedWeight(fmt, nibbles, scales, high, n, k, w.dtype)


def codes_of(q: QuantizedWeight) -> torch.Tensor:
    """The signed integer codes [N, K] (int16)."""
    if q.fmt == "q8":
        return q.codes.to(torch.int16)
    n, k = q.codes.shape[0], q.in_features
    u = torch.empty(n, k, dtype=torch.int16, device=q.codes.device)
    u[:, 0::2] = (q.codes & 0xF).to(torch.int16)
    u[:, 1::2] = (q.codes >> 4).to(torch.int16)
    if q.fmt == "q4":
        return u - 8
    bits = (q.high.to(torch.int16)[..., None] >> torch.arange(8, device=q.codes.device, dtype=torch.int16)) & 1
    return u + (bits.reshape(n, k) << 4) - 16


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: codes x scales, computed in fp32."""
    c = codes_of(q).float().reshape(q.codes.shape[0], -1, GROUP)
    return (c * q.scales.float()[..., None]).reshape(q.codes.shape[0], q.in_features).to(dtype)


def load_transform(formats):
    """The per-tensor hook loaders apply as each weight arrives, so the unquantized model never has to fit in
    memory whole; None when every class keeps its checkpoint format."""
    from ..memory_plan import weight_class

    wanted = formats.as_dict()
    if all(v == "auto" for v in wanted.values()):
        return None

    def transform(name: str, w: torch.Tensor):
        fmt = wanted.get(weight_class(name), "auto")
        if fmt in FORMATS and w.dim() == 2 and w.shape[1] % GROUP == 0:
            return quantize(w, fmt)
        if fmt == "bf16" and w.dim() == 2:
            return w.to(torch.bfloat16)
        return w

    return transform
