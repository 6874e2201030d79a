"""Fused dequantize + matmul for group-wise q8/q5/q4 weights, for the few rows of a decode/verify step (T <= 16).

One program computes BLOCK_N output features for all rows: it streams the packed codes of its rows once, unpacks
and scales them in registers, and multiplies with tl.dot (rows padded to 16). The reference is
`x @ dequantize(w).T` (`qlinear_reference`); prefill-sized inputs take that path too until a tiled prefill kernel
exists. Config choices per GPU live in CONFIGS (autotune picks among them).
"""
from __future__ import annotations

import os

import torch

from ..quant.qweight import GROUP, QuantizedWeight, dequantize

MAX_ROWS = 16


def qlinear_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(w, x.dtype))


def _use_triton(x: torch.Tensor) -> bool:
    if x.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("NINFER_TRITON_ON_CPU") == "1"


def qlinear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or not _use_triton(x):
        return qlinear_reference(x, w)
    return _qlinear_triton(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.out_features)


_kernel = None


def _build():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw)
               for bn, bk, nw in ((32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 64, 4), (128, 128, 8))]
    if os.environ.get("TRITON_INTERPRET") == "1":
        configs = configs[:1]

    @triton.autotune(configs=configs, key=["N", "K", "FMT"])
    @triton.jit
    def kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K,
               FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        n_mask = rn < N
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            xt = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & k_mask[None, :], other=0.0)
            wmask = k_mask[:, None] & n_mask[None, :]
            if FMT == 8:
                c = tl.load(codes_ptr + rn[None, :] * K + rk[:, None], mask=wmask, other=0).to(tl.float32)
            else:
                byte = tl.load(codes_ptr + rn[None, :] * (K // 2) + (rk[:, None] // 2), mask=wmask, other=0)
                nib = ((byte.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 0xF)
                if FMT == 4:
                    c = (nib - 8).to(tl.float32)
                else:
                    hb = tl.load(high_ptr + rn[None, :] * (K // 8) + (rk[:, None] // 8), mask=wmask, other=0)
                    bit = (hb.to(tl.int32) >> (rk[:, None] % 8)) & 1
                    c = (nib + bit * 16 - 16).to(tl.float32)
            s = tl.load(scales_ptr + rn[None, :] * (K // 64) + (rk[:, None] // 64), mask=wmask, other=0.0)
            wt = (c * s.to(tl.float32)).to(xt.dtype)
            acc += tl.dot(xt, wt)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & n_mask[None, :])

    return kernel


def _qlinear_triton(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    import triton

    global _kernel
    if _kernel is None:
        _kernel = _build()
    m, k = x.shape
    assert k == w.in_features and k % GROUP == 0
    x = x.contiguous()
    out = torch.empty(m, w.out_features, dtype=x.dtype, device=x.device)
    fmt = {"q8": 8, "q5": 5, "q4": 4}[w.fmt]
    high = w.high if w.high is not None else w.codes
    grid = lambda meta: (triton.cdiv(w.out_features, meta["BLOCK_N"]),)  # noqa: E731
    _kernel[grid](x, w.codes, high, w.scales, out, m, w.out_features, k, FMT=fmt, BLOCK_M=MAX_ROWS)
    return out
