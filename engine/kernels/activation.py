"""SwiGLU's activation, silu(gate) * up, in one kernel (the reference's chunk, silu and multiply are two launches
and a [T, F] temporary; a decode step has one per layer). Roundings as the reference's: silu in fp32, cast to the
model dtype, times up, cast. The reference is `engine.models.layers.silu_mul`.
The gate|up input may be a split-K matmul's unsummed fp32 partials (`SplitK`): they are summed in slice order and
cast as the sum kernel would, so the output is the same to the bit and one launch per layer is saved.
"""
from __future__ import annotations

import torch

from . import runs_here
from .actquant import QuantRows, empty_rows
from .qmatmul import SplitK

_kernel = None
BLOCK = 1024


def usable(x: torch.Tensor | SplitK) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and runs_here(x.device)


def _build():
    import triton.language as tl
    from triton import jit

    # a jit kernel finds the jit functions it calls among its module's globals
    global enter, quantize_groups, summed_slices
    from .pdl import enter
    from .rowquant import quantize_groups
    from .slices import summed_slices

    @jit
    def silu_mul_kernel(x_ptr, o_ptr, q_ptr, qs_ptr, qsum_ptr, F, x_slice, QUANT: tl.constexpr,
                        SPLIT: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        row, pid = tl.program_id(0), tl.program_id(1)
        rf = pid * BLOCK + tl.arange(0, BLOCK)
        ok = rf < F
        dt = o_ptr.dtype.element_ty
        if PARTS > 0:  # fp32 K-slices: summed and cast as `SplitK.dense` does
            gate = summed_slices(x_ptr, row * 2 * F + rf, ok, x_slice, PARTS).to(dt).to(tl.float32)
            up = summed_slices(x_ptr, row * 2 * F + F + rf, ok, x_slice, PARTS).to(dt).to(tl.float32)
        else:
            gate = tl.load(x_ptr + row * 2 * F + rf, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + row * 2 * F + F + rf, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        out = (act * up).to(dt)
        tl.store(o_ptr + row * F + rf, out, mask=ok)
        if QUANT:  # the int8 rows of the down projection this output feeds
            g0 = pid * (BLOCK // 64)
            quantize_groups(tl.reshape(out.to(tl.float32), (BLOCK // 64, 64)), g0,
                            g0 + tl.arange(0, BLOCK // 64) < F // 64, row, F, q_ptr, qs_ptr, qsum_ptr, SPLIT,
                            BLOCK // 64)

    return silu_mul_kernel


def silu_mul(gate_up: torch.Tensor | SplitK, quant_split: bool | None = None) -> torch.Tensor | QuantRows:
    """With `quant_split` set, the output comes with its int8 rows as QuantRows."""
    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    split = isinstance(gate_up, SplitK)
    full, dtype = tuple(gate_up.shape), gate_up.dtype
    f = full[-1] // 2
    x = gate_up.parts if split else gate_up.reshape(-1, 2 * f).contiguous()
    m = x.shape[-2]
    rows = empty_rows((m, f), dtype, x.device) if quant_split is not None else None
    out = rows.x if rows is not None else torch.empty(m, f, dtype=dtype, device=x.device)
    q = rows if rows is not None else QuantRows(out, out, out, out)
    _kernel[(m, -(-f // BLOCK))](x, out, q.codes, q.scales, q.sums, f, m * 2 * f, QUANT=rows is not None,
                                 SPLIT=bool(quant_split), PARTS=x.shape[0] if split else 0, BLOCK=BLOCK,
                                 num_warps=4, **pdl.launch(x))
    shape = (*full[:-1], f)
    return QuantRows(out.view(shape), q.codes, q.scales, q.sums) if rows is not None else out.view(shape)
