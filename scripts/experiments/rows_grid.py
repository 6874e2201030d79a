"""Experiment, measured and lost (not the product path; its outcome in the experiments README, its rows in
scripts/results/rows_grid_*.json): several requests' verify rows (16, 32, 64) times the 27B's tiled q4/q5
weights with a grid of blocks over the rows.

Today a tiled matmul of 9-64 rows (`qtiled`'s `tiled_mma_streamed`) runs every row in one block, streaming x
through shared memory: the weights are read once, but at 64 rows a block holds 8 n8 accumulators per tile (161-255
registers, 1-3 blocks per SM) and the down projection's 40 column tiles need a K split, whose fp32 partials a sum
launch (or the norm after) reads again. In a 4-8 request DFlash K=7 round on an H100 the streamed matmuls took
~2.5x the one-token step's bytes floor and their sums half as much again (engine/kernels/NOTES.md 9). Here the
block index also picks a chunk of rows (8 for `tiled_mma`, 16 or 32 for the streamed kernel), the chunks of one
weight tile neighbours in launch order so that every chunk after the first finds the tile's bytes in L2: fewer
registers, and enough blocks without a K split. The source is qtiled's with the row offset added by text
substitution (anchors asserted), so it follows the product kernel.

For the 27B's tiled matmuls in the 8k-speed formats at 16, 32 and 64 rows: every candidate the product lists
(`qmatmul.candidates`, launched by `qmatmul.launch`) and every row-grid candidate, each timed as the engine's
chooser times them (in a CUDA graph, L2 flushed, K-slices summed) and checked against the int8-row reference;
the best of each list against the bytes floor at the copy rate measured in the same run.

Usage: python scripts/experiments/rows_grid.py [--rows 16 32 64]  -> table + rows_grid_<gpu>.json ($OUT or
scripts/results/)
       python scripts/experiments/rows_grid.py --ptx-only (no GPU: the patched source compiles for sm_89, sm_90)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE.parent)]  # the engine, and the benchmarks' helpers in scripts/

from bench_qmatmul import SHAPES as BENCH_SHAPES  # noqa: E402
from bench_util import copy_bandwidth, write_results  # noqa: E402

from engine import cuda_launch, nvrtc  # noqa: E402
from engine.kernels import pdl, qtiled  # noqa: E402
from engine.kernels.actquant import quantize_rows  # noqa: E402
from engine.kernels.qmatmul import (  # noqa: E402
    _STREAMED,
    _TILED,
    QConfig,
    SplitK,
    candidates,
    int8_rows_reference,
    launch,
)
from engine.kernels.timing import graph_ms  # noqa: E402
from engine.quant.qweight import GROUP, quantize, tile  # noqa: E402

SHAPES = [s for s in BENCH_SHAPES if s[3] in ("q4", "q5")]  # the tiled ones (the q8 LM head stays row-major)

# (anchor in qtiled.SOURCE, replacement): the row chunk from the block index, x's pointers and M moved to it, the
# stores offset by it
PATCHES = [
    ("""       int out_rows, int out_kind) {""", """       int out_rows, int out_kind, int block_rows) {"""),
    ("""    const int base = (blockIdx.x * WARPS + warp) * MT * 16;  // the warp's first row (N is a multiple of 16)""",
     """    const int chunks = (M + block_rows - 1) / block_rows;
    const int first_row = blockIdx.x % chunks * block_rows;
    xq += (long)first_row * K;
    xs += (long)first_row * groups;
    xsum += (long)first_row * groups;
    M = min(block_rows, M - first_row);
    const int base = (blockIdx.x / chunks * WARPS + warp) * MT * 16;"""),
    ("""                if (m < M) store(out, slice + (long)m * N + row, acc[t][j][q], out_kind);""",
     """                if (m < M) store(out, slice + (long)(first_row + m) * N + row, acc[t][j][q], out_kind);"""),
    ("""            if (m < M) store(out, slice + (long)m * N + row, acc[t][j], out_kind);""",
     """            if (m < M) store(out, slice + (long)(first_row + m) * N + row, acc[t][j], out_kind);"""),
]


def source() -> str:
    s = qtiled.SOURCE
    for anchor, new in PATCHES:
        assert s.count(anchor) == 1, f"qtiled.SOURCE changed: {anchor.strip()[:60]}"
        s = s.replace(anchor, new)
    return s


def ptx(fmt: str, warps: int, mt: int, unroll: int, chunks: int, arch: str, with_pdl: bool) -> bytes:
    options = [f"-DFMT={fmt[1:]}", f"-DWARPS={warps}", f"-DMT={mt}", f"-DUNROLL={unroll}", "-DROWS1=0", "-DXREG=0",
               "-DSCALE_BF16=1", f"-DPDL={int(with_pdl)}", f"-DNB={chunks}"]
    return nvrtc.compile_ptx(source(), "rows_grid.cu", arch, options)


_loaded: dict[tuple, object] = {}


def kernel(fmt: str, warps: int, mt: int, unroll: int, chunks: int, device: torch.device, with_pdl: bool):
    major, minor = torch.cuda.get_device_capability(device)
    key = (fmt, warps, mt, unroll, chunks, with_pdl)
    if key not in _loaded:
        from torch.cuda._utils import _cuda_load_module

        code = ptx(fmt, warps, mt, unroll, chunks, f"{major}{minor}", with_pdl)
        _loaded[key] = _cuda_load_module(code, ["qtiled"])["qtiled"]
    return _loaded[key]


def grid_candidates(n: int, k: int, sms: int, rows: int) -> list[tuple[QConfig, int]]:
    """(tile, rows per block): `tiled_mma` in 8-row blocks, `tiled_mma_streamed` in blocks of 16 or 32 (fewer than
    `rows`), every split whose shared memory fits and whose blocks stay within 8 per SM (the smallest always)."""
    groups = k // GROUP
    shapes = [("tiled_mma", warps, mt, unroll, 8) for warps, mt, unroll, _, many in _TILED if many]
    shapes += [("tiled_mma_streamed", warps, mt, unroll, block) for warps, mt, unroll in _STREAMED
               for block in (16, 32) if block < rows]
    out = []
    for name, warps, mt, unroll, block in shapes:
        streamed = name == "tiled_mma_streamed"
        blocks = -(-n // (16 * warps * mt)) * -(-rows // block)
        fits = [s for s in range(1, groups // unroll + 1) if groups % s == 0 and (groups // s) % unroll == 0
                and qtiled.shared_bytes(groups // s, False, False, unroll, block // 8 if streamed else 1)
                <= qtiled.SHARED_LIMIT]
        splits = [s for s in fits if s == fits[0] or blocks * s <= 8 * sms]
        out += [(QConfig(name, 16 * warps * mt, GROUP * unroll, warps, 0, s), block) for s in splits]
    return out


def grid_launch(x: torch.Tensor, w, cfg: QConfig, block: int) -> torch.Tensor:
    """x @ w.T on the row grid, K-slices summed: [M, N] in x's dtype."""
    xq, xs, xsum = quantize_rows(x, True)
    m, k = xq.shape
    n = w.out_features
    mt, unroll = cfg.block_n // (16 * cfg.warps), cfg.block_k // GROUP
    streamed = cfg.kernel == "tiled_mma_streamed"
    chunks = block // 8 if streamed else 1
    per = k // GROUP // cfg.split
    shared = qtiled.shared_bytes(per, False, False, unroll, chunks)
    if cfg.split == 1:
        out, kind = torch.empty(m, n, dtype=x.dtype, device=x.device), qtiled._OUT_KIND[x.dtype]
    else:
        out, kind = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device), 0
    with_pdl = pdl.on(xq)
    fn = kernel(w.fmt, cfg.warps, mt, unroll, chunks, x.device, with_pdl)
    grid = (-(-n // (16 * cfg.warps * mt)) * -(-m // block), cfg.split, 1)
    cuda_launch.launch(fn, grid, (32 * cfg.warps, 1, 1), shared, [xq, xs, xsum, w.codes, w.high if w.high is not None
                       else w.codes, w.scales, out, m, n, k, per, m, kind, block], with_pdl)
    return out if cfg.split == 1 else SplitK(out, x.dtype, (m, n)).dense()


def brief(cfg: QConfig, block: int = 0) -> str:
    return f"{cfg.kernel} w{cfg.warps} bn{cfg.block_n} bk{cfg.block_k} s{cfg.split}" + (f" rows/block {block}"
                                                                                         if block else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--ptx-only", action="store_true")
    args = p.parse_args()
    if args.ptx_only:
        for arch in ("89", "90"):
            for fmt in ("q4", "q5"):
                for chunks in (1, 2, 4):
                    ptx(fmt, 4, 1, 4, chunks, arch, arch == "90")
        print("the patched source compiles for sm_89 and sm_90")
        return
    gpu = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, n, k, fmt in SHAPES:
        q = tile(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5, fmt))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            want = int8_rows_reference(x, q).float()
            floor = (q.nbytes + x.nbytes + rows * n * 2) / bw * 1e3
            tried = [(c, 0) for c in candidates(n, k, sms, fmt, rows, tiled=True)] + grid_candidates(n, k, sms, rows)
            best: dict[bool, tuple[float, QConfig, int]] = {}
            for cfg, block in tried:
                def call(c=cfg, b=block, x=x, q=q):
                    return grid_launch(x, q, c, b) if b else launch(x, q, c)
                got = call().float()
                err = ((got - want).norm() / want.norm()).item()
                ms = graph_ms(call, calls=8, reps=10, flush_l2=True)
                out.append({"gpu": gpu, "shape": name, "N": n, "K": k, "fmt": fmt, "rows": rows,
                            "kernel": cfg.kernel, "block_n": cfg.block_n, "block_k": cfg.block_k, "warps": cfg.warps,
                            "split": cfg.split, "rows_per_block": block, "row_grid": block > 0, "us": ms * 1e3,
                            "floor_us": floor * 1e3, "rel_err": err})
                if err > 8e-3:
                    print(f"WRONG {name} rows {rows} {brief(cfg, block)}: rel err {err:.2e}")
                grid = block > 0
                if grid not in best or ms < best[grid][0]:
                    best[grid] = (ms, cfg, block)
            (old_ms, old, _), (new_ms, new, block) = best[False], best[True]
            print(f"{name:24s} {fmt} rows {rows:2d}  floor {floor * 1e3:6.1f} us  product {old_ms * 1e3:7.1f} us "
                  f"(x{old_ms / floor:4.2f})  row grid {new_ms * 1e3:7.1f} us (x{new_ms / floor:4.2f})  "
                  f"{old_ms / new_ms:4.2f}x  product: {brief(old)}  row grid: {brief(new, block)}")
        del q
        torch.cuda.empty_cache()
    print("wrote", write_results("rows_grid", out))


if __name__ == "__main__":
    main()
