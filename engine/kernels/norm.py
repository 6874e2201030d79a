"""Fused RMSNorm: one kernel per call instead of the reference's ~9 (casts, square, mean, rsqrt, scale), which
matters in decode steps where the tensors are a few rows and launches are the cost. Both weight orders the
models use: zero-centred ((1 + w) applied in fp32, then cast: Qwen3.5) and plain (cast, then w: llama).
The same kernel takes in what surrounds a norm in a decoder step, each a launch or several saved:
- a residual add before it (the sum, rounded to the model dtype, is stored too: it is the next residual), where
  the residual may be a split-K matmul's unsummed fp32 partials (one sum launch saved per projection);
- a SiLU gate after it (Qwen3.5's GDN output: plain-order norm of the fp32 read-out, times silu(z));
- partial NeoX RoPE after it (the per-head q/k norms of gated attention), one row per (token, head); q's heads
  and k's, each with its own weight, in one launch (a second tensor's rows follow the first's).
Every rounding of the reference (`engine.models.layers`) is made in the same place, so outputs agree with it
to the last bit up to fp32 summation order.
"""
from __future__ import annotations

import torch

from . import runs_here
from .actquant import QuantRows, empty_rows
from .qmatmul import SplitK

_kernel = None


def usable(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel serves x normed by `weight` into `dtype` (x's own by default; the weight's dtype)."""
    dtype = dtype or x.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != dtype:
        return False  # fp64 oracle runs take the reference
    return runs_here(x)


def _build():
    import triton.language as tl
    from triton import jit

    # a jit kernel finds the jit functions it calls among its module's globals
    global enter, quantize_groups, row_values, silu_gated, summed_slices, weighted
    from .pdl import enter
    from .rownorm import silu_gated, weighted
    from .rowquant import quantize_groups
    from .slices import summed_slices

    @jit
    def row_values(x_row, r_ptr, s_ptr, row, D, r_slice, rd, ok, dt, RESIDUAL: tl.constexpr, STORE: tl.constexpr):
        """The row's columns `rd` as the norm reads them: x cast to the model dtype (as the reference), plus the
        residual (a split-K matmul's fp32 partials summed and cast as its own sum kernel does); with STORE the
        sum, the next residual, is stored."""
        x = tl.load(x_row + rd, mask=ok, other=0.0).to(dt)
        if RESIDUAL == 1:
            x = x + tl.load(r_ptr + row * D + rd, mask=ok, other=0.0)
        elif RESIDUAL > 1:
            x = x + summed_slices(r_ptr, row * D + rd, ok, r_slice, RESIDUAL).to(dt)
        if RESIDUAL and STORE:
            tl.store(s_ptr + row * D + rd, x, mask=ok)
        return x

    @jit
    def rms_norm_kernel(x_ptr, r_ptr, s_ptr, z_ptr, cos_ptr, sin_ptr, w_ptr, o_ptr, q_ptr, qs_ptr, qsum_ptr,
                        D, HEADS, ROT, eps, x_tok, x_head, z_tok, z_head, r_slice,
                        x2_ptr, w2_ptr, HEADS2, x2_tok, x2_head, ROWS1,
                        ZERO_CENTRED: tl.constexpr, RESIDUAL: tl.constexpr, GATE: tl.constexpr,
                        ROPE: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
                        SLICE: tl.constexpr, PAIR: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        row, part = tl.program_id(0), tl.program_id(1)
        t, h = row // HEADS, row % HEADS  # rows are (token, head) pairs of strided views
        x_row = x_ptr + t * x_tok + h * x_head
        if PAIR:  # rows past ROWS1 are the second tensor's (token, head) pairs, normed by its own weight
            second = row >= ROWS1
            t = tl.where(second, (row - ROWS1) // HEADS2, t)
            x_row = tl.where(second, x2_ptr + t * x2_tok + (row - ROWS1) % HEADS2 * x2_head, x_row)
            w_ptr = tl.where(second, w2_ptr, w_ptr)
        # the row as [BLOCK_D // COLS, COLS] tiles (COLS = 64 when D allows): the int8 groups of 64 are then rows
        # of the tile as loaded; a 1-D row reshaped into groups costs a layout conversion per call. A program
        # writes SLICE columns of its row (all of them when SLICE = BLOCK_D); where a wide row is split over
        # several programs, each also reads the whole row for its sum of squares (from L2, in the same order)
        COLS: tl.constexpr = 64 if BLOCK_D >= 64 else BLOCK_D
        tile = tl.arange(0, SLICE // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        rd = part * SLICE + tile
        ok = rd < D
        dt = o_ptr.dtype.element_ty
        x = row_values(x_row, r_ptr, s_ptr, row, D, r_slice, rd, ok, dt, RESIDUAL, True)
        whole = x.to(tl.float32)
        if SLICE < BLOCK_D:
            rf = tl.arange(0, BLOCK_D // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
            whole = row_values(x_row, r_ptr, s_ptr, row, D, r_slice, rf, rf < D, dt, RESIDUAL, False).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(tl.sum(whole * whole, 1), 0) / D + eps)
        x = x.to(tl.float32)
        w = tl.load(w_ptr + rd, mask=ok, other=0.0).to(tl.float32)
        out = weighted(x, rstd, w, dt, ZERO_CENTRED)
        if GATE:
            out = silu_gated(out, tl.load(z_ptr + t * z_tok + h * z_head + rd, mask=ok, other=0.0).to(tl.float32))
        if ROPE:
            half = ROT // 2
            partner = tl.where(rd < half, rd + half, rd - half)
            in_rot = rd < ROT
            xp = tl.load(x_row + partner, mask=in_rot, other=0.0).to(dt).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
            other = weighted(xp, rstd, wp, dt, ZERO_CENTRED)
            c = tl.load(cos_ptr + t * ROT + rd, mask=in_rot, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + t * ROT + rd, mask=in_rot, other=0.0).to(tl.float32)
            sign = tl.where(rd < half, -1.0, 1.0)
            rotated = (out * c).to(dt).to(tl.float32) + (sign * other * s).to(dt).to(tl.float32)
            out = tl.where(in_rot, rotated, out)
        out = out.to(dt)
        tl.store(o_ptr + row * D + rd, out, mask=ok)
        if QUANT:  # the int8 rows of the matmul this output feeds: token t's row of HEADS * D columns
            g = part * (SLICE // 64) + tl.arange(0, SLICE // COLS)
            quantize_groups(out.to(tl.float32), h * (D // 64) + part * (SLICE // 64), g < D // 64, t, HEADS * D,
                            q_ptr, qs_ptr, qsum_ptr, SPLIT, SLICE // COLS)

    return rms_norm_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [tokens, heads, D] with unit stride along D (a view where it can be: split projections stay
    uncopied)."""
    t = t if t.dim() == 3 else t.reshape(-1, 1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


SLICE_COLS = 512  # columns each program writes of a row wider than this (see _launch)
# rows at and past which a program takes a whole row however wide: the rows alone then fill the GPU, and a sliced
# row's programs each read the whole of it again for its sum of squares (10x a 5120-wide row's reads)
WHOLE_ROWS = 256


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, dtype: torch.dtype,
            residual: torch.Tensor | SplitK | None = None, gate: torch.Tensor | None = None,
            rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
            quant_split: bool | None = None, warps: int | None = None, slice_cols: int | None = None,
            pair: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor | QuantRows, torch.Tensor | None]:
    """x [..., D], or [T, H, D] (any strides but the last) when its rows are heads; gate shaped as x. With
    `quant_split` set, the output comes with its int8 rows (split into even/odd planes or not) as QuantRows.
    A row wider than `slice_cols` (SLICE_COLS unless given) is written by several programs where the launch has
    fewer than WHOLE_ROWS rows: one program per 5120-wide row quantized it serially, slower than the norm and a
    separate quantize launch together; each slice's program reads the whole row only for its sum of squares.
    `warps` per program unless given: 8 for a sliced row, else one per 256 columns up to 16 (the best of
    `scripts/bench_step_kernels.py --only norm`).
    `pair` = (x2 [T, H2, D], its weight): x2's heads are normed (and roped) by the same launch; the second value
    returned is then x2's result instead of the residual sum."""
    import triton

    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    d = x.shape[-1]
    x3 = _rows(x)
    z3 = _rows(gate) if gate is not None else x3
    tokens, heads = x3.shape[0], x3.shape[1]
    if d % 64:
        quant_split = None  # int8 groups of 64 would straddle heads
    quant = empty_rows((tokens, heads * d), dtype, x.device) if quant_split is not None else None
    x2 = _rows(pair[0]) if pair is not None else x3
    rows2 = x2.shape[0] * x2.shape[1] if pair is not None else 0
    both = torch.empty(tokens * heads + rows2, d, dtype=dtype, device=x.device) if quant is None else None
    out = quant.x if quant is not None else both[:tokens * heads]
    summed = torch.empty_like(out) if residual is not None else None
    slices = 0 if residual is None else residual.parts.shape[0] if isinstance(residual, SplitK) else 1
    r2 = out if residual is None else residual.parts if slices > 1 else residual.reshape(-1, d).contiguous()
    cos, sin, rot = rope if rope is not None else (out, out, 0)
    block = triton.next_power_of_2(d)
    width = min(block, max(64, triton.next_power_of_2(slice_cols or SLICE_COLS)))
    if rope is not None or d % 64 or tokens * heads + rows2 >= WHOLE_ROWS:
        width = block  # RoPE pairs columns across the row; a slice is whole groups of 64
    q = quant if quant is not None else QuantRows(out, out, out, out)
    _kernel[(tokens * heads + rows2, -(-d // width))](
        x3, r2, summed if summed is not None else out, z3, cos, sin, weight, out, q.codes, q.scales, q.sums, d,
        heads, rot, eps, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), tokens * d,
        x2, pair[1] if pair is not None else weight, x2.shape[1], x2.stride(0), x2.stride(1), tokens * heads,
        ZERO_CENTRED=zero_centred, RESIDUAL=slices, GATE=gate is not None, ROPE=rope is not None,
        QUANT=quant is not None, SPLIT=bool(quant_split), BLOCK_D=block, SLICE=width, PAIR=pair is not None,
        num_warps=warps or (8 if width < block else max(1, min(16, block // 256))), **pdl.launch(x))
    if pair is not None:
        return out.view(x.shape), both[tokens * heads:].view(pair[0].shape)
    summed = summed.view(x.shape) if summed is not None else None
    if quant is not None:  # as the matmul reads it: a token's heads side by side
        return QuantRows(out.view(tokens, heads * d), quant.codes, quant.scales, quant.sums), summed
    return out.view(x.shape), summed


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | SplitK | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool, quant_split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | QuantRows]:
    """(x + residual, its norm); no add when residual is None; a SplitK residual's partials are summed here."""
    out, summed = _launch(x, weight, eps, zero_centred, x.dtype, residual=residual, quant_split=quant_split)
    return (summed if summed is not None else x), out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype, quant_split: bool | None = None) -> torch.Tensor | QuantRows:
    """Plain-order norm of the heads of x [T, H, D] cast to `dtype`, times silu(gate) (fp32), cast to `dtype`:
    [T, H * D]."""
    out = _launch(x, weight, eps, False, dtype, gate=gate, quant_split=quant_split)[0]
    return out if isinstance(out, QuantRows) else out.reshape(x.shape[0], -1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, cos: torch.Tensor,
                  sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Norm of each head of x [T, H, D], then NeoX RoPE on its first `rotary_dim` dims (cos/sin [T, rotary_dim])."""
    return _launch(x, weight, eps, zero_centred, x.dtype, rope=(cos.contiguous(), sin.contiguous(), rotary_dim))[0]


def rms_norm_rope_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor,
                       rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_rope` of q [T, H, D] and of k [T, H2, D] (each by its own weight) in one launch."""
    return _launch(q, q_weight, eps, zero_centred, q.dtype, rope=(cos.contiguous(), sin.contiguous(), rotary_dim),
                   pair=(k, k_weight))
