"""Where the quantized matmuls of a decode step (v7 at one row) and a verify step (v10 at 8 rows) spend their
time: each 27B shape's chosen tile timed with parts of its work removed (the kernels' SKIP bits: 1 = x's rows not
loaded (made from indices), 2 = nibbles not split (codes used as they are), 4 = no per-group epilogue (no
scales, zero points or x scales)), beside the read-only kernel of the same bytes.
Results are wrong by design; only the times mean something.

Usage: python scripts/ablate_qmatmul.py [--rows 1 8] -> table + scripts/results/ablate_qmatmul_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_qmatmul import COPIES, SHAPES  # noqa: E402
from bench_util import stream_read_ms, time_graph_ms, write_results  # noqa: E402

from engine.kernels.actquant import QuantRows, quantize_rows  # noqa: E402
from engine.kernels.qmatmul import choose, launch, split_rows  # noqa: E402
from engine.quant.qweight import quantize  # noqa: E402

SKIPS = {0: "full kernel", 1: "no x loads", 2: "no nibble split", 4: "no epilogue", 7: "weights + dots only"}


def ablated(qs: list, pre: QuantRows, cfg, skip: int):
    """One launch per call with `skip`'s parts removed, cycling through the weight copies; x's int8 rows made
    once, as the decode step's norm kernels hand them over."""
    i = [0]

    def step():
        i[0] = (i[0] + 1) % COPIES
        return launch(pre.x, qs[i[0]], cfg, pre, partial=True, skip=skip)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k, fmt in SHAPES:
        if name == "lm head":
            continue
        qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5, fmt)
              for _ in range(COPIES)]
        stream = stream_read_ms(qs[0].nbytes)
        for t in args.rows:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
            pre = QuantRows(x, *quantize_rows(x, split_rows(qs[0])))
            cfg = choose(t, x.dtype, x.device, qs[0])
            for skip, what in SKIPS.items():
                if cfg.version not in ("v7", "v10"):
                    continue
                ms = time_graph_ms(ablated(qs, pre, cfg, skip))
                rows.append({"gpu": gpu, "shape": name, "N": n, "K": k, "weights": fmt, "T": t, "skip": skip,
                             "removed": what, "graph_ms": ms, "stream_ms": stream, "kernel": str(cfg)})
                print(f"{name:24s} {fmt} T={t} {cfg.version:4s} {what:20s} {ms * 1e3:7.1f} us  "
                      f"(read-only kernel {stream * 1e3:6.1f})")
        del qs
        torch.cuda.empty_cache()
    write_results("ablate_qmatmul", rows)


if __name__ == "__main__":
    main()
