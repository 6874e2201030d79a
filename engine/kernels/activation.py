"""SwiGLU's activation, silu(gate) * up, in one kernel (the reference's chunk, silu and multiply are two launches
and a [T, F] temporary; a decode step has one per layer). Roundings as the reference's: silu in fp32, cast to the
model dtype, times up, cast. The reference is `engine.models.layers.silu_mul`.
"""
from __future__ import annotations

import torch

from . import runs_here
from .actquant import QuantRows, empty_rows

_kernel = None
BLOCK = 1024


def usable(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and runs_here(x)


def _build():
    import triton.language as tl
    from triton import jit

    global quantize_groups  # a jit kernel finds the jit functions it calls among its module's globals
    from .rowquant import quantize_groups

    @jit
    def silu_mul_kernel(x_ptr, o_ptr, q_ptr, qs_ptr, qsum_ptr, F, QUANT: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK: tl.constexpr):
        row, pid = tl.program_id(0), tl.program_id(1)
        rf = pid * BLOCK + tl.arange(0, BLOCK)
        ok = rf < F
        dt = o_ptr.dtype.element_ty
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


def silu_mul(gate_up: torch.Tensor, quant_split: bool | None = None) -> torch.Tensor | QuantRows:
    """With `quant_split` set, the output comes with its int8 rows as QuantRows."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    f = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * f).contiguous()
    rows = empty_rows((x.shape[0], f), x.dtype, x.device) if quant_split is not None else None
    out = rows.x if rows is not None else torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    q = rows if rows is not None else QuantRows(out, out, out, out)
    _kernel[(x.shape[0], -(-f // BLOCK))](x, out, q.codes, q.scales, q.sums, f, QUANT=rows is not None,
                                          SPLIT=bool(quant_split), BLOCK=BLOCK, num_warps=4)
    shape = (*gate_up.shape[:-1], f)
    return QuantRows(out.view(shape), q.codes, q.scales, q.sums) if rows is not None else out.view(shape)
