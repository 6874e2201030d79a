"""The GGUF block matmuls (`engine/kernels/gguf_matmul.py`) on the 27B's shapes, in each GPU type (Q4_K, Q5_K,
Q6_K, Q8_0; random blocks): the few-row kernel at 1 and 8 rows (the launch shape chosen on this GPU, and with
--sweep every candidate) against its bandwidth floor, the bytes it must read (the stored blocks, x, the output)
over the device-to-device copy rate measured in the same run; rows past 64 (a prefill chunk, e.g. --rows 512)
take the prefill path (blocks of rows dequantized to bf16, then cuBLAS), timed beside bf16 cuBLAS on the same
shape. Graph times (32 calls in a CUDA graph, weight copies cycled so that every call reads from HBM), x in bf16;
each row checked against the fp64 product of the dequantized weight.

Usage: python scripts/bench_gguf_matmul.py [--types Q4_K Q6_K] [--rows 1 8 512] [--sweep]
  -> table + scripts/results/bench_gguf_matmul_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_qmatmul import COPIES, SHAPES  # noqa: E402
from bench_util import copy_bandwidth, time_graph_ms, write_results  # noqa: E402

from engine.kernels.gguf_matmul import (  # noqa: E402
    MAX_ROWS,
    GConfig,
    candidates,
    choose,
    dequantize_rows,
    launch,
    linear,
)
from engine.kernels.qmatmul import SplitK, row_bucket  # noqa: E402
from engine.quant.gguf_blocks import BlockRows, GGUFWeight, random_blocks  # noqa: E402


def rel_err(out: torch.Tensor | SplitK, x: torch.Tensor, part: BlockRows, k: int, cols: int = 8192) -> float:
    """Against x @ W.T in fp64 over the first `cols` outputs, W the dequantized rows (equal to gguf's decoding:
    tests/test_gguf_gpu_kernels.py)."""
    out = (out.dense() if isinstance(out, SplitK) else out)[:, :cols]
    want = x.double() @ dequantize_rows(part, k, torch.float32, 0, min(cols, part.rows)).double().T
    return ((out.double() - want).norm() / want.norm()).item()


def make_step(x: torch.Tensor, weights: list[GGUFWeight], cfg: GConfig | None = None):
    """One matmul per call, cycling through the weight copies (the chosen config, or `cfg`)."""
    i = [0]

    def step():
        i[0] = (i[0] + 1) % COPIES
        w = weights[i[0]]
        return linear(x, w) if cfg is None else launch(x, w.parts[0], w.in_features, cfg)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", default=None, help="shape names (default: all)")
    p.add_argument("--sweep", action="store_true", help="every candidate launch shape, not only the chosen one")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name, n, k, _ in SHAPES:  # the 27B's matmuls (their 8k-speed formats aside)
        if args.shapes and name not in args.shapes:
            continue
        for tname in args.types:
            qtype = Q[tname]
            weights = [GGUFWeight((BlockRows(int(qtype), random_blocks(qtype, n, k, generator=g, device="cuda")),),
                                  k, torch.bfloat16) for _ in range(COPIES)]
            part = weights[0].parts[0]
            for t in args.rows:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
                nbytes = part.data.nbytes + x.nbytes + t * n * 2
                floor_ms = nbytes / bw * 1e3
                prefill = t > MAX_ROWS
                chosen = None if prefill else choose(t, x.dtype, x.device, part, k)
                tried = [None] + (candidates(n, k, sms, qtype, row_bucket(t)[0]) if args.sweep and not prefill else [])
                for cfg in tried:
                    err = None if prefill else rel_err(linear(x, weights[0]) if cfg is None else
                                                       launch(x, part, k, cfg), x, part, k)
                    ms = time_graph_ms(make_step(x, weights, cfg))
                    kernel = "prefill: dequant + cuBLAS" if prefill else str(cfg or f"chosen: {chosen}")
                    row = {"gpu": gpu, "shape": name, "N": n, "K": k, "type": tname, "T": t, "graph_ms": ms,
                           "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms, "bytes": nbytes,
                           "stored_bytes": part.data.nbytes, "copy_bw_gbs": bw / 1e9, "rel_err_vs_fp64": err,
                           "kernel": kernel, "chosen": cfg is None}
                    extra = ""
                    if prefill:  # beside bf16 cuBLAS on a dense weight of the shape
                        dense = dequantize_rows(part, k, torch.bfloat16)
                        row["cublas_bf16_ms"] = time_graph_ms(lambda dense=dense, x=x: x @ dense.T)
                        extra = f"  cuBLAS bf16 {row['cublas_bf16_ms'] * 1e3:8.1f} us"
                        del dense
                    results.append(row)
                    print(f"{name:24s} {tname:5s} T={t:<4d} {ms * 1e3:8.1f} us  floor {floor_ms * 1e3:8.1f} us  "
                          f"x{ms / floor_ms:5.2f}  err {err if err is None else f'{err:.1e}'}  {kernel}{extra}",
                          flush=True)
            del weights, part
            torch.cuda.empty_cache()
    write_results("bench_gguf_matmul", results)


if __name__ == "__main__":
    main()
