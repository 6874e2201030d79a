"""SwiGLU's activation, silu(gate) * up, in one kernel (the reference's chunk, silu and multiply are two launches
and a [T, F] temporary; a decode step has one per layer). Roundings as the reference's: silu in fp32, cast to the
model dtype, times up, cast. The reference is `engine.models.layers.silu_mul`.
"""
from __future__ import annotations

import torch

from . import runs_here

_kernel = None
BLOCK = 1024


def usable(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and runs_here(x)


def _build():
    import triton.language as tl
    from triton import jit

    @jit
    def silu_mul_kernel(x_ptr, o_ptr, F, BLOCK: tl.constexpr):
        row, pid = tl.program_id(0), tl.program_id(1)
        rf = pid * BLOCK + tl.arange(0, BLOCK)
        ok = rf < F
        dt = o_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * 2 * F + rf, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * F + F + rf, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        tl.store(o_ptr + row * F + rf, (act * up).to(dt), mask=ok)

    return silu_mul_kernel


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    f = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * f).contiguous()
    out = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    _kernel[(x.shape[0], -(-f // BLOCK))](x, out, f, BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], f)
