"""Experiment, waiting for a GPU (not the product path): the tiled matmuls' K-slices summed inside the kernel.

Today a tiled matmul (`qtiled`) with SPLIT > 1 K-slices writes fp32 partials and a second launch sums them
(`sum_slices`, or the residual norm for <= 4 slices): 176 such launches per DFlash K=7 round and 249 per tiled
T=1 step of the 27B, 0.42-0.49 ms of kernel time plus their launch gaps (H200, lab notes (16),
results/profile_round_NVIDIA_H200.json). Here each block, after writing its partials, takes a ticket for its
column tile (an atomic counter); the block that takes the last one sums the tile's slices in slice order, as the
sum kernel does, writes the output in its dtype, and sets the counter back to 0 for the next launch. No second
launch. The source is qtiled's with that epilogue added by text substitution (anchors asserted), so it follows
the product kernel.

For the 27B matmuls in the 8k-speed formats, 1 and 8 rows, every split `tiled_candidates` lists:
- the ticket kernel's output against the product's (kernel + slice sum): equal bits expected (the same fp32 adds
  in the same order, the same rounding to bf16);
- device time per call inside a CUDA graph (weights cycled over copies larger than L2), both ways; the shape's
  best of each.

Usage: python scripts/experiments/splitk_ticket.py -> table + scripts/results/splitk_ticket_<gpu>.json (or $OUT/)
       python scripts/experiments/splitk_ticket.py --ptx-only [--nvcc] (no GPU: compile for sm_89 and sm_90 only)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE.parent)]  # the engine, and the benchmarks' helpers in scripts/

from bench_qmatmul import COPIES, SHAPES  # noqa: E402
from bench_util import time_graph_ms, write_results  # noqa: E402

from engine.kernels import qtiled  # noqa: E402
from engine.kernels.actquant import quantize_rows  # noqa: E402
from engine.kernels.qmatmul import SplitK, tiled_candidates  # noqa: E402
from engine.quant.qweight import GROUP, quantize, tile  # noqa: E402

SIGNATURE = "int out_rows, int out_kind) {"
END = "#endif\n    }\n}\n"  # the store loop's end, then the kernel's
EPILOGUE = r"""
    if (tickets != nullptr) {
        __shared__ int last;
        __threadfence();  // this block's partials are in L2 before its ticket is counted
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1) == (int)gridDim.y - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* parts = reinterpret_cast<const float*>(out);
        const long per_slice = (long)out_rows * N;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const int r0 = base + t * 16 + gid;
            if (!rok[t]) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#if ROWS1
                // row j's sum of the tile rows r0, r0 + 8 (j = 0, 1), stored by lane tid 0 as the partials were
                if (j > 1 || tid != 0) continue;
                const long i = r0 + 8 * j;
#else
                const int m = 2 * tid + (j & 1);
                if (m >= M) continue;
                const long i = (long)m * N + r0 + (j >> 1) * 8;
#endif
                float v = 0.0f;
                for (int s = 0; s < (int)gridDim.y; ++s) v += __ldcg(parts + s * per_slice + i);  // L2, not L1
                store(final_out, i, v, final_kind);
            }
        }
        if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
    }
"""


def source() -> str:
    src = qtiled.SOURCE
    assert src.count(SIGNATURE) == 1 and src.endswith(END), "qtiled's source changed: update the anchors"
    src = src.replace(SIGNATURE, "int out_rows, int out_kind, int* __restrict__ tickets, void* __restrict__ final_out, "
                      "int final_kind) {")
    return src[:-len("}\n")] + EPILOGUE + "}\n"


def options(fmt: str, warps: int, mt: int, unroll: int, one_row: bool, xreg: bool) -> list[str]:
    return [f"-DFMT={fmt[1:]}", f"-DWARPS={warps}", f"-DMT={mt}", f"-DUNROLL={unroll}", f"-DROWS1={int(one_row)}",
            f"-DXREG={int(one_row and xreg)}", "-DSCALE_BF16=1"]


def ptx_only(use_nvcc: bool) -> None:
    """Compile every variant for the users' and the H200's architectures (no GPU needed)."""
    for arch in ("89", "90"):
        for fmt in ("q4", "q5"):
            for one_row, xreg in ((False, False), (True, False), (True, True)):
                opts = options(fmt, 4, 1, 4, one_row, xreg)
                if use_nvcc:  # a toolkit's compiler where torch brings no NVRTC (a CPU build)
                    with tempfile.TemporaryDirectory() as d:
                        cu = Path(d) / "ticket.cu"
                        cu.write_text(source())
                        subprocess.run(["nvcc", "-cubin", f"-arch=sm_{arch}", "-Xptxas", "-v", *opts, "-o",
                                        str(Path(d) / "t.cubin"), str(cu)], check=True, capture_output=True)
                else:
                    from engine import nvrtc

                    nvrtc.compile_ptx(source(), "ticket.cu", arch, opts)
                print(f"sm_{arch} {fmt} rows1={one_row} xreg={xreg}: compiled")


_loaded: dict[tuple, object] = {}


def kernel(fmt: str, warps: int, mt: int, unroll: int, one_row: bool, xreg: bool):
    key = (fmt, warps, mt, unroll, one_row, xreg)
    if key not in _loaded:
        from torch.cuda._utils import _cuda_load_module

        from engine import nvrtc

        major, minor = torch.cuda.get_device_capability()
        code = nvrtc.compile_ptx(source(), "ticket.cu", f"{major}{minor}", options(*key))
        _loaded[key] = _cuda_load_module(code, ["qtiled"])["qtiled"]
    return _loaded[key]


TICKETS = None  # one counter per column tile, left at 0 by every launch


def ticket_launch(xq, xs, xsum, w, cfg, out_dtype):
    """qtiled.launch with the slices summed in the kernel: [M, N] in out_dtype."""
    global TICKETS
    m, k = xq.shape
    n = w.out_features
    mt, unroll, one_row = cfg.block_n // (16 * cfg.warps), cfg.block_k // GROUP, m == 1
    per = k // GROUP // cfg.split
    grid = (-(-n // (16 * cfg.warps * mt)), cfg.split, 1)
    if TICKETS is None or TICKETS.numel() < grid[0]:
        TICKETS = torch.zeros(max(grid[0], 4096), dtype=torch.int32, device=xq.device)
    parts = torch.empty(cfg.split, m, n, dtype=torch.float32, device=xq.device)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    high = w.high if w.high is not None else w.codes
    fn = kernel(w.fmt, cfg.warps, mt, unroll, one_row, cfg.kernel == "tiled_dp4a_xreg")
    shared = qtiled.shared_bytes(per, one_row, cfg.kernel == "tiled_dp4a_xreg")
    for r in range(0, m, qtiled.MAX_ROWS):
        rows = min(qtiled.MAX_ROWS, m - r)
        fn(grid=grid, block=(32 * cfg.warps, 1, 1), shared_mem=shared,
           args=[xq[r:], xs[r:], xsum[r:], w.codes, high, w.scales, parts.view(-1)[r * n:], rows, n, k, per, m, 0,
                 TICKETS, out.view(-1)[r * n:], qtiled._OUT_KIND[out_dtype]])
    return out


def product_launch(xq, xs, xsum, w, cfg, out_dtype):
    mt, unroll = cfg.block_n // (16 * cfg.warps), cfg.block_k // GROUP
    out = qtiled.launch(xq, xs, xsum, w, cfg.split, cfg.warps, mt, unroll, out_dtype, cfg.kernel == "tiled_dp4a_xreg")
    return SplitK(out, out_dtype, (xq.shape[0], w.out_features)).dense()


def graph_us(fn, x_rows: tuple, ws: list, cfg, dtype) -> float:
    """Device us per call inside a CUDA graph, cycling the weight copies."""
    i = [0]

    def step():
        i[0] = (i[0] + 1) % COPIES
        return fn(*x_rows, ws[i[0]], cfg, dtype)

    return time_graph_ms(step) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ptx-only", action="store_true")
    p.add_argument("--nvcc", action="store_true", help="with --ptx-only: compile with the toolkit's nvcc")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    if args.ptx_only:
        ptx_only(args.nvcc)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k, fmt in SHAPES:
        if fmt not in ("q4", "q5"):
            continue
        ws = [tile(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5, fmt))
              for _ in range(COPIES)]
        for t in args.rows:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
            xq, xs, xsum = quantize_rows(x, True)
            best = {}
            for cfg in tiled_candidates(n, k, sms, t):
                if cfg.split == 1:
                    continue
                want = product_launch(xq, xs, xsum, ws[0], cfg, x.dtype)
                got = ticket_launch(xq, xs, xsum, ws[0], cfg, x.dtype)
                again = ticket_launch(xq, xs, xsum, ws[0], cfg, x.dtype)  # the counters were left at 0
                equal = bool(torch.equal(want, got) and torch.equal(got, again))
                times = {way: graph_us(fn, (xq, xs, xsum), ws, cfg, x.dtype)
                         for way, fn in (("kernel + sum", product_launch), ("ticket", ticket_launch))}
                row = {"gpu": torch.cuda.get_device_name(), "shape": name, "fmt": fmt, "rows": t,
                       "kernel": cfg.kernel, "block_n": cfg.block_n, "block_k": cfg.block_k, "warps": cfg.warps,
                       "split": cfg.split, "equal_bits": equal, "us_kernel_plus_sum": times["kernel + sum"],
                       "us_ticket": times["ticket"]}
                rows.append(row)
                for way, key in (("kernel + sum", "us_kernel_plus_sum"), ("ticket", "us_ticket")):
                    if way not in best or row[key] < best[way][0]:
                        best[way] = (row[key], cfg)
                print(f"{name:26s} {t} rows {cfg.kernel} bn={cfg.block_n} bk={cfg.block_k} split={cfg.split:2d}: "
                      f"kernel+sum {times['kernel + sum']:7.1f} us, ticket {times['ticket']:7.1f} us, "
                      f"equal bits {equal}")
            if best:
                print(f"  best: kernel+sum {best['kernel + sum'][0]:.1f} us (split {best['kernel + sum'][1].split}), "
                      f"ticket {best['ticket'][0]:.1f} us (split {best['ticket'][1].split})")
    print("wrote", write_results("splitk_ticket", rows))


if __name__ == "__main__":
    main()
