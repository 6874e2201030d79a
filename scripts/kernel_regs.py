"""Registers, spills and shared memory of the quantized-matmul kernels (`int8_dp4a` at one row, `int8_mma_groups` at
8) per format and shipped tile, compiled ahead of time for sm_89 (the users' RTX 4090) and sm_90 (H100/H200) by the
installed Triton and its bundled ptxas: no GPU needed. Occupancy follows from registers (65,536 per SM: 128 threads
at 168 registers fit three programs, at 255 two). Counts differ between Triton versions, so each row names the
version that compiled it.

Usage: python scripts/kernel_regs.py -> table + scripts/results/kernel_regs_triton<version>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine.kernels import qdot  # noqa: E402
from engine.kernels.qmatmul import _FMT, _TILES, GROUP  # noqa: E402


def ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for `arch` (newer Triton ships a second, newer one for sm_90 and up)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except ImportError:
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")

ARGS = ("xq_ptr", "xs_ptr", "xsum_ptr", "codes_ptr", "high_ptr", "scales_ptr", "out_ptr", "M", "N", "K", "code_stride",
        "high_stride", "scale_stride")


def signature(kernel: str, fmt: str) -> dict[str, str]:
    """Argument types as qmatmul.launch passes them: `int8_dp4a` reads 32-bit words, the mma kernels bytes (q8
    codes are signed)."""
    codes = "*i32" if kernel == "int8_dp4a" else "*i8" if fmt == "q8" else "*u8"
    xq = "*i32" if kernel == "int8_dp4a" else "*i8"
    types = (xq, "*fp32", "*i32", codes, "*u8", "*fp16", "*fp32", "i32", "i32", "i32", "i32", "i32", "i32")
    return dict(zip(ARGS, types, strict=True))


def resources(fn, sig: dict, consts: dict, arch: int, warps: int, stages: int) -> dict:
    """Registers per thread, shared memory per program (Triton's, for its pipelined loads) and spilled bytes of
    one compiled kernel (ptxas -v on its PTX)."""
    # what the JIT specializes on a real launch: every pointer and every size but M (the rows) is a multiple of
    # 16 on the 27B shapes; without it the counts come out far higher (with spills) than a real launch's
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(ARGS) if name != "M"}
    source = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=aligned)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": warps, "num_stages": stages})
    target = re.search(r"\.target\s+(sm_\w+)", kernel.asm["ptx"]).group(1)  # sm_90a on the H200
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        verbose = subprocess.run([ptxas(arch), f"--gpu-name={target}", "-v", str(ptx), "-o", os.devnull],
                                 capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", verbose)
    spills = re.search(r"(\d+) bytes spill stores", verbose)
    return {"registers": int(regs.group(1)) if regs else None, "shared_bytes": kernel.metadata.shared,
            "spill_store_bytes": int(spills.group(1)) if spills else None}


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = []
    for kernel, block_n, block_k, warps, stages, *_ in _TILES:
        if kernel not in ("int8_dp4a", "int8_mma_groups"):
            continue
        rows_in = 1 if kernel == "int8_dp4a" else 8
        fn = qdot.int8_dp4a_kernel if kernel == "int8_dp4a" else qdot.int8_mma_groups_kernel
        for fmt in ("q4", "q5", "q8"):
            consts = {"FMT": _FMT[fmt], "SPLIT": 1, "BLOCK_N": block_n, "GROUPS": block_k // GROUP, "USE_ASM": True,
                      "PDL": False}
            if kernel == "int8_dp4a":
                consts.update(ROWS=rows_in, ROWS_P2=rows_in)
            else:
                consts.update(PREFETCH_LINES=0)
            for arch in (89, 90):
                r = resources(fn, signature(kernel, fmt), consts, arch, warps, stages)
                row = {"triton": triton.__version__, "arch": f"sm_{arch}", "kernel": kernel, "weights": fmt,
                       "rows": rows_in, "block_n": block_n, "block_k": block_k, "warps": warps, "stages": stages, **r}
                if row not in rows:
                    rows.append(row)
                    print(f"{kernel:15s} {fmt} sm_{arch} {block_n:3d} x {block_k:3d} {warps} warps {stages} stages: "
                          f"{r['registers']} registers, {r['shared_bytes']} B shared, "
                          f"{r['spill_store_bytes']} B spilled")
    print(f"wrote {write_results('kernel_regs', rows, tag=f'triton{triton.__version__}')}")


if __name__ == "__main__":
    main()
