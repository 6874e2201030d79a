"""The k largest logits of a few rows and their ids, in two launches: what a sampled pick or verdict looks at.

torch's topk over a 248K-wide row (cut into pieces by `engine.models.rows.row_topk_ids`) is most of a sampled
pick's device time, even for one row. Here each value and its column are one
int64 key (the float's bits made order-preserving as a signed int, then the column), so a bitonic top-k of keys
(`tl.topk`) carries the ids along: the first launch takes the top k of every 8192-wide piece of every row, the
second the top k of each row's pieces' keys. Among tied values which ids are taken is unspecified, as torch's.

The reference: torch's `topk` (values equal, ids holding those values).
"""
from __future__ import annotations

import torch

_kernels = None
PIECE = 8192  # a piece's width: its keys sorted in one program
MAX_MERGE = 4096  # a row's pieces' keys at most (one program sorts them)
MIN_K = 32  # keys kept per piece at least: Triton 3.6's tl.topk fails to compile for k = 1


def _kept(k: int) -> int:
    """Keys each piece keeps for a top k: a power of two, MIN_K at least."""
    import triton

    return max(MIN_K, triton.next_power_of_2(k))


def usable(x: torch.Tensor, k: int) -> bool:
    """Whether the kernels serve the top `k` of x [rows, width] (fp32): k and the merge fit one program's sort."""
    import triton

    k2 = _kept(k)
    pieces = triton.cdiv(x.shape[1], PIECE)
    return x.dtype == torch.float32 and k2 <= min(PIECE, x.shape[1]) and triton.next_power_of_2(pieces * k2) <= \
        MAX_MERGE


def _build():
    import triton
    import triton.language as tl

    global ordered  # a jit kernel finds the jit functions it calls among its module's globals

    @triton.jit
    def ordered(bits):
        """fp32 bits <-> int32 that order as the floats do (negative floats' magnitude bits flipped; its own
        inverse)."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def piece_topk_kernel(x_ptr, key_ptr, width, x_row, K: tl.constexpr, BLOCK: tl.constexpr):
        row, piece = tl.program_id(0), tl.program_id(1)
        cols = piece * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * x_row + cols, mask=cols < width, other=float("-inf"))
        order = ordered(x.to(tl.int32, bitcast=True))
        # columns past the row's end rank below every real one, a -inf logit's too
        keys = tl.where(cols < width, (order.to(tl.int64) << 32) | cols.to(tl.int64), -(2 ** 63))
        top = tl.topk(keys, K)
        tl.store(key_ptr + (row * tl.num_programs(1) + piece) * K + tl.arange(0, K), top)

    @triton.jit
    def merge_topk_kernel(key_ptr, val_ptr, id_ptr, n, k, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        keys = tl.load(key_ptr + row * n + r, mask=r < n, other=-(2 ** 63))
        top = tl.topk(keys, K)
        bits = ordered((top >> 32).to(tl.int32))
        rk = tl.arange(0, K)
        tl.store(val_ptr + row * k + rk, bits.to(tl.float32, bitcast=True), mask=rk < k)
        tl.store(id_ptr + row * k + rk, top & 0xFFFFFFFF, mask=rk < k)

    return piece_topk_kernel, merge_topk_kernel


def row_topk_ids(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, width] fp32 (`usable`) -> (the k largest values of each row [rows, k], largest first; their column
    ids [rows, k], long)."""
    import triton

    global _kernels
    if _kernels is None:
        _kernels = _build()
    piece_topk, merge_topk = _kernels
    rows, width = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    k2 = _kept(k)
    block = min(PIECE, triton.next_power_of_2(width))
    pieces = triton.cdiv(width, block)
    keys = torch.empty(rows, pieces * k2, dtype=torch.int64, device=x.device)
    piece_topk[(rows, pieces)](x, keys, width, x.stride(0), K=k2, BLOCK=block, num_warps=8)
    values = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    merge_topk[(rows,)](keys, values, ids, pieces * k2, k, K=k2, BLOCK=triton.next_power_of_2(pieces * k2),
                        num_warps=8)
    return values, ids
