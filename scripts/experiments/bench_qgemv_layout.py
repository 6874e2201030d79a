"""Layout experiment for the T=1 quantized matmul: does a K-packed, N-contiguous q4 layout (int32 words holding 8
consecutive k of one output column, [K/8, N]; scales [K/64, N]) reach the bandwidth floor with a plain FMA GEMV,
where the engine's row-major [N, K/2] float kernels then stayed at 7-14x? Loads are coalesced along N, each
thread reduces its own columns over K (no cross-lane reduction), codes become floats by the 2^23 bit trick.

Prototype only (not used by the engine): it answers whether to change QuantizedWeight's layout. Prints error
vs the torch reference and device time next to the engine's chosen kernel and bf16 cuBLAS on the 27B shapes.

Usage: python scripts/experiments/bench_qgemv_layout.py
  -> table + scripts/results/bench_qgemv_layout_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE.parent)]  # the engine, and the benchmarks' helpers in scripts/

from bench_util import copy_bandwidth, time_graph_ms, time_ms, write_results  # noqa: E402

from engine.kernels.qmatmul import qlinear, qlinear_reference  # noqa: E402
from engine.quant.qweight import codes_of, quantize  # noqa: E402

SHAPES = [("mlp gate/up (fused)", 34816, 5120), ("mlp down", 5120, 17408), ("gdn in_proj (fused)", 16480, 5120)]
COPIES = 4


def k_packed(q):
    """[K/8, N] int32 words (nibble j of word r = code of k = 8r + j, stored + 8) and [K/64, N] scales."""
    u = (codes_of(q) + 8).to(torch.int64)  # [N, K], 0..15
    n, k = u.shape
    words = (u.reshape(n, k // 8, 8) << (4 * torch.arange(8, device=u.device))).sum(-1)  # 0 .. 2^32 - 1
    words = (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits, as int32
    return words.t().contiguous(), q.scales.t().contiguous()


@triton.jit
def gemv_q4(x_ptr, w_ptr, s_ptr, out_ptr, N, K, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    groups = K // 64
    per = groups // SPLIT
    rr = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for gi in range(pid_k * per, (pid_k + 1) * per):
        words = tl.load(w_ptr + (gi * 8 + rr)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)  # [8, BN]
        part = tl.zeros((BLOCK_N,), tl.float32)
        for j in tl.static_range(8):
            nib = (words >> (4 * j)) & 0xF
            c = (nib | 0x4B000000).to(tl.int32).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + nib - (2^23 + 8)
            xv = tl.load(x_ptr + gi * 64 + rr * 8 + j).to(tl.float32)  # x[k] for k = 64 gi + 8 r + j
            part += tl.sum(c * xv[:, None], 0)
        acc += part * tl.load(s_ptr + gi * N + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_k * N + rn, acc, mask=n_ok)


def gemv(x, words, scales, n, k, split, block_n, warps):
    out = torch.empty(split, n, dtype=torch.float32, device=x.device)
    gemv_q4[(triton.cdiv(n, block_n), split)](x, words, scales, out, n, k, SPLIT=split, BLOCK_N=block_n,
                                              num_warps=warps)
    return out.sum(0).to(x.dtype)


def shape_rows(name: str, n: int, k: int, bw: float, g: torch.Generator) -> list[dict]:
    qs = [quantize(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * k ** -0.5, "q4")
          for _ in range(COPIES)]
    packed = [k_packed(q) for q in qs]
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    want = qlinear_reference(x, qs[0]).float()
    floor = (qs[0].nbytes + x.nbytes + 2 * n) / bw * 1e3
    variants = {"engine chosen (row-major)": lambda j: qlinear(x, qs[j])}
    for block_n in (128, 256, 512):  # of 64..1024 x 1..4 warps tried, these did best
        for warps in (2,):
            split = 1
            while triton.cdiv(n, block_n) * split < 264 and (k // 64) % (2 * split) == 0 and split < 16:
                split *= 2
            variants[f"k-packed gemv BN={block_n} w={warps} split={split}"] = (
                lambda j, b=block_n, w=warps, s=split: gemv(x[0], *packed[j], n, k, s, b, w))
    rows = []
    for label, fn in variants.items():
        got = fn(0).float().reshape(want.shape)
        err = ((got - want).norm() / want.norm()).item()
        turn = [0]

        def step(fn=fn, turn=turn):  # cycle the copies so reads come from HBM
            turn[0] = (turn[0] + 1) % COPIES
            return fn(turn[0])

        ms = time_ms(step)
        graph_ms = time_graph_ms(step)
        rows.append({"gpu": torch.cuda.get_device_name(), "shape": name, "N": n, "K": k, "weights": "q4", "T": 1,
                     "kernel": label, "ms": ms, "graph_ms": graph_ms, "floor_ms": floor,
                     "ratio_to_floor": graph_ms / floor, "rel_err_vs_reference": err, "copy_bw_gbs": bw / 1e9})
        print(f"{name:20s} {label:40s} per call {ms * 1e3:7.1f} us, in a graph {graph_ms * 1e3:7.1f} us  "
              f"x{graph_ms / floor:5.2f}  err {err:.1e}")
    return rows


def main() -> None:
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        rows += shape_rows(name, n, k, bw, g)
    write_results("bench_qgemv_layout", rows)


if __name__ == "__main__":
    main()
