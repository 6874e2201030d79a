"""GGUF weights on a GPU (`quant/gguf_blocks.py`: Q8_0, Q4_K, Q5_K and Q6_K parts kept as the file stores them,
never re-quantized): the matmul of a decode or verify step, a prefill's, and the embedding lookup. The kernels
and the block layouts are in `gguf_kernels.py`.

- Up to MAX_ROWS rows of x (a decode step, several requests' verify rows): `gguf_matmul_kernel`, which decodes
  each program's weight blocks in registers and multiplies x as it is (no int8 rounding of x) in fp32: `mma` on
  tensor cores, `fma` on CUDA cores for one row. A program owns `block_n` output features and one K-slice
  (split-K when N alone gives too few programs to fill the GPU; the slices' fp32 partials go to the caller
  unsummed as qmatmul's `SplitK` where it sums them, else one launch sums them).
- More rows (a prefill chunk): blocks of weight rows dequantized to x's dtype into a scratch of at most
  `dequant.SCRATCH_ELEMENTS` values (the memory plan counts it), then cuBLAS, as `dequant.dequant_linear` does for
  q8/q5/q4 weights.
- Embedding rows: the rows of the ids dequantized, each value computed as gguf.quants computes it, then cast.
A weight stacked from several parts (a fused projection whose parts the file quantized differently, or a float
part as F32 rows) runs one launch per part into its columns of the output.

Which kernel, width, warps and K split run is chosen per (part shape, type, x dtype, GPU, row bucket) by timing a
short candidate list on first use, each inside a CUDA graph with L2 flushed, as `qmatmul.choose` does (before any
graph capture: the engine's warm-up runs every step size eagerly first); choices persist in the tiles file. The
reference is `x @ gguf_blocks.dequantize(w).T` (`linear_reference`): the dequantized rows equal it exactly, the
matmul is within fp32 rounding of it (the prefill path: of it with the weights rounded to x's dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGMLQuantizationType as Q

from ..quant.gguf_blocks import GPU_TYPES, BlockRows, GGUFWeight, dequantize
from . import pdl, tiles
from .dequant import SCRATCH_ELEMENTS
from .qmatmul import SplitK, _summed, row_bucket

MAX_ROWS = 64  # the most rows the matmul kernel takes (several requests' verify rows); more are a prefill
DEQUANT_ROWS = 16  # weight rows per program of the dequant kernel
_WIDE = {Q.Q8_0: torch.int16, Q.Q4_K: torch.int32, Q.Q5_K: torch.int32, Q.Q6_K: torch.int16}


def linear_reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(w, x.dtype).to(x.device))


@dataclass(frozen=True)
class GConfig:
    kernel: str  # "mma" (tensor cores, x rows padded to 16) or "fma" (CUDA cores, one row)
    block_n: int
    warps: int
    split: int = 1


# (kernel, block_n, warps, serves 1 row, serves 2-16 rows, serves 17-64 rows): `fma` multiplies one row; `mma`'s
# cost barely grows with the rows. Register counts from ptxas (no GPU needed): up to 16 rows none of these spill
# on sm_89 or sm_90 (Q8_0's 64-wide `mma` a few bytes); past 16 rows `mma` 64 wide with 4 warps spills heavily
# on both, and of the two kept, 128 wide spills on sm_90 and 32 wide (Q5_K) on sm_89. Which is fastest depends on
# the GPU and the type: the per-GPU timing picks among them.
_SHAPES = (("fma", 32, 4, True, False, False), ("fma", 64, 4, True, False, False), ("mma", 32, 4, True, True, True),
           ("mma", 64, 4, False, True, False), ("mma", 128, 8, False, True, True))
_PROGRAMS_PER_SM = (2, 8)  # the K splits tried: enough programs for about 2, or 8, per SM


def _units(qtype: int, k: int) -> tuple[int, int]:
    """(Q8_0 blocks per loop iteration, loop iterations over K): a K-quant iteration is one block of 256 weights;
    Q8_0 takes 8 blocks of 32 at a time where K allows."""
    if qtype == Q.Q8_0:
        per = 8 if k % 256 == 0 else 1
        return per, k // (32 * per)
    return 1, k // 256


def candidates(n: int, k: int, sms: int, qtype: int, rows: int | None = None) -> list[GConfig]:
    """The launch shapes tried on first use for `rows` rows (every one when rows is None: tests, sweeps)."""
    units = _units(qtype, k)[1]
    out: list[GConfig] = []
    for kernel, block_n, warps, one, few, more in _SHAPES:
        if rows is not None and not (one if rows == 1 else few if rows <= 16 else more):
            continue
        blocks = -(-n // block_n)
        for per_sm in _PROGRAMS_PER_SM:
            split = 1
            while blocks * split < per_sm * sms and 2 * split <= min(units, 32):
                split *= 2
            cfg = GConfig(kernel, block_n, warps, split)
            if cfg not in out:
                out.append(cfg)
    return out


_chosen: dict[tuple, GConfig] = {}


def choose(rows: int, dtype: torch.dtype, device: torch.device, part: BlockRows, k: int) -> GConfig:
    """The fastest candidate for this part's shape and type on this GPU (as `qmatmul.choose`: from the tiles file,
    else each candidate that computes the product here (`_agrees`) timed inside a CUDA graph with L2 flushed, and
    recorded); the first candidate in the interpreter."""
    top, label = row_bucket(rows)
    name = Q(part.qtype).name
    key = (part.rows, k, name, dtype, str(device), label)
    if key not in _chosen:
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        options = candidates(part.rows, k, sms, part.qtype, top)
        if not cuda:
            _chosen[key] = options[0]
        else:
            stored = tiles.key(torch.cuda.get_device_name(device), f"gguf {part.rows}x{k} {name} {dtype} {label}",
                               options)
            choice = tiles.lookup(stored, options)
            if choice is None:  # timed at the bucket's largest row count, whichever size came first
                xt = torch.randn(top, k, device=device, dtype=dtype)
                agreeing = [c for c in options if _agrees(xt, part, k, c)]
                if not agreeing:
                    raise RuntimeError(f"no {name} matmul tile computes a {part.rows}x{k} product on this GPU")
                choice = min(agreeing, key=lambda c: _time(xt, part, k, c))
                tiles.record(stored, choice)
            _chosen[key] = choice
    return _chosen[key]


# Weight rows at each end of a part whose products the check compares (the first tiles, and the last, partial
# one), and how far any x row of them may sit from x @ the dequantized rows: fp32 sums in another order, x's bf16
# rounding of the decoded weights in the mma kernel, stay far below it; a miscompiled tile or a bad mask does not.
CHECK_ROWS, AGREEMENT = 512, 0.02


def _agrees(x: torch.Tensor, part: BlockRows, k: int, cfg: GConfig) -> bool:
    """Whether a candidate computes this product here (against the dequantize kernel's rows, a separate decode,
    multiplied by torch): one that does not, or cannot run, is never chosen, however fast."""
    try:
        out = launch(x, part, k, cfg)
        got = (out.dense() if isinstance(out, SplitK) else out).float()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - a tile this GPU cannot compile (Triton raises several types)
        return False
    for start in sorted({0, max(0, part.rows - CHECK_ROWS)}):
        stop = min(part.rows, start + CHECK_ROWS)
        want = x.float() @ dequantize_rows(part, k, torch.float32, start, stop).T
        worst = ((got[:, start:stop] - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max()
        if not worst.item() < AGREEMENT:
            return False
    return True


def _time(x: torch.Tensor, part: BlockRows, k: int, cfg: GConfig) -> float:
    """A candidate's graph time, its K-slices summed (as `qmatmul` times them)."""
    from .timing import candidate_ms

    def call():
        out = launch(x, part, k, cfg)
        return out.dense() if isinstance(out, SplitK) else out

    return candidate_ms(call)


def _kernels():
    from . import gguf_kernels  # imports Triton (its jit helpers must be module globals)

    return gguf_kernels


def _wide(part: BlockRows) -> torch.Tensor:
    """The part's bytes as the 32- or 16-bit words its block fields are read as (rows hold whole blocks, so a
    row's bytes divide into them)."""
    if part.qtype not in GPU_TYPES:
        raise ValueError(f"no GPU kernel reads GGUF {Q(part.qtype).name} blocks")
    return part.data.view(_WIDE[part.qtype])


def launch(x: torch.Tensor, part: BlockRows, k: int, cfg: GConfig, out: torch.Tensor | None = None
           ) -> torch.Tensor | SplitK:
    """x [M <= MAX_ROWS, K] @ part.T with one explicit config: into `out` (a [M, part.rows] view, rows apart by its
    stride) when given, else a new tensor, or the K-slices' unsummed partials (`SplitK`) when the config splits K."""
    m, n = x.shape[0], part.rows
    q8_blocks, units = _units(part.qtype, k)
    mma = cfg.kernel == "mma"
    if not mma and m != 1:
        raise ValueError(f"the fma kernel multiplies one row of x, not {m}")
    if cfg.split == 1:
        dest = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
        stride, split_stride = dest.stride(0), 0
    else:
        dest = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
        stride, split_stride = n, m * n
    gk = _kernels()
    gk.gguf_matmul_kernel[(-(-n // cfg.block_n), cfg.split)](
        x, part.data, _wide(part), dest, m, n, k, part.data.stride(0), -(-units // cfg.split), split_stride, stride,
        QTYPE=int(part.qtype), Q8_BLOCKS=q8_blocks, BLOCK_M=max(16, 1 << (m - 1).bit_length()) if mma else 1,
        BLOCK_N=cfg.block_n, MMA=mma,
        num_warps=cfg.warps, **pdl.launch(x))
    if cfg.split == 1:
        return dest
    parts = SplitK(dest, x.dtype, (m, n))
    if out is None:
        return parts
    block = 1024
    gk.sum_into_kernel[(-(-m * n // block),)](dest, out, m, n, out.stride(0), SPLIT=cfg.split, BLOCK=block,
                                              num_warps=4, **pdl.launch(out))
    return out


def linear(x, w: GGUFWeight, partial: bool = False) -> torch.Tensor | SplitK:
    """x [..., K] @ W.T in x's dtype (or, with `partial`, a split-K launch's unsummed `SplitK`)."""
    x = getattr(x, "x", x)  # int8 rows made for qmatmul's kernels (`QuantRows`) are not used here
    k = w.in_features
    rows = x.numel() // k
    shape = (*x.shape[:-1], w.out_features)
    x2 = x.reshape(rows, k).contiguous()
    if rows > MAX_ROWS:
        return dequant_linear(x2, w).reshape(shape)
    if len(w.parts) == 1 and w.parts[0].qtype != Q.F32:
        part = w.parts[0]
        out = launch(x2, part, k, choose(rows, x.dtype, x.device, part, k))
        if isinstance(out, SplitK):
            out = _summed(out, partial)
        return replace(out, shape=shape) if isinstance(out, SplitK) else out.reshape(shape)
    out = torch.empty(rows, w.out_features, dtype=x.dtype, device=x.device)
    col = 0
    for part in w.parts:
        dest = out[:, col:col + part.rows]
        if part.qtype == Q.F32:
            dest.copy_(_float_product(x2, part))
        else:
            launch(x2, part, k, choose(rows, x.dtype, x.device, part, k), dest)
        col += part.rows
    return out.reshape(shape)


def _float_product(x: torch.Tensor, part: BlockRows) -> torch.Tensor:
    """x @ W.T for a part of F32 rows, in fp32."""
    return torch.nn.functional.linear(x.float(), part.data.view(torch.float32))


def dequantize_rows(part: BlockRows, k: int, dtype: torch.dtype, start: int = 0, stop: int | None = None,
                    ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows start..stop of the part (or its rows `ids`, int64 on its device), dequantized: [rows, K] in dtype."""
    if part.qtype == Q.F32:
        values = part.data.view(torch.float32)
        return (values[start:stop] if ids is None else values[ids]).to(dtype)
    stop = part.rows if stop is None else stop
    r = stop - start if ids is None else ids.numel()
    out = torch.empty(r, k, dtype=dtype, device=part.data.device)
    if r == 0:
        return out
    q8_blocks, units = _units(part.qtype, k)
    _kernels().gguf_dequant_kernel[(-(-r // DEQUANT_ROWS), units)](
        part.data, _wide(part), out if ids is None else ids, out, r, k, part.data.stride(0), start,
        QTYPE=int(part.qtype), Q8_BLOCKS=q8_blocks, GATHER=ids is not None, BLOCK_R=DEQUANT_ROWS, num_warps=4)
    return out


def dequant_linear(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x [M, K] @ W.T by blocks of weight rows: each dequantized to x's dtype into a scratch, then one cuBLAS
    matmul."""
    k = w.in_features
    block = max(DEQUANT_ROWS, SCRATCH_ELEMENTS // k // DEQUANT_ROWS * DEQUANT_ROWS)
    if len(w.parts) == 1 and w.parts[0].rows <= block:
        return x @ dequantize_rows(w.parts[0], k, x.dtype).T
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    col = 0
    for part in w.parts:
        for start in range(0, part.rows, block):
            stop = min(part.rows, start + block)
            torch.matmul(x, dequantize_rows(part, k, x.dtype, start, stop).T, out=out[:, col + start:col + stop])
        col += part.rows
    return out


def rows(w: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized rows `ids` of w in its compute dtype (an embedding lookup): no host sync, so a CUDA graph
    captures it."""
    ids = ids.reshape(-1).to(device=w.device, dtype=torch.int64)
    if len(w.parts) == 1:
        return dequantize_rows(w.parts[0], w.in_features, w.compute_dtype, ids=ids)
    out = torch.empty(ids.numel(), w.in_features, dtype=w.compute_dtype, device=w.device)
    first = 0
    for part in w.parts:  # each part's rows where the id falls in its range
        mine = (ids >= first) & (ids < first + part.rows)
        local = (ids - first).clamp(0, part.rows - 1)
        out = torch.where(mine[:, None], dequantize_rows(part, w.in_features, w.compute_dtype, ids=local), out)
        first += part.rows
    return out
