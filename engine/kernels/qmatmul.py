"""Fused dequantize + matmul for group-wise q8/q5/q4 weights, for the few rows of a decode/verify step (up to 16
rows on row-major weights, 64 on tiled ones: several requests' verify rows in one step).

A program owns BLOCK_N output features and one K-slice (split-K when N alone gives too few programs to fill the
GPU; slices write fp32 partials that one sum reduces). The kernels, each named for what it computes:
- `float_mma` (float rows: x as it is; tl.dot on float operands, rows padded to 16): one group of 64 per
  iteration, codes read directly as the dot's [K, N] operand; the low and high nibbles of a byte are the even and
  odd k, so each plane multiplies the matching half of x, and the group scale multiplies the fp32 partial product.
  A candidate in every list, for shapes and GPUs the integer kernels do not serve.
- int8 rows (x quantized per row and group of 64 by `actquant`, as llama.cpp's q8_1 activations; exact integer
  dot per group, then the x and weight scales):
  - `int8_dp4a` (`qdot.int8_dp4a_kernel`): weights read as 32-bit words (4 q8 or 8 q4/q5 codes), four
    multiply-adds per dp4a instruction, the rows of x one after another: about half an instruction per q4 weight,
    where the float kernel spends several on unpacking. The decode (one-row) kernel; it holds the next weight
    tile's loads in flight while it computes on the current one (Triton pipelines only loads that feed a dot).
  - `int8_mma` (`qdot.int8_mma_kernel`): `float_mma`'s loop on int8 tensor cores (int32 accumulators); its cost
    barely grows with the rows, so it serves verify steps, and widths `int8_mma_groups` cannot take.
  - `int8_mma_groups` (`qdot.int8_mma_groups_kernel`): `int8_mma` with several groups per iteration in one
    batched dot, the weights as the A operand in their stored order and q4/q5 nibbles split four bytes per
    instruction: more bytes in flight per program, so the verify and batch kernel on row-major weights.
- tiled weights (`quant/qweight.py` `tile`; q4/q5 on GPUs where NVRTC compiles them), CUDA kernels in
  `qtiled.py` which read each 16-row tile with one 16-byte load per lane: `tiled_mma` (2-8 rows per launch, int8
  MMA), `tiled_mma_streamed` (9-64 rows in one launch: x streamed through shared memory, so the weights are read
  once for all of them) and `tiled_dp4a` / `tiled_dp4a_xreg` (one row, dp4a). `tiled_mma` beats
  `int8_mma_groups` at 8 rows, while the one-row tiled kernels trail `int8_dp4a`, so the engine tiles weights
  where its steps multiply several rows (`EngineConfig.tiled_weights`).
Which kernel and tile run is chosen per (N, K, format, GPU) by timing a short candidate list on first use
(before any CUDA-graph capture), each inside a CUDA graph with L2 flushed between calls, as the decode step
runs them, separately for one row (decode) and for steps of 2, 3-4, 5-8, 9-16, 17-32 and 33-64 rows (`row_bucket`);
choices persist in the tiles file (`tiles.py`). `scripts/bench_qmatmul.py --sweep` prints every candidate's time.
The reference is `x @ dequantize(w).T` (`qlinear_reference`; for int8-row kernels, on the rows they multiply);
prefill-sized inputs take `qgemm.prefill_linear` (int8 tensor cores, or dequantized blocks of rows then cuBLAS,
whichever timed faster for the weight and row count) or the reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..quant.qweight import GROUP, QuantizedWeight, dequantize
from . import dequant, pdl, qgemm, qtiled, runs_here, tiles
from .actquant import QuantRows, dequantize_rows, quantize_rows, quantize_rows_reference

MAX_ROWS = 16  # the most rows the row-major kernels take; tiled weights take up to `qtiled.STREAMED_ROWS`
# Weight tiles a PDL-launched `int8_mma_groups` asks of L2 before its grid-dependency wait (`qdot.prefetch_rows`)
_L2_TILES_BEFORE_WAIT = 2
_FMT = {"q8": 8, "q5": 5, "q4": 4}


def qlinear_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(w, x.dtype))


def split_rows(w: QuantizedWeight) -> bool:
    """Whether int8 rows multiplying w come as even-k / odd-k planes (q4/q5 bytes hold an even and an odd k)."""
    return w.fmt != "q8"


def int8_rows_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """What an int8-row kernel computes: the reference on the rows its int8 codes stand for, in fp32."""
    split = split_rows(w)
    codes, scales, _ = quantize_rows_reference(x.reshape(-1, x.shape[-1]), split)
    return qlinear_reference(dequantize_rows(codes, scales, split).reshape(x.shape), w)


@dataclass
class SplitK:
    """A matmul's fp32 K-slice partials [S, M, N], not yet summed and cast: a residual RMSNorm or the SwiGLU
    activation after it sums them as it reads them (`norm.add_rms_norm`, `activation.silu_mul`), which saves the
    sum launch; `dense()` sums them anywhere else."""

    parts: torch.Tensor
    dtype: torch.dtype  # the output's
    shape: tuple[int, ...]  # the output's: [..., N]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def dense(self) -> torch.Tensor:
        _, m, n = self.parts.shape
        out = torch.empty(m, n, dtype=self.dtype, device=self.parts.device)
        _kernel("sum")[(-(-m * n // 1024),)](self.parts, out, m * n, SPLIT=self.parts.shape[0], BLOCK=1024,
                                             num_warps=4, **pdl.launch(out))
        return out.view(self.shape)


def qlinear(x: torch.Tensor | QuantRows, w: QuantizedWeight, partial: bool = False) -> torch.Tensor | SplitK:
    """x @ W.T; x may come with its int8 rows already made (`QuantRows`, from a fused producer kernel). With
    `partial`, a split-K launch returns its partials unsummed (`SplitK`)."""
    pre = x if isinstance(x, QuantRows) else None
    x = pre.x if pre is not None else x
    rows = x.numel() // x.shape[-1]
    shape = (*x.shape[:-1], w.out_features)
    if MAX_ROWS < rows <= qtiled.STREAMED_ROWS and not w.tiled and runs_here(x) and x.is_cuda:
        # several requests' verify rows on a row-major weight (the q8 LM head): the 16-row kernel per 16 rows
        # reads the weight rows/16 times, where the dequantized copy would write and read it at 2 bytes a weight
        parts = [qlinear(part, w) for part in x.reshape(rows, x.shape[-1]).split(MAX_ROWS)]
        return torch.cat(parts).reshape(shape)
    if rows > max_rows(w) and dequant.usable(x, w):  # prefill-sized: int8 tensor cores or dequantize + cuBLAS
        return qgemm.prefill_linear(x.reshape(rows, x.shape[-1]), w).reshape(shape)
    if rows > max_rows(w) or not runs_here(x) or (w.tiled and not x.is_cuda):
        return qlinear_reference(x, w)
    assert x.shape[-1] == w.in_features and w.in_features % GROUP == 0
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    cfg = choose(rows, x.dtype, x.device, w)
    out = launch(x2, w, cfg, pre, partial)
    return replace(out, shape=shape) if isinstance(out, SplitK) else out.reshape(shape)


def int8_rows_wanted(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, w) -> bool | None:
    """Whether the matmul of `w` over an input of this shape multiplies int8 rows: the even/odd split flag
    its rows take (q4/q5) when it does, None when it does not (a plain weight, prefill-sized rows, the CPU, or a
    float-row kernel chosen). A kernel producing that input can then quantize its rows as it writes them."""
    if not isinstance(w, QuantizedWeight) or shape[-1] != w.in_features:
        return None
    rows = math.prod(shape[:-1])
    if rows > max_rows(w) or not runs_here(device):
        return None
    return split_rows(w) if choose(rows, dtype, device, w).int8_rows else None


TILED_KERNELS = ("tiled_mma", "tiled_mma_streamed", "tiled_dp4a", "tiled_dp4a_xreg")  # CUDA (`qtiled`)


def max_rows(w: QuantizedWeight) -> int:
    """The most rows one call of the fused kernels takes for w; more are a prefill (`dequant`)."""
    return qtiled.STREAMED_ROWS if w.tiled else MAX_ROWS


@dataclass(frozen=True)
class QConfig:
    kernel: str  # "float_mma", "int8_dp4a", "int8_mma", "int8_mma_groups" (row-major weights) or TILED_KERNELS
    block_n: int
    block_k: int  # K per loop iteration: groups x 64 (`float_mma` and `int8_mma` always take one group, 64)
    warps: int
    stages: int  # Triton's num_stages (pipelines the loads that feed a dot: the mma kernels); 0 for tiled kernels
    split: int = 1

    @property
    def int8_rows(self) -> bool:
        """Whether this kernel multiplies x quantized to int8 rows (`actquant`) rather than x itself."""
        return self.kernel != "float_mma"

    @property
    def tiled(self) -> bool:
        return self.kernel in TILED_KERNELS


def split_k(n: int, k: int, block_n: int, sms: int, k_tile: int, per_sm: int = 2) -> int:
    """K-slices per output block so that about `per_sm` programs run per SM (1 when N already gives that); each
    slice stays a whole number of K tiles."""
    blocks = -(-n // block_n)
    split = 1
    while blocks * split < per_sm * sms and split < 16 and k % (2 * split * k_tile) == 0:
        split *= 2
    return split


# (kernel, block_n, block_k, warps, stages, serves 1 row, serves 2-16 rows[, programs per SM]): the survivors of
# the tile sweeps (`scripts/bench_qmatmul.py --sweep`). `int8_dp4a` with one weight tile in flight ahead wins
# every one-row shape (with 8 programs per SM on N = 5120, K = 6144). Verify steps go to whichever times best:
# `int8_mma_groups` with 3 stages won every 8-row shape (4 stages tied or lost), without a K split (one program
# per SM) on N = 14336 and 16480; `int8_mma` serves widths that are not a multiple of 256 (tiny models). The
# float kernel stays in both lists in case a GPU cannot run the integer ones.
_TILES = (("int8_dp4a", 16, 512, 4, 2, True, False, 8), ("int8_dp4a", 16, 512, 4, 2, True, True),
          ("int8_dp4a", 32, 512, 4, 2, True, True), ("int8_dp4a", 32, 512, 8, 2, True, False),
          ("int8_mma", 64, 64, 4, 4, False, True), ("float_mma", 64, 64, 4, 4, True, True),
          ("int8_mma_groups", 64, 256, 4, 2, False, True), ("int8_mma_groups", 64, 256, 4, 3, False, True),
          ("int8_mma_groups", 128, 256, 4, 3, False, True), ("int8_mma_groups", 64, 256, 4, 3, False, True, 1))


# Tiled weights: (warps, 16-row tiles per warp, groups per iteration, serves 1 row, serves 2-8 rows), the shapes
# that won one of the five 27B shapes when the tiled kernels were prototyped; the K split is a launch argument,
# not a compilation, so every split that keeps at most 8 blocks per SM is tried. `tiled_mma_streamed` (9-64 rows):
# (warps, tiles per warp, groups per stage), the shapes whose registers fit without spills at 64 rows.
_TILED = ((4, 1, 4, True, True), (4, 2, 4, True, True), (8, 1, 4, True, True), (4, 1, 8, False, True))
_STREAMED = ((4, 1, 4), (8, 1, 4), (4, 2, 4), (4, 1, 8))


def tiled_candidates(n: int, k: int, sms: int, rows: int | None = None) -> list[QConfig]:
    """`tiled_dp4a` and `tiled_dp4a_xreg` (one row), `tiled_mma` (2-16 rows) and `tiled_mma_streamed` (9-64 rows)
    in every shape and split that fits (every kernel when rows is None)."""
    groups = k // GROUP
    chunks = qtiled.chunks_for(rows or qtiled.STREAMED_ROWS)
    shapes = [(kernel, warps, mt, unroll) for warps, mt, unroll, one, many in _TILED
              for kernel, serves in (("tiled_dp4a", one), ("tiled_dp4a_xreg", one), ("tiled_mma", many)) if serves]
    shapes += [("tiled_mma_streamed", warps, mt, unroll) for warps, mt, unroll in _STREAMED]
    out = []
    for kernel, warps, mt, unroll in shapes:
        one_row, streamed = kernel.startswith("tiled_dp4a"), kernel == "tiled_mma_streamed"
        if rows is not None and not (rows == 1 if one_row else rows > 8 if streamed else 1 < rows <= MAX_ROWS):
            continue
        blocks = -(-n // (16 * warps * mt))
        fits = [s for s in range(1, groups // unroll + 1) if groups % s == 0 and (groups // s) % unroll == 0
                and qtiled.shared_bytes(groups // s, one_row, kernel == "tiled_dp4a_xreg", unroll,
                                        chunks if streamed else 1) <= qtiled.SHARED_LIMIT]
        # the smallest split that fits stays when every one exceeds the blocks bound (a very long K)
        splits = [s for s in fits if s == fits[0] or blocks * s <= 8 * sms]
        out += [QConfig(kernel, 16 * warps * mt, GROUP * unroll, warps, 0, s) for s in splits]
    return out


def candidates(n: int, k: int, sms: int, fmt: str, rows: int | None = None, tiled: bool = False) -> list[QConfig]:
    """The tiles tried on first use for `rows` rows (each costs a compilation, so the lists are short); every
    tile when rows is None (tests, sweeps). Tiled weights take the tiled kernels only."""
    if tiled:
        return tiled_candidates(n, k, sms, rows)
    out = []
    for kernel, bn, bk, warps, stages, one, many, *per_sm in _TILES:
        if rows is not None and not (one if rows == 1 else many):
            continue
        if k % bk == 0:
            split = split_k(n, k, bn, sms, bk, *per_sm)
            cfg = QConfig(kernel, bn, bk, warps, stages, split)
            if cfg not in out:  # a wider spread may come to the same split on a small shape
                out.append(cfg)
    return out


_kernels: dict[str, object] = {}
_chosen: dict[tuple, QConfig] = {}


def _build_float_mma():
    import triton
    import triton.language as tl

    global enter  # a jit kernel finds the jit functions it calls among its module's globals
    from .pdl import enter

    @triton.jit
    def float_mma_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K, code_stride, high_stride,
                         scale_stride, FMT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        groups = K // 64
        per = groups // SPLIT
        ri = tl.arange(0, 32)
        offset = 8 if FMT == 4 else 16  # stored code = code + offset (q4/q5)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for gi in range(pid_k * per, (pid_k + 1) * per):
            k0 = gi * 64
            s = tl.load(scales_ptr + rn * scale_stride + gi, mask=n_ok, other=0.0).to(tl.float32)
            if FMT == 8:
                rk = tl.arange(0, 64)
                c = tl.load(codes_ptr + rn[None, :] * code_stride + (k0 + rk)[:, None], mask=n_ok[None, :], other=0)
                xt = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
                part = tl.dot(xt, c.to(xt.dtype))
            else:
                byte = tl.load(codes_ptr + rn[None, :] * code_stride + (k0 // 2 + ri)[:, None], mask=n_ok[None, :],
                               other=0).to(tl.int32)
                lo, hi = byte & 0xF, byte >> 4  # k = k0 + 2i and k0 + 2i + 1
                if FMT == 5:
                    hb = tl.load(high_ptr + rn[None, :] * high_stride + (k0 // 8 + ri // 4)[:, None],
                                 mask=n_ok[None, :], other=0).to(tl.int32)
                    shift = (2 * (ri % 4))[:, None]
                    lo = lo | (((hb >> shift) & 1) << 4)
                    hi = hi | (((hb >> (shift + 1)) & 1) << 4)
                xe = tl.load(x_ptr + rm[:, None] * K + (k0 + 2 * ri)[None, :], mask=m_ok[:, None], other=0.0)
                xo = tl.load(x_ptr + rm[:, None] * K + (k0 + 2 * ri + 1)[None, :], mask=m_ok[:, None], other=0.0)
                part = tl.dot(xe, (lo - offset).to(xe.dtype)) + tl.dot(xo, (hi - offset).to(xo.dtype))
            acc += part * s[None, :]
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return float_mma_kernel


def _build_int8_dp4a():
    from .qdot import int8_dp4a_kernel  # imports Triton at module level (its jit helpers must be module globals)

    return int8_dp4a_kernel


def _build_int8_mma():
    from .qdot import int8_mma_kernel

    return int8_mma_kernel


def _build_int8_mma_groups():
    from .qdot import int8_mma_groups_kernel

    return int8_mma_groups_kernel


def _build_sum():
    import triton
    import triton.language as tl

    global enter, summed_slices  # a jit kernel finds the jit functions it calls among its module's globals
    from .pdl import enter
    from .slices import summed_slices

    @triton.jit
    def sum_slices_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < MN
        tl.store(out_ptr + r, summed_slices(part_ptr, r, ok, MN, SPLIT).to(out_ptr.dtype.element_ty), mask=ok)

    return sum_slices_kernel


_BUILD = {"float_mma": _build_float_mma, "int8_dp4a": _build_int8_dp4a, "int8_mma": _build_int8_mma,
          "int8_mma_groups": _build_int8_mma_groups, "sum": _build_sum}


def _kernel(name: str):
    if name not in _kernels:
        _kernels[name] = _BUILD[name]()
    return _kernels[name]


def launch(x: torch.Tensor, w: QuantizedWeight, cfg: QConfig, pre: QuantRows | None = None,
           partial: bool = False) -> torch.Tensor | SplitK:
    """x [M <= max_rows(w), K] @ W.T with one explicit config; an int8-row kernel takes x's rows from `pre` when given.
    A split-K config returns its partials unsummed when `partial`."""
    m, k = x.shape
    n = w.out_features
    if cfg.tiled:
        xq, xs, xsum = (pre.codes, pre.scales, pre.sums) if pre is not None else quantize_rows(x, True)
        out = qtiled.launch(xq, xs, xsum, w, cfg.split, cfg.warps, cfg.block_n // (16 * cfg.warps),
                            cfg.block_k // GROUP, x.dtype, cfg.kernel == "tiled_dp4a_xreg",
                            cfg.kernel == "tiled_mma_streamed")
        return out if cfg.split == 1 else _summed(SplitK(out, x.dtype, (m, n)), partial)
    if cfg.split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
    high = w.high if w.high is not None else w.codes
    grid = (-(-n // cfg.block_n), cfg.split)
    shape = {"FMT": _FMT[w.fmt], "SPLIT": cfg.split, "BLOCK_N": cfg.block_n, "num_warps": cfg.warps,
             "num_stages": cfg.stages, **pdl.launch(x)}
    if cfg.int8_rows:
        xq, xs, xsum = (pre.codes, pre.scales, pre.sums) if pre is not None else quantize_rows(x, split_rows(w))
        if cfg.kernel in ("int8_mma", "int8_mma_groups"):  # bytes: codes as stored, x as int8
            if cfg.kernel == "int8_mma_groups":
                # a tile's code bytes / 128
                lines = _L2_TILES_BEFORE_WAIT * cfg.block_k // (128 if w.fmt == "q8" else 256)
                shape.update(GROUPS=cfg.block_k // GROUP, USE_ASM=x.is_cuda,
                             PREFETCH_LINES=1 << lines.bit_length() - 1 if lines else 0)  # tl.arange's power of two
            _kernel(cfg.kernel)[grid](xq, xs, xsum, w.codes, high, w.scales, out, m, n, k, w.codes.stride(0),
                                      high.stride(0), w.scales.stride(0), **shape)
        else:  # 32-bit words: rows of K bytes (q8) or K/2 (q4/q5), both multiples of 32
            words = w.codes.view(torch.int32)
            _kernel("int8_dp4a")[grid](xq.view(torch.int32), xs, xsum, words, high, w.scales, out, m, n, k,
                                       words.stride(0), high.stride(0), w.scales.stride(0), ROWS=m,
                                       ROWS_P2=max(1, 1 << (m - 1).bit_length()), GROUPS=cfg.block_k // GROUP,
                                       USE_ASM=x.is_cuda, **shape)
    else:
        _kernel(cfg.kernel)[grid](x, w.codes, high, w.scales, out, m, n, k, w.codes.stride(0), high.stride(0),
                                  w.scales.stride(0), BLOCK_M=MAX_ROWS, **shape)
    return out if cfg.split == 1 else _summed(SplitK(out, x.dtype, (m, n)), partial)


# Most K-slices a SplitK hands on unsummed: the residual norm that sums them re-reads them in each program of a
# row, which for many slices (`tiled_dp4a`'s 17 on the 27B's down projection) costs more than the sum launch;
# more slices are summed here, as `choose` timed them.
MAX_PARTIAL_SLICES = 4


def _summed(parts: SplitK, partial: bool) -> torch.Tensor | SplitK:
    """The K-slices' fp32 partials summed and cast in one launch, unless the caller sums them (`partial`)."""
    return parts if partial and parts.parts.shape[0] <= MAX_PARTIAL_SLICES else parts.dense()


def row_bucket(rows: int) -> tuple[int, str]:
    """(largest row count, label) of the bucket a call of `rows` rows takes its tile from: one row (decode), two
    (K=1 verify, two batched sequences) and larger steps by size (3-4, 5-8, 9-16, 17-32 or 33-64 rows: several
    requests' verify rows), since the cost of dp4a tiles grows with the rows and that of tensor-core tiles does
    not (a bucket timed at 4 rows gave 2-row steps a tensor-core tile that was slower for them)."""
    if rows <= 2:
        return rows, "1 row" if rows == 1 else "2 rows"
    low, top = next((lo, hi) for lo, hi in ((3, 4), (5, 8), (9, 16), (17, 32), (33, qtiled.STREAMED_ROWS))
                    if rows <= hi)
    return top, f"{low}-{top} rows"


def choose(rows: int, dtype: torch.dtype, device: torch.device, w: QuantizedWeight) -> QConfig:
    """The fastest candidate for this weight's shape and format on this GPU: from the tiles file when an earlier
    launch chose it, else timed inside a CUDA graph with L2 flushed (`timing.graph_ms`) and recorded; a candidate
    this GPU cannot compile (e.g. too little shared memory) is skipped. The first candidate in the interpreter."""
    top, label = row_bucket(rows)  # decode steps and verify steps of each size: each its own choice
    fmt = f"{w.fmt} tiled" if w.tiled else w.fmt
    key = (w.out_features, w.in_features, fmt, dtype, str(device), label)
    if key not in _chosen:
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        options = candidates(w.out_features, w.in_features, sms, w.fmt, rows, w.tiled)
        if not cuda:
            _chosen[key] = options[0]
        else:
            stored = tiles.key(torch.cuda.get_device_name(device),
                               f"qmatmul {w.out_features}x{w.in_features} {fmt} {dtype} {label}", options)
            choice = tiles.lookup(stored, options)
            if choice is None:  # timed at the bucket's largest row count, whichever size came first
                xt = torch.randn(top, w.in_features, device=device, dtype=dtype)
                choice = min(options, key=lambda c: _time(xt, w, c))
                tiles.record(stored, choice)
            _chosen[key] = choice
    return _chosen[key]


def _time(x: torch.Tensor, w: QuantizedWeight, cfg: QConfig) -> float:
    from .timing import candidate_ms

    return candidate_ms(lambda: launch(x, w, cfg))
