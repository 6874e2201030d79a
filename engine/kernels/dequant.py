"""Prefill-sized matmuls on q8/q5/q4 weights (more rows than the fused decode kernels take): a Triton launch
dequantizes a block of the weight's rows into a bounded scratch, cuBLAS multiplies it. Reads both layouts,
row-major and tiled (`quant/qweight.py`; the tile order is `tile`'s), so a tiled weight is never untiled. The
reference is `quant.qweight.dequantize` (codes x scales in fp32, then cast), which the rows equal exactly.

Why: the reference builds int16 codes, fp32 values and their product, [N, K] each, in a dozen launches, and
untiles a tiled weight first; a 128-token prefill chunk of the 27B spent 370 of its 391 ms of kernel time there
(H200, `scripts/profile_host.py --prefill`). A fused GEMM that dequantized tiles in registers into `tl.dot` lost
to this at every 27B shape from 32 to 2048 rows (1.0-14x slower, H200, NOTES.md (15)): its weight loads were
byte gathers, and each tile was dequantized once per block of rows.
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
        tile, block = tl.program_id(0), tl.program_id(1)
        groups = K // 64
        rr = tl.arange(0, 16)[:, None]  # row within the tile (tiles start at multiples of 16)
        col = block * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        r = (row0 + tile * 16 + rr).to(tl.int64)  # row of the weight (x K may pass 2^31 in an LM head)
        group = col // 64
        kk = col % 64  # column within the group
        j = kk // 2  # byte of the row's group segment (q4/q5: two codes per byte, low nibble = even column)
        cell = ((r // 16) * groups + group) * 8 + rr % 8  # tiled: the row's 16 lanes' bytes of this group
        if FMT == 8:
            code = tl.load(codes_ptr + r * K + col).to(tl.int32)
        else:
            if TILED:  # [tile, group, gid, tid, half, byte]: row = half * 8 + gid, byte of the segment = tid * 8 + byte
                byte = tl.load(codes_ptr + cell * 64 + (j // 8) * 16 + (rr // 8) * 8 + j % 8)
            else:
                byte = tl.load(codes_ptr + r * (K // 2) + col // 2)
            code = (byte.to(tl.int32) >> ((kk % 2) * 4)) & 0xF
            if FMT == 5:  # the 5th bit: bit c % 8 of byte c // 8 (8 bytes per row and group)
                hj = kk // 8
                if TILED:  # [tile, group, gid, tid, half, 2]: byte of the segment = tid * 2 + b
                    hbyte = tl.load(high_ptr + cell * 16 + (hj // 2) * 4 + (rr // 8) * 2 + hj % 2)
                else:
                    hbyte = tl.load(high_ptr + r * (K // 8) + col // 8)
                code = code + (((hbyte.to(tl.int32) >> (kk % 8)) & 1) << 4) - 16
            else:
                code = code - 8
        if TILED:  # [tile, group, row of the tile]
            scale = tl.load(scales_ptr + ((r // 16) * groups + group) * 16 + rr)
        else:
            scale = tl.load(scales_ptr + r * groups + group)
        value = code.to(tl.float32) * scale.to(tl.float32)
        tl.store(out_ptr + (tile * 16 + rr) * K + col, value.to(out_ptr.dtype.element_ty))

    return dequant_kernel


def dequantize_rows(w: QuantizedWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop of the weight (multiples of 16), dequantized: [stop - start, K] in `dtype`."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    k = w.in_features
    out = torch.empty(stop - start, k, dtype=dtype, device=w.codes.device)
    high = w.high if w.high is not None else w.codes
    cols = next(c for c in (256, 128, GROUP) if k % c == 0)  # 4x fewer programs than 16 x 64, same time (H200)
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
