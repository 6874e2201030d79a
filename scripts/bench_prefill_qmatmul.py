"""Prefill-sized matmuls on quantized weights (`engine/kernels/dequant.py`) on the 27B's shapes: every candidate
(the fused dequant GEMM's tiles and the dequantize + cuBLAS path) for each row count, against bf16 cuBLAS on the
same shape (the baseline: what the matmul costs with the weight already in bf16) and the floor measured in the
same run: the larger of the weight's bytes at the copy bandwidth and the FLOPs at the measured bf16 matmul rate.
Device time inside CUDA graphs with L2 flushed before each call (`engine.kernels.timing.graph_ms`, as the engine
times its choice). Each candidate's output is checked against the bf16 matmul of the dequantized weight.

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


def label(c: dequant.PConfig) -> str:
    if c.version == "cublas":
        return "dequant+cuBLAS"
    return f"fused {c.block_m}x{c.block_n}x{c.block_k} w{c.warps} s{c.stages} split {c.split}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    ap.add_argument("--formats", nargs="+", default=None, help="default: each shape's decode format")
    args = ap.parse_args()
    bw, rate = copy_bandwidth(), bf16_rate()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{gpu_name()}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s, {sms} SMs")
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
                for m in args.rows:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                    want = x @ wd.T
                    floor = max(q.nbytes / bw, 2 * m * n * k / rate) * 1e3
                    bf16 = graph_ms(lambda x=x, w=w: x @ w.T, calls=2, reps=10, flush_l2=True)
                    times = {}
                    for c in dequant.candidates(m, n, k, sms):
                        try:
                            got = dequant.launch(x, qw, c)
                        except Exception as e:  # noqa: BLE001 - a tile this GPU cannot compile
                            print(f"  {label(c)}: {type(e).__name__}")
                            continue
                        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                        assert err < 1e-2, (name, base, layout, m, c, err)
                        times[c] = graph_ms(lambda c=c, x=x, qw=qw: dequant.launch(x, qw, c), calls=2, reps=10,
                                            flush_l2=True)
                    best = min(times, key=times.get)
                    fused = min((c for c in times if c.version == "fused"), key=times.get, default=None)
                    row = {"gpu": gpu_name(), "shape": name, "n": n, "k": k, "fmt": base, "layout": layout,
                           "rows": m, "floor_ms": floor, "bf16_cublas_ms": bf16,
                           "cublas_path_ms": times.get(dequant.PConfig("cublas")),
                           "fused_ms": times.get(fused), "fused_config": label(fused) if fused else None,
                           "chosen": label(best), "chosen_ms": times[best], "ratio_to_floor": times[best] / floor,
                           "candidates": {label(c): t for c, t in times.items()}}
                    rows_out.append(row)
                    print(f"{name:26s} {base} {layout:5s} M={m:5d}: floor {floor:7.3f}  bf16 {bf16:7.3f}  "
                          f"dequant+cuBLAS {row['cublas_path_ms']:7.3f}  best fused {row['fused_ms'] or 0:7.3f} "
                          f"({row['fused_config']})  -> {times[best] / floor:.2f}x floor")
    print("wrote", write_results("bench_prefill_qmatmul", rows_out))


if __name__ == "__main__":
    main()
