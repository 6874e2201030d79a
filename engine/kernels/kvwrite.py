"""Fused KV-cache write: for int8 / fp8 caches per (token, head) absmax, scale, codes and both stores in one
kernel for k and v together, instead of the reference's ~7 torch ops per tensor (a decode step at 8K paid more
for those launches than int8 KV saved in bytes); bf16 / compute-dtype caches store the values as they are.
Positions are read on the device and mapped to store rows through the sequence's block table (CUDA-graph safe).

The reference is `engine.cache.kv_cache.quantize_per_head` + index_copy_ at `BlockTable.slots`.
"""
from __future__ import annotations

import torch

from . import runs_here

_kernel = None
_QMAX = {"int8": 127.0, "fp8": 448.0}


def usable(x: torch.Tensor, kv_dtype: str) -> bool:
    # the interpreter has no fp8 type: fp8 caches take the kernel on GPUs only
    return runs_here(x) and (kv_dtype != "fp8" or x.is_cuda)


def _build():
    import triton
    import triton.language as tl

    global enter  # a jit kernel finds the jit functions it calls among its module's globals
    from .pdl import enter

    @triton.jit
    def kv_write_kernel(k_ptr, v_ptr, pos_ptr, table_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, H, D, k_tok, v_tok,
                        QMAX: tl.constexpr, FP8: tl.constexpr, QUANT: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        t, h, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rd = tl.arange(0, BLOCK_D)
        ok = rd < D
        if which == 0:  # token rows k_tok / v_tok apart (v: a slice of the attention's fused projection)
            x = tl.load(k_ptr + t * k_tok + h * D + rd, mask=ok, other=0.0)
        else:
            x = tl.load(v_ptr + t * v_tok + h * D + rd, mask=ok, other=0.0)
        p = tl.load(pos_ptr + t)
        p = tl.load(table_ptr + p // PAGE).to(tl.int64) * PAGE + p % PAGE  # the store row
        dst = (p * H + h) * D + rd
        if QUANT:
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / QMAX
            y = x / scale
            if FP8:
                codes = y.to(tl.float8e4nv)
            else:
                codes = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
            if which == 0:
                tl.store(kc_ptr + dst, codes, mask=ok)
                tl.store(ks_ptr + p * H + h, scale)
            else:
                tl.store(vc_ptr + dst, codes, mask=ok)
                tl.store(vs_ptr + p * H + h, scale)
        elif which == 0:
            tl.store(kc_ptr + dst, x.to(kc_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(vc_ptr + dst, x.to(vc_ptr.dtype.element_ty), mask=ok)

    return kv_write_kernel


def write(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, k_codes: torch.Tensor,
          v_codes: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, kv_dtype: str) -> None:
    """k, v [T, H, D] at `positions` [T] into one layer's codes [rows, H, D] and scales [rows, H] (for int8 /
    fp8; any tensor otherwise) at the rows the block table [pages] maps them to."""
    import triton

    from ..cache.kv_pool import PAGE
    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    t, h, d = k.shape
    k, v = _token_rows(k), _token_rows(v)
    _kernel[(t, h, 2)](k, v, positions, table, k_codes, v_codes, k_scale, v_scale, h, d, k.stride(0), v.stride(0),
                       QMAX=_QMAX.get(kv_dtype, 1.0), FP8=kv_dtype == "fp8", QUANT=kv_dtype in _QMAX, PAGE=PAGE,
                       BLOCK_D=triton.next_power_of_2(d), num_warps=2, **pdl.launch(k))


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's heads side by side (tokens any stride apart: a projection's slice stays
    uncopied)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
