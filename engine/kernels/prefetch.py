"""L2 prefetch of a tensor's leading bytes: threads that each issue `prefetch.global.L2::evict_last` for 128-byte
lines and go on (or exit), so the lines arrive while the kernels queued after them run. In a launch of its own
(`prefetch_l2`), or at the end of the dp4a matmul's programs (`qdot.kernel_rows` with PF: no launch), which
serves decode steps.

The experiment it serves (`scripts/ab_step.py`, NOTES.md (24)): a decode step's small matmuls run at
1.4-2.4x their read time on the H200 (out projections 11.9 us for 4.9), latency-bound on their first loads, and
between two matmuls the DRAM idles through the norm, conv, GDN or attention launches; a prefetch of the next
matmul's weights issued right after the one before would fill that idle time. Both ways stay on the step's own
stream (session (7) tried a side stream of the graph: 192 extra nodes, slower everywhere). A verify step's
matmuls (tensor-core kernels) take the launch. Portable: sm_80 and later, the RTX 4090's sm_89 included. Not on
the engine's path until measured.
"""
from __future__ import annotations

import torch

from . import runs_here

LINE = 128  # bytes per prefetch: an L2 line
LINES = 1024  # lines per program (8 per thread of 4 warps)

_kernel = None


def _build():
    import triton
    import triton.language as tl

    global prefetch_lines  # a jit kernel finds the jit functions it calls among its globals
    from .qdot import prefetch_lines

    @triton.jit
    def prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, USE_ASM: tl.constexpr):
        prefetch_lines(ptr, tl.program_id(0) * LINES, LINES, n_lines, LINES, USE_ASM)

    return prefetch_kernel


def lines(t: torch.Tensor, limit: int) -> int:
    """How many lines of t's first min(t.nbytes, limit) bytes a prefetch asks for."""
    return -(-min(t.nbytes, limit) // LINE)


def prefetch_l2(t: torch.Tensor, limit: int) -> None:
    """Ask L2 for t's first min(t.nbytes, limit) bytes (t contiguous) in a launch of its own; returns at once,
    reads nothing back."""
    global _kernel
    if not runs_here(t):
        return
    n = lines(t, limit)
    if _kernel is None:
        _kernel = _build()
    _kernel[(-(-n // LINES),)](t.view(torch.uint8), n, LINES=LINES, USE_ASM=t.is_cuda, num_warps=4)
