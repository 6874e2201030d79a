"""Prefill-sized matmuls on q8/q5/q4 weights (more rows than the fused decode kernels take): a Triton launch
dequantizes a block of the weight's rows into a bounded scratch, cuBLAS multiplies it. Reads both layouts,
row-major and tiled (`quant/qweight.py`; the tile order is `tile`'s), so a tiled weight is never untiled. The
reference is `quant.qweight.dequantize` (codes x scales in fp32, then cast), which the rows equal exactly.

Why: the reference builds int16 codes, fp32 values and their product, [N, K] each, in a dozen launches, and
untiles a tiled weight first, which made it nearly all of a short prefill chunk's kernel time
(`scripts/profile_host.py --prefill` shows it). A fused GEMM that dequantized tiles in registers into `tl.dot`
lost to this at every 27B shape from 32 to 2048 rows: its weight loads were byte gathers, and each tile was
dequantized once per block of rows.
"""
from __future__ import annotations

import torch

from ..quant.qweight import GROUP, QuantizedWeight
from . import runs_here

BLOCK_ROWS = 16  # rows per dequant program (a tile's)
# rows dequantized per cuBLAS call: bounds the scratch to ~64 MiB at the 27B's widest input (17408)
SCRATCH_ELEMENTS = 32 * 2**20
_FMT = {"q8": 8, "q5": 5, "q4": 4}

_kernel = None


def usable(x: torch.Tensor, w: QuantizedWeight) -> bool:
    return runs_here(x) and w.out_features % BLOCK_ROWS == 0 and w.in_features % GROUP == 0


def _build():
    import triton.language as tl
    from triton import jit

    @jit
    def dequant_kernel(codes_ptr, high_ptr, scales_ptr, out_ptr, row0, K, FMT: tl.constexpr,
                       TILED: tl.constexpr, BLOCK_C: tl.constexpr):
        # Every load is of contiguous bytes (16-byte vectors): a tile's cells, or a row's segment, whole; the codes
        # are put in [row, column] order by reshape/permute/interleave in registers. Computed byte addresses per
        # value (`col // 2`) defeated Triton's contiguity analysis and made byte gathers.
        tile, block = tl.program_id(0), tl.program_id(1)
        G: tl.constexpr = BLOCK_C // 64  # groups per program
        groups = K // 64
        rr = tl.arange(0, 16)
        r = (row0 + tile * 16 + rr).to(tl.int64)  # rows of the weight (x K may pass 2^31 in an LM head)
        g = block * G + tl.arange(0, G)
        if FMT == 8:
            code = tl.load(codes_ptr + r[:, None] * K + block * BLOCK_C + tl.arange(0, BLOCK_C)[None, :])
        else:
            if TILED:  # cells [tile, group, gid, tid, half, byte]: row = half * 8 + gid, byte = tid * 8 + byte
                cell = (row0 // 16 + tile).to(tl.int64) * groups + g
                byte = tl.load(codes_ptr + cell[:, None] * 512 + tl.arange(0, 512)[None, :])
                byte = tl.reshape(tl.permute(tl.reshape(byte, (G, 8, 4, 2, 8)), (3, 1, 0, 2, 4)), (16, G * 32))
            else:
                byte = tl.load(codes_ptr + r[:, None] * (K // 2) + block * (BLOCK_C // 2)
                               + tl.arange(0, BLOCK_C // 2)[None, :])
            byte = byte.to(tl.int32)
            code = tl.interleave(byte & 0xF, byte >> 4)  # low nibble = even column
            if FMT == 5:  # the 5th bit: bit c % 8 of byte c // 8 of the row's segment
                if TILED:  # cells [tile, group, gid, tid, half, 2]: byte of the segment = tid * 2 + b
                    hbyte = tl.load(high_ptr + cell[:, None] * 128 + tl.arange(0, 128)[None, :])
                    hbyte = tl.reshape(tl.permute(tl.reshape(hbyte, (G, 8, 4, 2, 2)), (3, 1, 0, 2, 4)), (16, G * 8))
                else:
                    hbyte = tl.load(high_ptr + r[:, None] * (K // 8) + block * (BLOCK_C // 8)
                                    + tl.arange(0, BLOCK_C // 8)[None, :])
                bit = (hbyte.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
                code = code + tl.reshape(bit, (16, BLOCK_C)) * 16 - 16
            else:
                code = code - 8
        code = tl.reshape(code.to(tl.float32), (16, G, 64))  # [row, group, column of the group]
        if TILED:  # [tile, group, row of the tile]
            scale = tl.trans(tl.load(scales_ptr + cell[:, None] * 16 + rr[None, :]))
        else:
            scale = tl.load(scales_ptr + r[:, None] * groups + g[None, :])
        value = tl.reshape(code * scale.to(tl.float32)[:, :, None], (16, BLOCK_C))
        col = block * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(out_ptr + (tile * 16 + rr[:, None]).to(tl.int64) * K + col[None, :],
                 value.to(out_ptr.dtype.element_ty))

    return dequant_kernel


def dequantize_rows(w: QuantizedWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop of the weight (multiples of 16), dequantized: [stop - start, K] in `dtype`."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    k = w.in_features
    out = torch.empty(stop - start, k, dtype=dtype, device=w.codes.device)
    high = w.high if w.high is not None else w.codes
    cols = next(c for c in (256, 128, GROUP) if k % c == 0)  # 4x fewer programs than 16 x 64, in the same time
    _kernel[((stop - start) // BLOCK_ROWS, k // cols)](
        w.codes, high, w.scales, out, start, k, FMT=_FMT[w.fmt], TILED=w.tiled, BLOCK_C=cols, num_warps=4)
    return out


def dequant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ W.T by blocks of rows: each dequantized into a scratch, then one cuBLAS matmul."""
    n, k = w.out_features, w.in_features
    block = max(BLOCK_ROWS, SCRATCH_ELEMENTS // k // BLOCK_ROWS * BLOCK_ROWS)
    if block >= n:
        return x @ dequantize_rows(w, 0, n, x.dtype).T
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, block):
        stop = min(n, start + block)
        torch.matmul(x, dequantize_rows(w, start, stop, x.dtype).T, out=out[:, start:stop])
    return out
