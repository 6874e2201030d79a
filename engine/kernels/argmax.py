"""Argmax along the rows of a few rows of logits, and the greedy verdict of a speculative round, in two launches.

torch's way (`engine.models.rows.row_argmax`, then the verdict in `Sampler._greedy_verdict`) takes ~14 small
launches per round; each costs a few microseconds of device time whatever its size. Here the first launch cuts
every row into up to 64 pieces of up to 4096 elements spread over the GPU (each piece's max and its first
index); the second, one program, takes each row's first maximum from its pieces' and, for a verdict, compares
the rows' picks with the drafts.

The references: `engine.models.rows.row_argmax`'s torch path (torch's argmax, ties to the first index) and
`Sampler._greedy_verdict`.
"""
from __future__ import annotations

import torch

_kernels = None
_CHUNK = 4096  # a piece's width at most, in elements: loaded at once
_PIECES = 64  # pieces per row at most


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def piece_max_kernel(x_ptr, val_ptr, idx_ptr, width, piece_width, P, BLOCK: tl.constexpr):
        row, piece = tl.program_id(0), tl.program_id(1)
        start = piece * piece_width
        stop = tl.minimum(start + piece_width, width)
        best = tl.full((), float("-inf"), tl.float32)
        where = start
        for lo in range(start, stop, BLOCK):
            cols = lo + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row.to(tl.int64) * width + cols, mask=cols < stop, other=float("-inf"))
            x = x.to(tl.float32)
            m = tl.max(x, 0)
            at = lo + tl.argmax(x, 0, tie_break_left=True)
            where = tl.where(m > best, at, where)  # strictly greater: an earlier chunk's equal max stays first
            best = tl.maximum(m, best)
        tl.store(val_ptr + row * P + piece, best)
        tl.store(idx_ptr + row * P + piece, where)

    @triton.jit
    def verdict_kernel(val_ptr, idx_ptr, drafts_ptr, out_ptr, rows, P, k,
                       ROWS: tl.constexpr, PIECES: tl.constexpr, VERDICT: tl.constexpr):
        r = tl.arange(0, ROWS)
        c = tl.arange(0, PIECES)
        ok = (r[:, None] < rows) & (c[None, :] < P)
        vals = tl.load(val_ptr + r[:, None] * P + c[None, :], mask=ok, other=float("-inf"))
        idxs = tl.load(idx_ptr + r[:, None] * P + c[None, :], mask=ok, other=0)
        m = tl.max(vals, 1)
        # the first piece holding the row's max holds its first max
        piece = tl.min(tl.where(vals == m[:, None], c[None, :], PIECES), 1)
        best = tl.sum(tl.where(c[None, :] == piece[:, None], idxs, 0), 1).to(tl.int64)
        if VERDICT:  # out: [drafts kept, the token after them, the drafts]
            d = tl.load(drafts_ptr + r, mask=r < k, other=0)
            n = tl.min(tl.where((r < k) & (best != d), r, k), 0)
            token = tl.sum(tl.where(r == n, best, 0), 0)
            tl.store(out_ptr, n.to(tl.int64))
            tl.store(out_ptr + 1, token)
            tl.store(out_ptr + 2 + r, d, mask=r < k)
        else:
            tl.store(out_ptr + r, best, mask=r < rows)

    return piece_max_kernel, verdict_kernel


def _run(x: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    import triton

    global _kernels
    if _kernels is None:
        _kernels = _build()
    piece_max, verdict = _kernels
    x = x.contiguous()
    rows, width = x.shape
    p = min(_PIECES, triton.cdiv(width, _CHUNK))
    piece_width = triton.cdiv(width, p)
    val = torch.empty(rows, p, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, p, dtype=torch.int32, device=x.device)
    piece_max[(rows, p)](x, val, idx, width, piece_width, p,
                         BLOCK=min(_CHUNK, triton.next_power_of_2(piece_width)), num_warps=4)
    k = 0 if drafts is None else drafts.shape[0]
    out = torch.empty(rows if drafts is None else k + 2, dtype=torch.long, device=x.device)
    verdict[(1,)](val, idx, drafts if drafts is not None else out, out, rows, p, k,
                  ROWS=triton.next_power_of_2(rows), PIECES=triton.next_power_of_2(p), VERDICT=drafts is not None,
                  num_warps=1)
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, width] -> [rows] (long): each row's argmax, the first of tied maxima."""
    return _run(x, None)


def greedy_verdict(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """logits [k + 1, vocab], drafts [k] (long, k >= 1) -> [k + 2] (long): how many drafts lead the rows'
    argmaxes (each draft kept while it is its row's argmax), the argmax of the row after them, the drafts."""
    return _run(logits, drafts.long())
