"""Prefill-sized matmuls on q8/q5/q4 weights (more rows than the fused decode kernels take), two ways:
- `fused`: one Triton GEMM dequantizes each weight tile in registers and feeds it to tensor-core dots (`tl.dot`),
  so the weight is read once per block of rows, in its own bytes. Small row counts split K to fill the GPU.
- `cublas`: a Triton launch dequantizes a block of rows into a bounded scratch, cuBLAS multiplies it. It writes
  and re-reads the weight in bf16 (3.5x its q4/q5 bytes) but runs cuBLAS's tensor-core rate, so long chunks may
  prefer it.
Which one serves a (shape, format, row bucket) is timed on the GPU at first use and kept in the tiles file
(`tiles.py`), like the decode kernels' tiles. Both read both layouts, row-major and tiled (`quant/qweight.py`;
the tile order is `tile`'s), so a tiled weight is never untiled. The reference is `quant.qweight.dequantize`
(codes x scales in fp32, then cast to the compute dtype), which both kernels reproduce exactly before the dot.

Why: the reference builds int16 codes, fp32 values and their product, [N, K] each, in a dozen launches, and
untiles a tiled weight first; a 128-token prefill chunk of the 27B spent 370 of its 391 ms of kernel time there
(H200, `scripts/profile_host.py --prefill`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.qweight import GROUP, QuantizedWeight
from . import runs_here, tiles

BLOCK_ROWS = 16  # rows per dequant program (a tile's)
# rows dequantized per cuBLAS call: bounds the scratch to ~64 MiB at the 27B's widest input (17408)
SCRATCH_ELEMENTS = 32 * 2**20
_FMT = {"q8": 8, "q5": 5, "q4": 4}

_kernels: dict[str, object] = {}
_chosen: dict[tuple, PConfig] = {}


@dataclass(frozen=True)
class PConfig:
    """How one prefill-sized matmul runs: the fused GEMM's tile and K-split, or the dequantize + cuBLAS path."""

    version: str  # "fused" or "cublas"
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    warps: int = 0
    stages: int = 0
    split: int = 1


def usable(x: torch.Tensor, w: QuantizedWeight) -> bool:
    return runs_here(x) and w.out_features % BLOCK_ROWS == 0 and w.in_features % GROUP == 0


def _build() -> None:
    import triton.language as tl
    from triton import jit

    global weight_tile  # a jit kernel finds the jit functions it calls among its module's globals

    @jit
    def weight_tile(codes_ptr, high_ptr, scales_ptr, r, col, K, mask, FMT: tl.constexpr, TILED: tl.constexpr):
        """Values of the weight at rows r [R, 1] (int64) and columns col [1, C] (whole groups), in fp32."""
        groups = K // 64
        group = col // 64
        kk = col % 64  # column within the group
        rr = r % 16  # row within its tile (tiles start at multiples of 16)
        j = kk // 2  # byte of the row's group segment (q4/q5: two codes per byte, low nibble = even column)
        cell = ((r // 16) * groups + group) * 8 + rr % 8  # tiled: the row's 16 lanes' bytes of this group
        if FMT == 8:
            code = tl.load(codes_ptr + r * K + col, mask=mask).to(tl.int32)
        else:
            if TILED:  # [tile, group, gid, tid, half, byte]: row = half * 8 + gid, byte of the segment = tid * 8 + byte
                byte = tl.load(codes_ptr + cell * 64 + (j // 8) * 16 + (rr // 8) * 8 + j % 8, mask=mask)
            else:
                byte = tl.load(codes_ptr + r * (K // 2) + col // 2, mask=mask)
            code = (byte.to(tl.int32) >> ((kk % 2) * 4)) & 0xF
            if FMT == 5:  # the 5th bit: bit c % 8 of byte c // 8 (8 bytes per row and group)
                hj = kk // 8
                if TILED:  # [tile, group, gid, tid, half, 2]: byte of the segment = tid * 2 + b
                    hbyte = tl.load(high_ptr + cell * 16 + (hj // 2) * 4 + (rr // 8) * 2 + hj % 2, mask=mask)
                else:
                    hbyte = tl.load(high_ptr + r * (K // 8) + col // 8, mask=mask)
                code = code + (((hbyte.to(tl.int32) >> (kk % 8)) & 1) << 4) - 16
            else:
                code = code - 8
        if TILED:  # [tile, group, row of the tile]
            scale = tl.load(scales_ptr + ((r // 16) * groups + group) * 16 + rr, mask=mask)
        else:
            scale = tl.load(scales_ptr + r * groups + group, mask=mask)
        return code.to(tl.float32) * scale.to(tl.float32)

    @jit
    def dequant_kernel(codes_ptr, high_ptr, scales_ptr, out_ptr, row0, K, FMT: tl.constexpr,
                       TILED: tl.constexpr, BLOCK_C: tl.constexpr):
        tile, block = tl.program_id(0), tl.program_id(1)
        rr = tl.arange(0, 16)[:, None]
        col = block * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        r = (row0 + tile * 16 + rr).to(tl.int64)  # row of the weight (x K may pass 2^31 in an LM head)
        value = weight_tile(codes_ptr, high_ptr, scales_ptr, r, col, K, r >= 0, FMT, TILED)
        tl.store(out_ptr + (tile * 16 + rr) * K + col, value.to(out_ptr.dtype.element_ty))

    @jit
    def gemm_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K, K_SLICE, FMT: tl.constexpr,
                    TILED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr):
        # consecutive programs take the row blocks of one weight tile, so a tile is read from memory once and
        # from L2 by the others
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid, part = tl.program_id(0), tl.program_id(1)
        rm = (pid % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        rn = ((pid // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(part * K_SLICE, (part + 1) * K_SLICE, BLOCK_K):
            a = tl.load(x_ptr + rm * K + k0 + kk, mask=rm < M, other=0.0)
            w = weight_tile(codes_ptr, high_ptr, scales_ptr, rn, k0 + kk, K, rn < N, FMT, TILED)
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        cn = tl.trans(rn)
        if SPLIT == 1:
            tl.store(out_ptr + rm * N + cn, acc.to(out_ptr.dtype.element_ty), mask=(rm < M) & (cn < N))
        else:  # fp32 partials [SPLIT, M, N], summed after
            tl.store(out_ptr + (part * M + rm) * N + cn, acc, mask=(rm < M) & (cn < N))

    _kernels.update(dequant=dequant_kernel, gemm=gemm_kernel)


def _kernel(name: str):
    if not _kernels:
        _build()
    return _kernels[name]


def dequantize_rows(w: QuantizedWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop of the weight (multiples of 16), dequantized: [stop - start, K] in `dtype`."""
    k = w.in_features
    out = torch.empty(stop - start, k, dtype=dtype, device=w.codes.device)
    high = w.high if w.high is not None else w.codes
    cols = next(c for c in (256, 128, GROUP) if k % c == 0)  # wide programs: 16 x 64 values were too few to
    _kernel("dequant")[((stop - start) // BLOCK_ROWS, k // cols)](  # keep loads in flight
        w.codes, high, w.scales, out, start, k, FMT=_FMT[w.fmt], TILED=w.tiled, BLOCK_C=cols, num_warps=4)
    return out


def _cublas_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
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


def launch(x: torch.Tensor, w: QuantizedWeight, cfg: PConfig) -> torch.Tensor:
    """x [M, K] (contiguous) @ W.T with one explicit config."""
    if cfg.version == "cublas":
        return _cublas_linear(x, w)
    m, k = x.shape
    n = w.out_features
    out = torch.empty((cfg.split, m, n) if cfg.split > 1 else (m, n), device=x.device,
                      dtype=torch.float32 if cfg.split > 1 else x.dtype)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), cfg.split)
    _kernel("gemm")[grid](x, w.codes, w.high if w.high is not None else w.codes, w.scales, out, m, n, k,
                          k // cfg.split, FMT=_FMT[w.fmt], TILED=w.tiled, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, num_warps=cfg.warps,
                          num_stages=cfg.stages)
    return out.sum(0).to(x.dtype) if cfg.split > 1 else out


# (block_m, block_n, block_k, warps, stages) of the fused GEMM's candidates
_TILES = ((32, 64, 64, 4, 3), (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
          (128, 128, 64, 8, 3), (128, 128, 128, 8, 3))


def candidates(rows: int, n: int, k: int, sms: int) -> list[PConfig]:
    """The fused tiles that fit `rows` (no block of rows more than twice what is needed), each with the K-split
    that gives about one program per SM when the tiles alone are too few, then the dequantize + cuBLAS path."""
    out = []
    for bm, bn, bk, warps, stages in _TILES:
        if bm > max(32, 2 * rows) or k % bk:
            continue
        programs = -(-rows // bm) * -(-n // bn)
        split = 1
        while programs * split < sms and split < 8 and k % (2 * split * bk) == 0:
            split *= 2
        out.append(PConfig("fused", bm, bn, bk, warps, stages, split))
    return [*out, PConfig("cublas")]


def row_bucket(rows: int) -> int:
    """The largest row count of the power-of-two bucket a prefill-sized call takes its config from."""
    return 1 << (rows - 1).bit_length()


def choose(rows: int, dtype: torch.dtype, device: torch.device, w: QuantizedWeight) -> PConfig:
    """The fastest candidate for this weight's shape, format and row bucket on this GPU: from the tiles file when
    an earlier launch chose it, else timed (L2 flushed) and recorded. The first candidate in the interpreter."""
    top = row_bucket(rows)
    fmt = f"{w.fmt} tiled" if w.tiled else w.fmt
    key = (w.out_features, w.in_features, fmt, dtype, str(device), top)
    if key not in _chosen:
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        options = candidates(top, w.out_features, w.in_features, sms)
        if not cuda:
            _chosen[key] = options[0]
        else:
            stored = tiles.key(torch.cuda.get_device_name(device),
                               f"prefill qmatmul {w.out_features}x{w.in_features} {fmt} {dtype} {top} rows", options)
            choice = tiles.lookup(stored, options)
            if choice is None:
                xt = torch.randn(top, w.in_features, device=device, dtype=dtype)
                choice = min(options, key=lambda c: _time(xt, w, c))
                tiles.record(stored, choice)
            _chosen[key] = choice
    return _chosen[key]


def _time(x: torch.Tensor, w: QuantizedWeight, cfg: PConfig) -> float:
    from .timing import graph_ms

    try:
        return graph_ms(lambda: launch(x, w, cfg), calls=2, reps=5, flush_l2=True)
    except Exception as e:  # noqa: BLE001 - Triton raises several types (OutOfResources, compile errors)
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        return float("inf")


def prefill_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ W.T for M above the decode kernels' rows, by the config chosen for this shape."""
    x = x.contiguous()
    return launch(x, w, choose(x.shape[0], x.dtype, x.device, w))
