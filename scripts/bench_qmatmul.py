"""The fused dequant matmul on the 27B shapes (T = 1 and 8 rows): correctness against the torch reference at real
sizes, device time (CUDA events, median of many replays, inputs larger than L2), the bandwidth floor measured in
the same run (bytes the kernel must read / a device-to-device copy rate), the graph time of a kernel that only
reads the weight's bytes (what one launch of that size costs at best, fixed costs included), and bf16 cuBLAS as
the baseline. Each
time is taken per call and inside a CUDA graph (the decode step's case, without the host launch cost); the
ratio to the floor uses the graph time.

Usage: python scripts/bench_qmatmul.py [--sweep]  -> table + scripts/results/bench_qmatmul_<gpu>.json (or $OUT/);
--sweep times every candidate tile of the shape's decode format (the 8k-speed profile's) for one row and for 8
rows, the data the per-GPU choice is made from (-> bench_qmatmul_sweep_<gpu>.json; with --rows 1 or 8 alone,
bench_qmatmul_sweep_T1_<gpu>.json or _T8_); --wide times grids of launch
shapes beyond the shipped lists (`decode_grid` at one row, `verify_grid` at 8; -> the same file).
q4/q5 run twice: row-major (the Triton kernels) and tiled ("q4 tiled": the layout the engine loads on GPUs that
run the CUDA kernels of `qtiled.py`), so both layouts' kernels are timed in the same run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import copy_bandwidth, stream_read_ms, time_graph_ms, time_ms, write_results  # noqa: E402

from engine.kernels.qmatmul import (  # noqa: E402
    MAX_ROWS,
    QConfig,
    candidates,
    choose,
    int8_rows_reference,
    launch,
    qlinear,
    qlinear_reference,
    split_k,
)
from engine.quant.qweight import quantize, tile  # noqa: E402

# (name, out_features, in_features, the 8k-speed profile's format): the matmuls of a 27B decode step as the model
# runs them (projections that read the same input fused into one weight)
SHAPES = [("mlp gate|up", 34816, 5120, "q4"), ("mlp down", 5120, 17408, "q4"),
          ("gdn in_proj (qkv|z|b|a)", 16480, 5120, "q5"), ("gdn/attn out", 5120, 6144, "q5"),
          ("attn q|k|v (+gate)", 14336, 5120, "q5"), ("lm head", 248320, 5120, "q8")]
COPIES = 8  # distinct weight copies cycled through so every replay reads from HBM, not L2


def make_step(x: torch.Tensor, w: list[torch.Tensor], qs: list | None, cfg=None):
    """One matmul per call, cycling through the weight copies (the chosen config, or `cfg`)."""
    i = [0]

    def step():
        i[0] = (i[0] + 1) % COPIES
        if qs is None:
            return torch.nn.functional.linear(x, w[i[0]])
        return qlinear(x, qs[i[0]]) if cfg is None else launch(x, qs[i[0]], cfg)

    return step


def verify_grid(n: int, k: int, sms: int) -> list[QConfig]:
    """`int8_mma_groups`'s launch shapes beyond the shipped list (stages and programs per SM on the shipped tile;
    tile width, groups per iteration and warps around it), for the verify-step sweep."""
    shapes = [(64, 256, 4, stages, per_sm) for stages in (2, 3) for per_sm in (1, 2)]
    shapes += [(32, 256, 4, 3, 2), (128, 256, 4, 3, 2), (64, 512, 4, 3, 2), (64, 256, 8, 3, 2), (128, 256, 8, 3, 1)]
    out = []
    for bn, bk, warps, stages, per_sm in shapes:
        cfg = QConfig("int8_mma_groups", bn, bk, warps, stages, split_k(n, k, bn, sms, bk, per_sm))
        if k % bk == 0 and cfg not in out:
            out.append(cfg)
    return out


def decode_grid(n: int, k: int, sms: int) -> list[QConfig]:
    """`int8_dp4a` (one row) with every K split that divides the K tiles evenly and gives 1-48 programs per SM, beyond
    split_k's powers of two (N = 5120, K = 17408 has 34 tiles of 512: split_k stops at 2)."""
    out = []
    for bn in (16, 32):
        for bk in (256, 512):
            tiles, blocks = k // bk, -(-n // bn)
            for split in range(1, min(tiles, 34) + 1):
                if k % bk == 0 and tiles % split == 0 and sms <= blocks * split <= 48 * sms:
                    out.append(QConfig("int8_dp4a", bn, bk, 4, 2, split))
    return out


def rel_err(x: torch.Tensor, q, cfg, chunked: bool = False) -> float:
    """The kernel against the torch reference; an int8-row kernel against the reference on the int8 rows it
    multiplies (the kernel's own arithmetic), so a wrong bit in its integer path shows. `chunked`: qlinear's 16-row
    launches."""
    want = int8_rows_reference(x, q) if cfg.int8_rows else qlinear_reference(x, q)
    a, b = (qlinear(x, q) if chunked else launch(x, q, cfg)).float(), want.float()
    return ((a - b).norm() / b.norm()).item()


def print_best(rows: list[dict]) -> None:
    """Each kernel's fastest tile per shape and row count (graph time), after the full listing."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["shape"], r["T"], ("chosen " + r["weights"]) if r["chosen"] else r["kernel_name"])
        if key not in best or r["graph_ms"] < best[key]["graph_ms"]:
            best[key] = r
    for (shape, t, name), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1]["graph_ms"])):
        print(f"best {shape:24s} T={t} {name:16s} {r['graph_ms'] * 1e3:7.1f} us  read-only "
              f"{r['stream_ms'] * 1e3:6.1f}  {r['kernel']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--wide", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8],
                   help="row counts to time (1-64: several requests' verify rows past 16)")
    p.add_argument("--decode-format", action="store_true", help="each shape in its 8k-speed format alone")
    p.add_argument("--formats", nargs="+", default=["bf16", "q8", "q5", "q4"], help="formats (without --sweep)")
    args = p.parse_args()
    args.sweep = args.sweep or args.wide
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, decode_fmt in SHAPES:
        if args.wide and name == "lm head":
            continue
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(COPIES)]
        formats = (decode_fmt,) if args.sweep or args.decode_format else args.formats
        for fmt in [f for base in formats for f in ((base, f"{base} tiled") if base in ("q4", "q5") else (base,))]:
            base, tiled = fmt.split()[0], fmt.endswith("tiled")
            qs = None if fmt == "bf16" else [quantize(x, base) for x in w]
            if tiled:
                qs = [tile(q) for q in qs]
            stream = stream_read_ms(w[0].nbytes if qs is None else qs[0].nbytes)
            for t in args.rows:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
                nbytes = (w[0].nbytes if qs is None else qs[0].nbytes) + x.nbytes + t * n * 2
                floor = nbytes / bw * 1e3
                grid = candidates(n, k, sms, base, t, tiled)
                if args.wide and not tiled:
                    grid = decode_grid(n, k, sms) if t == 1 else verify_grid(n, k, sms)
                tried = [None] + (grid if args.sweep and qs is not None else [])
                # past 16 rows a row-major weight takes the 16-row kernel per 16 rows (`qlinear`)
                chunked = qs is not None and not tiled and t > MAX_ROWS
                chosen = None if qs is None else choose(MAX_ROWS if chunked else t, x.dtype, x.device, qs[0])
                for cfg in tried:
                    err = None if qs is None else rel_err(x, qs[0], cfg or chosen, chunked)
                    ms = time_ms(make_step(x, w, qs, cfg))
                    graph_ms = time_graph_ms(make_step(x, w, qs, cfg))  # as in the decode graph
                    how = "chosen per 16 rows" if chunked else "chosen"
                    kernel = "cuBLAS" if qs is None else str(cfg or f"{how}: {chosen}")
                    kernel_name = "cuBLAS" if qs is None else (cfg or chosen).kernel
                    rows.append({"gpu": gpu, "shape": name, "N": n, "K": k, "weights": fmt, "T": t, "ms": ms,
                                 "graph_ms": graph_ms, "floor_ms": floor, "ratio_to_floor": graph_ms / floor,
                                 "stream_ms": stream, "ratio_to_stream": graph_ms / stream, "bytes": nbytes,
                                 "rel_err_vs_reference": err, "copy_bw_gbs": bw / 1e9, "kernel": kernel,
                                 "kernel_name": kernel_name, "chosen": qs is not None and cfg is None})
                    print(f"{name:16s} {fmt:8s} T={t}  {ms * 1e3:8.1f} us (graph {graph_ms * 1e3:7.1f})  floor "
                          f"{floor * 1e3:7.1f} us  x{graph_ms / floor:5.2f}  read-only kernel {stream * 1e3:6.1f} us  "
                          f"err {err if err is None else f'{err:.1e}'}  {kernel}")
        del w
        torch.cuda.empty_cache()
    if args.sweep:
        print_best(rows)
    # a run over some of the row counts gets its own file, so the other counts' run in the same call is kept
    subset = "" if sorted(set(args.rows)) == [1, 8] else "_T" + "_".join(map(str, sorted(set(args.rows))))
    write_results(("bench_qmatmul_sweep" if args.sweep else "bench_qmatmul") + subset, rows)


if __name__ == "__main__":
    main()
