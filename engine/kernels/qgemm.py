"""Prefill-sized matmuls on q8/q5/q4 weights (more rows than the fused decode kernels take) on int8 tensor cores,
and the choice between that kernel and dequantize + cuBLAS (`dequant.py`) per GPU, weight and row count.

`int8_gemm_kernel`: x [M, K] quantized per row and group of 64 to int8 (`int8_rows`: actquant's arithmetic, as
llama.cpp's q8_1; q4/q5 rows split into even-k and odd-k planes, the order a packed byte's low and high nibbles
hold), times the codes as stored, exactly in integers per group, then the x and weight scales of the group into an
fp32 accumulator. A program owns BLOCK_N weight rows and BLOCK_M x rows and walks K one group at a time, one dot
per group: the weights are its A operand in their stored order (x's rows are B, so a short chunk costs an n32
tile, not an m64 one), q4/q5 nibbles split word-wise (`qdot.planes`) and the two planes side by side along K,
against x's two planes. Both layouts are read in place: a tiled weight's row segment is four runs of 8 bytes in
its 16-row cell (`quant/qweight.py` `tile`), which load as 8-byte vectors.

Why: dequantize + cuBLAS writes the weight in bf16 and reads it back for every chunk, so at a few hundred rows it
takes several times the bytes floor, and cuBLAS then multiplies at the bf16 rate; int8 tensor cores run at twice
that on Hopper and four times on an RTX 4090, and here the weights are read once, at 4-8 bits. What they cost in
return is a per-group epilogue on the CUDA cores (the integer partial scaled into an fp32 accumulator for every
group of 64), which on Hopper takes about as long as the dots; so neither path wins everywhere, and `choose`
times both on first use.

The reference is `qmatmul.int8_rows_reference` (the reference on the int8 rows the kernel multiplies), which it
equals to fp32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.qweight import GROUP, QuantizedWeight
from . import dequant, runs_here, tiles

_FMT = {"q8": 8, "q5": 5, "q4": 4}
_OFFSET = {"q8": 0, "q5": 16, "q4": 8}  # stored code = code + offset


@dataclass(frozen=True)
class GemmConfig:
    kernel: str  # "dequant_cublas" (`dequant.dequant_linear`) or "int8_gemm" (`int8_gemm_kernel`)
    block_n: int = 0  # weight rows per program (the dot's M side)
    block_m: int = 0  # x rows per program
    warps: int = 0
    stages: int = 0  # Triton's num_stages: the code and x loads pipelined ahead of their dots


DEQUANT = GemmConfig("dequant_cublas")

# (weight rows, x rows, warps, stages) per row bucket: short chunks take narrow x tiles (more programs over a
# 5120-wide output), long ones wide tiles (fewer epilogue instructions per output, x read from L2 fewer times).
# All compile without spills for sm_89 and sm_90 (ptxas; 128 x 128 at 4 warps spilled). Each tile costs a
# compilation on a fresh machine, so the lists are short; `scripts/bench_prefill_qmatmul.py --sweep` times them all.
_SHORT = ((64, 32, 4, 4), (128, 32, 4, 4), (64, 64, 4, 4))
_MIDDLE = ((64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3))
_LONG = ((128, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 3), (128, 128, 8, 3))
# (largest row count of the bucket, label, its tiles); the last bucket is timed at 4096 rows
_BUCKETS = ((128, "up to 128 rows", _SHORT), (512, "129-512 rows", _MIDDLE), (2048, "513-2048 rows", _LONG),
            (4096, "2049+ rows", _LONG))


def row_bucket(rows: int) -> tuple[int, str, tuple]:
    """(row count it is timed at, label, int8 tiles) of the bucket a chunk of `rows` rows takes its choice from."""
    return next((b for b in _BUCKETS if rows <= b[0]), _BUCKETS[-1])


def candidates(rows: int | None = None) -> list[GemmConfig]:
    """Dequantize + cuBLAS, then the int8 tiles for a chunk of `rows` rows (every tile when rows is None)."""
    shapes = row_bucket(rows)[2] if rows is not None else dict.fromkeys(_SHORT + _MIDDLE + _LONG)
    return [DEQUANT] + [GemmConfig("int8_gemm", bn, bm, warps, stages) for bn, bm, warps, stages in shapes]


_kernels: dict[str, object] = {}


def _build():
    import triton
    import triton.language as tl

    global planes  # a jit kernel finds the jit functions it calls among its module's globals
    from .qdot import planes

    @triton.jit
    def int8_rows_kernel(x_ptr, codes_ptr, xs_ptr, bias_ptr, M, M_PAD, K, SPLIT: tl.constexpr,
                         OFFSET: tl.constexpr, GROUPS: tl.constexpr):
        # `actquant.quantize_rows`'s codes (the same arithmetic, so the same bits), with each group's scale and
        # code sum written column-wise ([group, row]): the matmul reads them per group for a block of rows, and
        # contiguous rows load as vectors from one base address
        row, pid = tl.program_id(0), tl.program_id(1)
        rg = pid * GROUPS + tl.arange(0, GROUPS)
        g_ok = rg < K // 64
        k = rg[:, None] * 64 + tl.arange(0, 64)[None, :]
        # the padding rows (row >= M) quantize zeros: defined values, whose outputs are never stored
        real = g_ok & (tl.full((GROUPS,), row, tl.int32) < M)
        x = tl.load(x_ptr + row.to(tl.int64) * K + k, mask=real[:, None], other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)
        codes = tl.minimum(tl.maximum(tl.floor(x * (127.0 / absmax)[:, None] + 0.5), -127.0), 127.0)
        dest = k
        if SPLIT:
            dest = (k % 2) * (K // 2) + k // 2
        tl.store(codes_ptr + row.to(tl.int64) * K + dest, codes.to(tl.int8), mask=g_ok[:, None])
        tl.store(xs_ptr + rg * M_PAD + row, absmax / 127.0, mask=g_ok)
        tl.store(bias_ptr + rg * M_PAD + row, 12582912.0 + OFFSET * tl.sum(codes, 1), mask=g_ok)

    @triton.jit
    def int8_gemm_kernel(xq_ptr, xs_ptr, bias_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, M_PAD, N, K,
                         code_stride, high_stride, scale_stride, FMT: tl.constexpr, TILED: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, USE_ASM: tl.constexpr):
        # programs of one weight tile run one after another (x's tiles vary fastest): the tile is read from memory
        # once, then from L2, and x (a chunk's int8 rows, a few MB) stays in L2 for all of them
        m_tiles = M_PAD // BLOCK_M
        pid_n, pid_m = tl.program_id(0) // m_tiles, tl.program_id(0) % m_tiles
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # x's rows are padded to M_PAD: no masks on their loads
        groups = K // 64
        BYTES: tl.constexpr = 64 if FMT == 8 else 32  # per row and group (q4/q5: one plane's codes)
        rb = tl.arange(0, BYTES)
        # weight rows past N read the last tile's (no masks on the loads); only the store is masked
        if TILED:  # cells [tile, group, gid, tid, half, byte], row = half * 8 + gid, the row's byte = tid * 8 + byte
            r16 = rn % 16
            cell = tl.minimum(rn // 16, N // 16 - 1).to(tl.int64) * groups
            w_at = cell[:, None] * 512 + ((r16 % 8) * 64 + (r16 // 8) * 8)[:, None] + ((rb // 8) * 16 + rb % 8)[None, :]
            rh = tl.arange(0, 8)  # q5 bit-plane cells [.., gid, tid, half, 2]: the row's byte = tid * 2 + b
            h_at = cell[:, None] * 128 + ((r16 % 8) * 16 + (r16 // 8) * 2)[:, None] + ((rh // 2) * 4 + rh % 2)[None, :]
            s_at = cell * 16 + r16
            W_STEP: tl.constexpr = 512
            H_STEP: tl.constexpr = 128
            S_STEP: tl.constexpr = 16
        else:
            row = tl.minimum(rn, N - 1).to(tl.int64)
            w_at = row[:, None] * code_stride + rb[None, :]
            h_at = row[:, None] * high_stride + tl.arange(0, 8)[None, :]
            s_at = row * scale_stride
            W_STEP: tl.constexpr = BYTES
            H_STEP: tl.constexpr = 8
            S_STEP: tl.constexpr = 1
        # x's rows as the dot's B [64, rows]: a group's 64 codes, q4/q5's even plane then its odd one
        r64 = tl.arange(0, 64)
        x_at = rm.to(tl.int64)[None, :] * K + r64[:, None]
        if FMT != 8:
            x_at = rm.to(tl.int64)[None, :] * K + ((r64 % 32) + (r64 // 32) * tl.multiple_of(K // 2, 32))[:, None]
        lane = tl.arange(0, 4)[None, None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for g in range(0, groups):
            # the scales are used after the dot: their loads are on their way while it runs
            s = tl.load(scales_ptr + s_at + g * S_STEP).to(tl.float32)
            xs = tl.load(xs_ptr + g * M_PAD + rm)
            bias = tl.load(bias_ptr + g * M_PAD + rm)
            a = tl.load(codes_ptr + w_at + g * W_STEP)
            if FMT != 8:  # [low nibbles | high nibbles]: the even-k codes, then the odd-k ones, as x's planes
                b = tl.reshape(a, (BLOCK_N, 8, 4))
                h = b
                if FMT == 5:
                    h = tl.broadcast_to(tl.load(high_ptr + h_at + g * H_STEP)[:, :, None], (BLOCK_N, 8, 4))
                lo, hi = planes(b, h, lane, FMT, USE_ASM)
                # a register-level concatenation (each plane fills the K steps of its half): one dot per group
                a = tl.reshape(tl.permute(tl.join(tl.reshape(lo, (BLOCK_N, 32)), tl.reshape(hi, (BLOCK_N, 32))),
                                          (0, 2, 1)), (BLOCK_N, 64))
            # The dot accumulates onto 1.5 * 2**23's bits, so its int32 result read as a float is that number plus
            # the exact sum (|sum| < 2**22 for 64 products of int8 and 8-bit codes), and one subtraction of `bias`
            # (that number plus the zero point's share: codes are stored offset by 8 or 16) leaves the exact dot.
            # An int32 -> float conversion runs at a fraction of the FMA rate, and this epilogue (four operations
            # per output and group: the accumulator's start, the subtraction, the scales' product, the FMA) is
            # what bounds the kernel on Hopper.
            part = tl.dot(a, tl.load(xq_ptr + x_at + g * BYTES), out_dtype=tl.int32)
            exact = (part + 0x4B400000).to(tl.float32, bitcast=True) - bias[None, :]
            acc += exact * (s[:, None] * xs[None, :])
        out = out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rm < M)[None, :])

    return {"int8_rows": int8_rows_kernel, "int8_gemm": int8_gemm_kernel}


def _kernel(name: str):
    if not _kernels:
        _kernels.update(_build())
    return _kernels[name]


def int8_rows(x: torch.Tensor, fmt: str, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row and group of 64 as `actquant.quantize_rows` does (q4/q5: even/odd planes), padded
    to `rows` rows: codes int8 [rows, K], scales fp32 [K/64, rows], and `int8_gemm_kernel`'s bias fp32 [K/64, rows]
    (1.5 * 2**23 plus the zero point's share of the group's code sum). The padding rows hold zeros; the matmul's
    outputs there are never stored."""
    m, k = x.shape
    codes = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(k // GROUP, rows, dtype=torch.float32, device=x.device)
    bias = torch.empty(k // GROUP, rows, dtype=torch.float32, device=x.device)
    per = 16
    _kernel("int8_rows")[(rows, -(-(k // GROUP) // per))](x.contiguous(), codes, scales, bias, m, rows, k,
                                                          SPLIT=fmt != "q8", OFFSET=_OFFSET[fmt], GROUPS=per,
                                                          num_warps=4)
    return codes, scales, bias


def int8_gemm(x: torch.Tensor, w: QuantizedWeight, cfg: GemmConfig) -> torch.Tensor:
    """x [M, K] @ W.T on int8 tensor cores, x quantized to int8 rows first (`int8_rows`)."""
    m, k = x.shape
    n = w.out_features
    rows = -(-m // cfg.block_m) * cfg.block_m
    xq, xs, bias = int8_rows(x, w.fmt, rows)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    high = w.high if w.high is not None else w.codes
    grid = (rows // cfg.block_m * -(-n // cfg.block_n),)
    _kernel("int8_gemm")[grid](xq, xs, bias, w.codes, high, w.scales, out, m, rows, n, k, w.codes.stride(0),
                               high.stride(0), w.scales.stride(0), FMT=_FMT[w.fmt], TILED=w.tiled,
                               BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, USE_ASM=x.is_cuda, num_warps=cfg.warps,
                               num_stages=cfg.stages)
    return out


def launch(x: torch.Tensor, w: QuantizedWeight, cfg: GemmConfig) -> torch.Tensor:
    """x [M, K] @ W.T by one explicit path and tile."""
    if cfg.kernel == "int8_gemm":
        return int8_gemm(x, w, cfg)
    return dequant.dequant_linear(x, w)


_chosen: dict[tuple, GemmConfig] = {}


def choose(rows: int, dtype: torch.dtype, device: torch.device, w: QuantizedWeight) -> GemmConfig:
    """The faster path for this weight (shape, format, layout) and row bucket on this GPU: from the tiles file
    when an earlier launch chose it, else each candidate that computes the product here (`_agrees`) timed inside a
    CUDA graph with L2 flushed (`timing.graph_ms`) at the bucket's row count, and recorded; a tile this GPU cannot
    compile is skipped. Dequantize + cuBLAS off a GPU (the interpreter), where the int8 kernel runs only when a
    test asks for it, and for fp32 rows: those are the exact (oracle) path, which int8 rounding of x would move."""
    top, label, _ = row_bucket(rows)
    layout = "tiled" if w.tiled else "rows"
    key = (w.out_features, w.in_features, w.fmt, layout, dtype, str(device), label)
    if key not in _chosen:
        if device.type != "cuda" or dtype == torch.float32:
            _chosen[key] = DEQUANT
        else:
            options = candidates(rows)
            stored = tiles.key(torch.cuda.get_device_name(device), f"prefill {CHOICE_VERSION} {w.out_features}x"
                               f"{w.in_features} {w.fmt} {layout} {dtype} {label}", options)
            choice = tiles.lookup(stored, options)
            if choice is None:
                probe = torch.randn(min(top - 3, PROBE_ROWS), w.in_features, device=device, dtype=dtype)
                want = launch(probe, w, DEQUANT)
                agreeing = [c for c in options if _agrees(probe, w, c, want)]
                del probe, want
                xt = torch.randn(top, w.in_features, device=device, dtype=dtype)
                choice = fastest(agreeing, lambda c: _time(xt, w, c))
                tiles.record(stored, choice)
            _chosen[key] = choice
    return _chosen[key]


def fastest(options: list[GemmConfig], ms) -> GemmConfig:
    """The option `ms` times fastest; the dequantized path when none times finite (it is always among them)."""
    times = {c: ms(c) for c in options}
    best = min(times, key=times.get, default=DEQUANT)
    return best if times.get(best, float("inf")) < float("inf") else DEQUANT


def prefill_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (a prefill chunk's rows) @ W.T by the path `choose` picked for this weight and row count."""
    assert x.shape[-1] == w.in_features and w.in_features % GROUP == 0 and runs_here(x)
    return launch(x, w, choose(x.shape[0], x.dtype, x.device, w))


# A stored choice names the kernel's revision and the check it passed: a later revision times again
CHOICE_VERSION = "int8-checked-1"
# Rows the agreement check multiplies at most (3 fewer than the bucket's top, which every tile's rows divide, so
# the padded rows and the store mask run): few enough that the check's buffers stay small beside the weights
PROBE_ROWS = 253
# How far any row of an int8 tile's product may sit from the dequantized path's on random rows: x's int8 rounding
# moves a row by well under 1%; a wrong row (a miscompiled tile, a bad mask) lands far past this.
AGREEMENT = 0.05


def _agrees(x: torch.Tensor, w: QuantizedWeight, cfg: GemmConfig, want: torch.Tensor) -> bool:
    """Whether a candidate computes this product here, row by row: one that does not, or cannot run, is never
    chosen, however fast."""
    if cfg == DEQUANT:
        return True
    try:
        got = launch(x, w, cfg).float()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - a tile this GPU cannot compile (Triton raises several types)
        return False
    ref = want.float()
    worst = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max()
    return bool(worst.item() < AGREEMENT)


def _time(x: torch.Tensor, w: QuantizedWeight, cfg: GemmConfig) -> float:
    from .timing import candidate_ms

    return candidate_ms(lambda: launch(x, w, cfg), calls=2, reps=5)  # prefill-sized: fewer calls suffice
