"""Per-group int8 quantization of the few activation rows a decode/verify matmul reads (llama.cpp's q8_1 idea):
with x in int8, the quantized weights multiply by integer dot products (dp4a: four products per instruction),
which is what lets a batch-1 GEMV keep up with memory instead of with float unpacking.

Per row and group of 64 along K: scale = absmax / 127, codes = round(x / scale) in int8, and the group's sum of
codes (the q4/q5 weight offset leaves through it). `split` stores a row's codes as two planes, even k then odd
k, since a packed q4/q5 byte holds an even and an odd k: its low nibbles pair with the even plane's words and its
high nibbles with the odd plane's.
"""
from __future__ import annotations

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


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, sums_ptr, K, SPLIT: tl.constexpr, GROUPS: tl.constexpr):
        row, pid = tl.program_id(0), tl.program_id(1)
        groups = K // 64
        rg = pid * GROUPS + tl.arange(0, GROUPS)
        ri = tl.arange(0, 64)
        g_ok = rg < groups
        k = rg[:, None] * 64 + ri[None, :]
        x = tl.load(x_ptr + row * K + k, mask=g_ok[:, None], other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)
        codes = tl.minimum(tl.maximum(tl.floor(x * (127.0 / absmax)[:, None] + 0.5), -127.0), 127.0)
        dest = k
        if SPLIT:
            dest = (k % 2) * (K // 2) + k // 2
        tl.store(codes_ptr + row * K + dest, codes.to(tl.int8), mask=g_ok[:, None])
        tl.store(scales_ptr + row * groups + rg, absmax / 127.0, mask=g_ok)
        tl.store(sums_ptr + row * groups + rg, tl.sum(codes, 1).to(tl.int32), mask=g_ok)

    return quantize_rows_kernel


def quantize_rows(x: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As quantize_rows_reference, by one small kernel where Triton serves x's device."""
    if not runs_here(x):
        return quantize_rows_reference(x, split)
    global _kernel
    if _kernel is None:
        _kernel = _build()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, k // GROUP, dtype=torch.int32, device=x.device)
    per = 16
    _kernel[(m, -(-(k // GROUP) // per))](x.contiguous(), codes, scales, sums, k, SPLIT=split, GROUPS=per,
                                          num_warps=4)
    return codes, scales, sums
