"""Causal depthwise conv1d + SiLU with its state update, in one kernel: the reference concatenates the state and x,
convolves, applies SiLU and copies the new state (four or more launches per GDN layer, and for a prefill chunk
copies of the whole [T, C] window into the layouts torch's conv takes and back). In a decode/verify step
(T <= MAX_T) each program owns BLOCK_C channels for all T tokens (computed together, tap by tap), reads the old
state before it writes the new one, and writes the whole window [K-1+T, C] only when a verify step keeps it for
rollback. A longer chunk is cut into blocks of PREFILL_T tokens too, a program each; the new state (the chunk's
last K-1 inputs) is then copied after the kernel, which other programs' reads of the old state must precede.
fp32 accumulation, rounded to the model dtype before the SiLU as the reference's conv output is.
The reference is `engine.models.gdn.causal_conv1d`.
"""
from __future__ import annotations

import torch

from . import runs_here

MAX_T = 16  # the most tokens one program computes (a decode/verify step's, with the state updated in the kernel)
PREFILL_T = 16  # tokens per program of a longer chunk
BLOCK_C = 128  # 80 programs over the 27B's 10,240 channels (40 at 256 left most SMs idle)
_kernel = None


def usable(x: torch.Tensor, state: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32) and state.dtype == x.dtype and runs_here(x)


def _build():
    import triton.language as tl
    from triton import jit

    global enter  # a jit kernel finds the jit functions it calls among its module's globals
    from .pdl import enter

    @jit
    def conv_kernel(x_ptr, state_ptr, w_ptr, o_ptr, win_ptr, T, C, x_stride, KW: tl.constexpr, KW_P2: tl.constexpr,
                    WINDOW: tl.constexpr, BLOCK_C: tl.constexpr, T_P2: tl.constexpr, ROWS_P2: tl.constexpr,
                    STATE: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        rc = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = rc < C
        dt = o_ptr.dtype.element_ty
        # T_P2 outputs at once, one tap per iteration: each tap's [T_P2, BLOCK_C] rows of the window are loaded
        # independently of the others (a loop over tokens made a verify step wait on one load after another)
        rt = tl.program_id(1).to(tl.int64) * T_P2 + tl.arange(0, T_P2)  # 64-bit: a long chunk's offsets pass 2**31
        m = (rt < T)[:, None] & c_ok[None, :]
        acc = tl.zeros((T_P2, BLOCK_C), tl.float32)
        for j in tl.static_range(KW):
            idx = rt + j  # window row of token t's tap j: state rows first, then x rows
            old = (idx < KW - 1)[:, None]
            win = tl.load(state_ptr + idx[:, None] * C + rc[None, :], mask=m & old, other=0.0) + \
                tl.load(x_ptr + (idx - (KW - 1))[:, None] * x_stride + rc[None, :], mask=m & ~old, other=0.0)
            acc += win.to(tl.float32) * tl.load(w_ptr + rc * KW + j, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(dt).to(tl.float32)
        tl.store(o_ptr + rt[:, None] * C + rc[None, :], (acc / (1.0 + tl.exp(-acc))).to(dt), mask=m)
        if WINDOW:
            rr = tl.arange(0, ROWS_P2)
            mr = (rr < KW - 1 + T)[:, None] & c_ok[None, :]
            old = (rr < KW - 1)[:, None]
            v = tl.load(state_ptr + rr[:, None] * C + rc[None, :], mask=mr & old, other=0.0) + \
                tl.load(x_ptr + (rr - (KW - 1))[:, None] * x_stride + rc[None, :], mask=mr & ~old, other=0.0)
            tl.store(win_ptr + rr[:, None] * C + rc[None, :], v.to(dt), mask=mr)
        if STATE:  # the new state: window rows T .. T+KW-2, loaded in one tensor before the first store overwrites
            rj = tl.arange(0, KW_P2)
            idx = T + rj
            keep = (rj < KW - 1)[:, None] & c_ok[None, :]
            old = idx < KW - 1
            new = tl.load(state_ptr + idx[:, None] * C + rc[None, :], mask=keep & old[:, None], other=0.0) + \
                tl.load(x_ptr + (idx - (KW - 1))[:, None] * x_stride + rc[None, :], mask=keep & ~old[:, None],
                        other=0.0)
            tl.debug_barrier()
            tl.store(state_ptr + rj[:, None] * C + rc[None, :], new, mask=keep)

    return conv_kernel


def conv_update_(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None,
                 block_c: int = BLOCK_C, warps: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C], state [K-1, C] (updated in place), weight [C, K] -> silu(conv) [T, C] (into `out` when given: a
    verify step keeps it); the window [K-1+T, C] is written into `window` when given (a verify step's,
    contiguous). `block_c` (channels per program) and `warps`: the launch shape (scripts/bench_step_kernels.py
    times others)."""
    import triton

    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    t, c = x.shape
    kw = weight.shape[1]
    assert state.is_contiguous() and state.dtype == x.dtype
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    assert out.is_contiguous() and out.shape == (t, c) and out.dtype == x.dtype
    assert window is None or (window.is_contiguous() and window.shape == (kw - 1 + t, c))
    whole = t <= MAX_T  # one program over every token, the state moved on inside
    assert whole or window is None, "a step that keeps its window takes at most MAX_T tokens"
    per = triton.next_power_of_2(t) if whole else PREFILL_T
    _kernel[(triton.cdiv(c, block_c), triton.cdiv(t, per))](
        x, state, weight.contiguous(), out, window if window is not None else out, t, c, x.stride(0), KW=kw,
        KW_P2=triton.next_power_of_2(kw), WINDOW=window is not None, BLOCK_C=block_c, T_P2=per,
        ROWS_P2=triton.next_power_of_2(kw - 1 + t) if whole else 1, STATE=whole, num_warps=warps, **pdl.launch(x))
    if not whole:  # the chunk's last K-1 inputs (t > MAX_T >= K-1), after every program has read the old state
        state.copy_(x[t - (kw - 1):])
    return out
