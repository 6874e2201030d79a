"""Per-group int8 quantization of the few activation rows a decode/verify matmul reads (llama.cpp's q8_1 idea):
with x in int8, the quantized weights multiply by integer dot products (dp4a: four products per instruction),
which is what lets a batch-1 GEMV keep up with memory instead of with float unpacking.

Per row and group of 64 along K: scale = absmax / 127, codes = round(x / scale) in int8, and the group's sum of
codes (the q4/q5 weight offset leaves through it). `split` stores a row's codes as two planes, even k then odd
k, since a packed q4/q5 byte holds an even and an odd k: its low nibbles pair with the even plane's words and its
high nibbles with the odd plane's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import runs_here

GROUP = 64


def quantize_rows_reference(x: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scales fp32 [M, K/64], code sums int32 [M, K/64])."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    absmax = g.abs().amax(-1).clamp_min(1e-30)
    codes = torch.floor(g * (127.0 / absmax)[..., None] + 0.5).clamp_(-127, 127)
    sums = codes.sum(-1).to(torch.int32)
    codes = codes.reshape(m, k).to(torch.int8)
    if split:
        codes = torch.cat([codes[:, 0::2], codes[:, 1::2]], dim=1)
    return codes.contiguous(), absmax / 127.0, sums


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, split: bool) -> torch.Tensor:
    """The rows quantize_rows stands for, in fp32 (what a matmul on int8 activations computes with)."""
    m, k = codes.shape
    if split:
        codes = torch.stack([codes[:, : k // 2], codes[:, k // 2:]], dim=2).reshape(m, k)
    return (codes.float().reshape(m, k // GROUP, GROUP) * scales[..., None]).reshape(m, k)


@dataclass
class QuantRows:
    """Activation rows [M, K] with their int8 form, made by the kernel that computed them (a fused norm or
    activation) for the quantized matmul that reads them next."""

    x: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype


def empty_rows(x_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> QuantRows:
    """Buffers for a producer kernel to fill: x [..., K] and its int8 rows."""
    k, m = x_shape[-1], math.prod(x_shape[:-1])
    return QuantRows(torch.empty(x_shape, dtype=dtype, device=device),
                     torch.empty(m, k, dtype=torch.int8, device=device),
                     torch.empty(m, k // GROUP, dtype=torch.float32, device=device),
                     torch.empty(m, k // GROUP, dtype=torch.int32, device=device))


def quantize_rows(x: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As quantize_rows_reference, by one small kernel where Triton serves x's device."""
    if not runs_here(x):
        return quantize_rows_reference(x, split)
    from . import pdl
    from .rowquant import quantize_rows_kernel

    m, k = x.shape
    rows = empty_rows((m, k), x.dtype, x.device)
    per = 16
    quantize_rows_kernel[(m, -(-(k // GROUP) // per))](x.contiguous(), rows.codes, rows.scales, rows.sums, k,
                                                       SPLIT=split, GROUPS=per, num_warps=4, **pdl.launch(x))
    return rows.codes, rows.scales, rows.sums
