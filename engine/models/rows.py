"""Reductions along the vocabulary of a few rows of logits (a verify step's, a drafter's block), spread over the
whole GPU: torch reduces each row of a [rows, vocab] tensor in one block, so an argmax or a cumsum over a 248K
vocabulary keeps most of the GPU idle for tens of microseconds per row. Each row is cut into
up to 64 equal pieces, reduced piece by piece, then the pieces' results. Same results as torch's own ops (ties
and all), up to the order of floating-point sums."""
from __future__ import annotations

import torch

from ..kernels import argmax as argmax_kernel
from ..kernels import runs_here
from ..kernels import topk as topk_kernel


def pieces(width: int, at_least: int = 1) -> int:
    """How many equal pieces a row of `width` is cut into (1: too short, or no divisor)."""
    return next((p for p in (64, 32, 16, 8, 4, 2) if width % p == 0 and width // p >= max(1024, at_least)), 1)


def _cut(x: torch.Tensor, at_least: int = 1) -> torch.Tensor:
    rows, width = x.shape
    p = pieces(width, at_least)
    return x.view(rows, p, width // p)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, width] -> [rows]: each row's argmax, the first of tied maxima as torch's. On a GPU, in two
    launches (kernels/argmax.py) instead of five."""
    if runs_here(x):
        return argmax_kernel.row_argmax(x)
    cut = _cut(x)
    if cut.shape[1] == 1:
        return x.argmax(-1)
    best, where = cut.max(-1)
    piece = best.argmax(-1, keepdim=True)  # the first piece holding the row's max: its first max comes first
    return (piece * cut.shape[2] + where.gather(1, piece))[:, 0]


def row_max(x: torch.Tensor) -> torch.Tensor:
    """[rows, width] -> [rows, 1]."""
    return _cut(x).amax(-1).amax(-1, keepdim=True)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """[rows, width] -> [rows, 1]."""
    return _cut(x).sum(-1).sum(-1, keepdim=True)


def row_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, width] -> the k largest values of each row [rows, k], largest first (each piece's k largest hold
    the row's)."""
    return row_topk_ids(x, k)[0]


def row_topk_ids(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_topk` and the values' column ids [rows, k] (among tied values, which ids is unspecified). On a GPU,
    fp32 rows and k up to 128 (at a 248K vocabulary) take two launches (kernels/topk.py) instead of torch's
    topk; never in the interpreter, where its sorts take ~0.3 s a call and the sampler's tests call it thousands
    of times (the kernel's own test runs it there)."""
    if x.is_cuda and topk_kernel.usable(x, k):
        return topk_kernel.row_topk_ids(x, k)
    cut = _cut(x, at_least=k)
    if cut.shape[1] == 1:
        return x.topk(k)
    values, ids = cut.topk(k)
    ids = ids + torch.arange(0, x.shape[1], cut.shape[2], device=x.device)[:, None]  # column ids in the row
    values, best = values.flatten(1).topk(k)
    return values, ids.flatten(1).gather(1, best)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[rows, width] -> the inclusive cumulative sums along each row."""
    cut = _cut(x)
    if cut.shape[1] == 1:
        return x.cumsum(-1)
    within = cut.cumsum(-1)
    ahead = within[:, :, -1].cumsum(-1) - within[:, :, -1]  # the pieces before each piece
    return (within + ahead[:, :, None]).flatten(1)
