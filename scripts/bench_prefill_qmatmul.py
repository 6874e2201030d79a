"""Prefill-sized matmuls on quantized weights on the 27B's shapes, for each row count: dequantize + cuBLAS
(`engine/kernels/dequant.py`) and the int8 tensor-core kernel (`engine/kernels/qgemm.py`: the best of its tiles for
the row count, every tile with --sweep), against bf16 cuBLAS on the same shape (what the matmul costs with the
weight already in bf16), int8 cuBLAS on the same shape (`torch._int_mm` on int8 [M, K] x [K, N]: the int8 roof,
with no group scales) and the floor measured in the same run: the larger of the weight's bytes at the copy
bandwidth and the FLOPs at the measured bf16 matmul rate. Device time inside CUDA graphs with L2 flushed before each
call (`engine.kernels.timing.graph_ms`). The outputs are checked against the bf16 matmul of the dequantized weight.
The dequantization alone (the whole weight into bf16) is timed beside, against its own floor: the codes read and the
bf16 written at the copy bandwidth. The path `qgemm.choose` takes is printed per row count. (Results of session (15)
also hold a fused dequant GEMM's candidates, since removed.)

Usage: python scripts/bench_prefill_qmatmul.py [--rows 32 128 512 1024 2048] [--formats q5 q4] [--sweep]
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

from engine.kernels import dequant, qgemm  # noqa: E402
from engine.kernels.timing import graph_ms  # noqa: E402
from engine.quant.qweight import dequantize, quantize, tile  # noqa: E402


def bf16_rate() -> float:
    """FLOP/s of a large bf16 cuBLAS matmul (8192^3), the compute side of the floor."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (time_ms(lambda: a @ b, 20) / 1e3)


def ms(fn) -> float:
    return graph_ms(fn, calls=2, reps=10, flush_l2=True)


def int8_cublas_ms(m: int, n: int, k: int, g: torch.Generator) -> float | None:
    """int8 cuBLAS on the shape (`torch._int_mm`, int32 out), or None where this torch build has no such kernel."""
    a = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=g)
    try:
        return ms(lambda: torch._int_mm(a, b.t()))
    except RuntimeError as e:
        print(f"int8 cuBLAS at {m}x{n}x{k}: {e}".splitlines()[0])
        return None


def int8_tiles(qw, x: torch.Tensor, want: torch.Tensor, sweep: bool) -> dict:
    """Graph time of each int8 tile (the row count's list, or every tile), its output checked."""
    times = {}
    for cfg in qgemm.candidates(None if sweep else x.shape[0])[1:]:
        err = ((qgemm.launch(x, qw, cfg).float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1.5e-2, (cfg, err)
        times[cfg] = ms(lambda cfg=cfg: qgemm.launch(x, qw, cfg))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512, 1024, 2048])
    ap.add_argument("--formats", nargs="+", default=None, help="default: each shape's decode format")
    ap.add_argument("--sweep", action="store_true", help="time every int8 tile at every row count")
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
                    flops = 2 * m * n * k
                    floor = max(q.nbytes / bw, flops / rate) * 1e3
                    bf16 = ms(lambda x=x, w=w: x @ w.T)
                    got = dequant.dequant_linear(x, qw)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert err < 1e-2, (name, base, layout, m, err)
                    dq_ms = ms(lambda x=x, qw=qw: dequant.dequant_linear(x, qw))
                    tiles = int8_tiles(qw, x, want, args.sweep)
                    best = min(tiles, key=tiles.get)
                    i8 = tiles[best]
                    roof = int8_cublas_ms(m, n, k, g)
                    chosen = qgemm.choose(m, x.dtype, x.device, qw)
                    rows_out.append({"gpu": gpu_name(), "shape": name, "n": n, "k": k, "fmt": base, "layout": layout,
                                     "rows": m, "floor_ms": floor, "bf16_cublas_ms": bf16, "dequant_cublas_ms": dq_ms,
                                     "ratio_to_floor": dq_ms / floor, "ratio_to_bf16": dq_ms / bf16,
                                     "dequant_ms": dq, "dequant_floor_ms": dq_floor,
                                     "int8_gemm_ms": i8, "int8_gemm_tile": [best.block_n, best.block_m, best.warps,
                                                                            best.stages],
                                     "int8_gemm_tiles_ms": {f"{c.block_n}x{c.block_m} w{c.warps} s{c.stages}": t
                                                            for c, t in tiles.items()},
                                     "int8_cublas_ms": roof, "bf16_cublas_tflops": flops / bf16 / 1e9,
                                     "int8_gemm_tops": flops / i8 / 1e9,
                                     "int8_cublas_tops": flops / roof / 1e9 if roof else None,
                                     "chosen": chosen.kernel if chosen.kernel != "int8_gemm" else
                                     f"int8_gemm {chosen.block_n}x{chosen.block_m} w{chosen.warps} s{chosen.stages}"})
                    print(f"{name:26s} {base} {layout:5s} M={m:5d}: floor {floor:7.3f}  bf16 cuBLAS {bf16:7.3f}  "
                          f"dequant+cuBLAS {dq_ms:7.3f} ({dq_ms / bf16:.2f}x bf16)  int8 {i8:7.3f} "
                          f"({i8 / bf16:.2f}x bf16, {best.block_n}x{best.block_m} w{best.warps})  int8 cuBLAS "
                          + (f"{roof:7.3f} ({flops / roof / 1e9:.0f} TOPS; int8 kernel {flops / i8 / 1e9:.0f})"
                             if roof else "n/a") + f"  -> chosen {rows_out[-1]['chosen']}")
                    if args.sweep:
                        swept = rows_out[-1]["int8_gemm_tiles_ms"].items()
                        print("    " + "  ".join(f"{c}: {t:.3f}" for c, t in swept))
    print("wrote", write_results("bench_prefill_qmatmul", rows_out))


if __name__ == "__main__":
    main()
