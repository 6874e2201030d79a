"""Prefill-sized matmuls on quantized weights (`engine/kernels/dequant.py`: dequantize blocks of rows, then cuBLAS)
on the 27B's shapes, for each row count, against bf16 cuBLAS on the same shape (the baseline: what the matmul
costs with the weight already in bf16) and the floor measured in the same run: the larger of the weight's bytes at
the copy bandwidth and the FLOPs at the measured bf16 matmul rate. Device time inside CUDA graphs with L2 flushed
before each call (`engine.kernels.timing.graph_ms`). The output is checked against the bf16 matmul of the
dequantized weight. The dequantization alone (the whole weight into bf16) is timed beside, against its own floor:
the codes read and the bf16 written at the copy bandwidth. (Results of session (15) also hold a fused dequant
GEMM's candidates, since removed.)

Usage: python scripts/bench_prefill_qmatmul.py [--rows 32 128 512 1024 2048] [--formats q5 q4]
  -> table + scripts/results/bench_prefill_qmatmul_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_qmatmul import SHAPES  # noqa: E402
from bench_util import copy_bandwidth, gpu_name, time_ms, write_results  # noqa: E402

from engine.kernels import dequant  # noqa: E402
from engine.kernels.timing import graph_ms  # noqa: E402
from engine.quant.qweight import dequantize, quantize, tile  # noqa: E402


def bf16_rate() -> float:
    """FLOP/s of a large bf16 cuBLAS matmul (8192^3), the compute side of the floor."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (time_ms(lambda: a @ b, 20) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    ap.add_argument("--formats", nargs="+", default=None, help="default: each shape's decode format")
    args = ap.parse_args()
    bw, rate = copy_bandwidth(), bf16_rate()
    print(f"{gpu_name()}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, n, k, decode_fmt in SHAPES:
        if name == "lm head":  # prefill takes the LM head of the last token only
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        for base in args.formats or [decode_fmt]:
            q = quantize(w, base)
            wd = dequantize(q, torch.bfloat16)
            for layout, qw in (("rows", q), ("tiled", tile(q))) if base != "q8" else (("rows", q),):
                dq_floor = (q.nbytes + n * k * 2) / bw * 1e3
                dq = graph_ms(lambda qw=qw, n=n: dequant.dequantize_rows(qw, 0, n, torch.bfloat16), calls=2, reps=10,
                              flush_l2=True)
                print(f"{name:26s} {base} {layout:5s} dequantize alone: {dq:7.3f} ms, floor {dq_floor:7.3f} "
                      f"-> {dq / dq_floor:.2f}x")
                for m in args.rows:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                    want = x @ wd.T
                    floor = max(q.nbytes / bw, 2 * m * n * k / rate) * 1e3
                    bf16 = graph_ms(lambda x=x, w=w: x @ w.T, calls=2, reps=10, flush_l2=True)
                    got = dequant.dequant_linear(x, qw)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert err < 1e-2, (name, base, layout, m, err)
                    ms = graph_ms(lambda x=x, qw=qw: dequant.dequant_linear(x, qw), calls=2, reps=10, flush_l2=True)
                    rows_out.append({"gpu": gpu_name(), "shape": name, "n": n, "k": k, "fmt": base, "layout": layout,
                                     "rows": m, "floor_ms": floor, "bf16_cublas_ms": bf16, "dequant_cublas_ms": ms,
                                     "ratio_to_floor": ms / floor, "ratio_to_bf16": ms / bf16,
                                     "dequant_ms": dq, "dequant_floor_ms": dq_floor})
                    print(f"{name:26s} {base} {layout:5s} M={m:5d}: floor {floor:7.3f}  bf16 cuBLAS {bf16:7.3f}  "
                          f"dequant+cuBLAS {ms:7.3f} ms  -> {ms / floor:.2f}x floor, {ms / bf16:.2f}x bf16")
    print("wrote", write_results("bench_prefill_qmatmul", rows_out))


if __name__ == "__main__":
    main()
