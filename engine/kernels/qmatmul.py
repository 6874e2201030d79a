"""Fused dequantize + matmul for group-wise q8/q5/q4 weights, for the few rows of a decode/verify step (T <= 16).

v2 layout of the work: a program owns BLOCK_N output features and one K-slice (split-K when N alone gives too
few programs to fill the GPU). It reads its rows' packed codes row-major, so neighbouring lanes read
neighbouring bytes (coalesced vector loads along K), unpacks them in registers (nibble pairs joined back into
k order, q5's bit plane expanded 8 bits per byte), scales per group of 64, and multiplies with tl.dot (rows
padded to 16). Split-K programs write fp32 partials that one sum reduces. The reference is
`x @ dequantize(w).T` (`qlinear_reference`); prefill-sized inputs take that path until a tiled prefill kernel
exists. Tile configs are autotuned per (N, K, format) among a per-GPU candidate list.
"""
from __future__ import annotations

import os

import torch

from ..quant.qweight import GROUP, QuantizedWeight, dequantize

MAX_ROWS = 16
_FMT = {"q8": 8, "q5": 5, "q4": 4}


def qlinear_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(w, x.dtype))


def _use_triton(x: torch.Tensor) -> bool:
    if x.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("NINFER_TRITON_ON_CPU") == "1"


def qlinear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or not _use_triton(x):
        return qlinear_reference(x, w)
    return _qlinear_triton(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.out_features)


def split_k(n: int, k: int, block_n: int, sms: int) -> int:
    """K-slices per output block so that about two programs run per SM (1 when N already gives that)."""
    blocks = -(-n // block_n)
    split = 1
    while blocks * split < 2 * sms and split < 8 and k % (2 * split * 256) == 0:
        split *= 2
    return split


_kernel = None


def _build():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_K": bk}, num_warps=nw, num_stages=ns)
               for bk, nw, ns in ((256, 4, 2), (512, 4, 2), (256, 8, 3), (512, 8, 3), (128, 4, 3), (64, 4, 2))]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:  # no benchmarking there: one config per shape
        configs = [triton.Config({"BLOCK_K": 128}), triton.Config({"BLOCK_K": 64})]

    def whole_tiles(configs, nargs, **kwargs):
        """Only tiles that divide a K-slice (K is a multiple of 64, so BLOCK_K = 64 always stays)."""
        span = nargs["K"] // kwargs.get("SPLIT", nargs.get("SPLIT", 1))
        return [c for c in configs if span % c.kwargs["BLOCK_K"] == 0][:1 if interpreted else 4]

    @triton.autotune(configs=configs, key=["N", "K", "FMT", "SPLIT", "BLOCK_N"],
                     prune_configs_by={"early_config_prune": whole_tiles})
    @triton.jit
    def kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K,
               FMT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_mask = rn < N
        span = K // SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * span, (pid_k + 1) * span, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            if FMT == 8:
                c = tl.load(codes_ptr + rn[:, None] * K + rk[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
            else:
                rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                byte = tl.load(codes_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=n_mask[:, None], other=0)
                byte = byte.to(tl.int32)
                u = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))  # back into k order
                if FMT == 4:
                    c = (u - 8).to(tl.float32)
                else:
                    rh = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                    hb = tl.load(high_ptr + rn[:, None] * (K // 8) + rh[None, :], mask=n_mask[:, None], other=0)
                    bits = (hb.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
                    c = (u + tl.reshape(bits, (BLOCK_N, BLOCK_K)) * 16 - 16).to(tl.float32)
            rg = k0 // 64 + tl.arange(0, BLOCK_K // 64)
            s = tl.load(scales_ptr + rn[:, None] * (K // 64) + rg[None, :], mask=n_mask[:, None], other=0.0)
            w = tl.reshape(tl.reshape(c, (BLOCK_N, BLOCK_K // 64, 64)) * s.to(tl.float32)[:, :, None],
                           (BLOCK_N, BLOCK_K))
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_mask[None, :])

    return kernel


def _qlinear_triton(x: torch.Tensor, w: QuantizedWeight, block_n: int = 32) -> torch.Tensor:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    m, k = x.shape
    assert k == w.in_features and k % GROUP == 0
    x = x.contiguous()
    n = w.out_features
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    split = split_k(n, k, block_n, sms)
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    high = w.high if w.high is not None else w.codes
    grid = (-(-n // block_n), split)
    _kernel[grid](x, w.codes, high, w.scales, out, m, n, k, FMT=_FMT[w.fmt], SPLIT=split, BLOCK_M=MAX_ROWS,
                  BLOCK_N=block_n)
    return out if split == 1 else out.sum(0).to(x.dtype)
