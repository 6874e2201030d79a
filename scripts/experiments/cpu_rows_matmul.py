"""Two ways to make a CPU matmul step of several rows cheaper per row than `cpu_gguf.c`'s (#45, NOTES.md 8), on
SmolLM2's Q4_1 gate_up and down weights, 1-16 rows of x, against the shipped kernel in the same process:

- `fp32`: each weight block unpacked to fp32 once for all x rows, then fp32 FMAs per row (a different rounding);
- `shared`: the shipped kernel's int16 arithmetic per (weight row, x row), each weight block widened once for all
  x rows (bit-equal to the shipped kernel, checked here).

Each is compiled into a copy of the kernels (`cpu_kernels.c` with the variant's dot product swapped into
`linear_share` for groups of four Q4 rows), loaded beside the shipped build; medians of 300 calls.

Usage: python scripts/experiments/cpu_rows_matmul.py [--threads 1] -> table + scripts/results/cpu_rows_matmul_cpu.json
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_util import write_results  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.kernels import cpu_build, cpu_gguf  # noqa: E402
from engine.quant.gguf_blocks import dequantize  # noqa: E402
from ninfer_tui.models import resolve  # noqa: E402

FP32 = r"""
static void rows_variant(int t, const uint8_t *w, int64_t rb, const float *x, int64_t k, const BlockedX *bx,
                         int64_t m, float *y, int64_t ldy) {
    const int64_t bs = t == Q4_0 ? 18 : 20, off = t == Q4_0 ? 2 : 4, nb = k / 32;
    const __m128i mask = _mm_set1_epi8(0xF);
    __m256 acc[MAX_X_ROWS][4];
    __m128 mins[MAX_X_ROWS];
    for (int64_t i = 0; i < m; i++) {
        mins[i] = _mm_setzero_ps();
        for (int r = 0; r < 4; r++) acc[i][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(w + b * 4 * bs, 4 * rb);
        uint16_t dh[4], mh[4];
        for (int r = 0; r < 4; r++) {
            memcpy(&dh[r], w + r * rb + b * bs, 2);
            memcpy(&mh[r], w + r * rb + b * bs + 2, 2);
        }
        const __m128 d4 = _mm_cvtph_ps(_mm_setr_epi16((short)dh[0], (short)dh[1], (short)dh[2], (short)dh[3],
                                                      0, 0, 0, 0));
        const __m128 m4 = t == Q4_0 ? _mm_mul_ps(d4, _mm_set1_ps(-8.0f))
            : _mm_cvtph_ps(_mm_setr_epi16((short)mh[0], (short)mh[1], (short)mh[2], (short)mh[3], 0, 0, 0, 0));
        float dr[4];
        _mm_storeu_ps(dr, d4);
        for (int64_t i = 0; i < m; i++) mins[i] = _mm_add_ps(mins[i], _mm_mul_ps(m4, _mm_set1_ps(bx[i].sum[b])));
        for (int r = 0; r < 4; r++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w + r * rb + b * bs + off));
            const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            const __m256 d = _mm256_set1_ps(dr[r]);
            for (int64_t i = 0; i < m; i++) {
                const float *xb = x + i * k + 32 * b;
                __m256 s = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
                s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), s);
                s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), s);
                s = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), s);
                acc[i][r] = _mm256_fmadd_ps(d, s, acc[i][r]);
            }
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float mm[4];
        _mm_storeu_ps(mm, mins[i]);
        for (int r = 0; r < 4; r++) y[i * ldy + r] = hsum(acc[i][r]) + mm[r];
    }
}
"""

SHARED = r"""
static void rows_variant(int t, const uint8_t *w, int64_t rb, const float *x, int64_t k, const BlockedX *bx,
                         int64_t m, float *y, int64_t ldy) {
    (void)x;
    const int64_t bs = t == Q4_0 ? 18 : 20, off = t == Q4_0 ? 2 : 4, nb = k / 32;
    const __m256i mask = _mm256_set1_epi16(0xF);
    const __m256 unit = _mm256_set1_ps(1.0f / 32768);
    __m256 acc[MAX_X_ROWS][4], mins[MAX_X_ROWS];
    for (int64_t i = 0; i < m; i++) {
        mins[i] = _mm256_setzero_ps();
        for (int r = 0; r < 4; r++) acc[i][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(w + b * 4 * bs, 4 * rb);
        uint32_t head[4];
        __m256i qa[4], qb[4];
        for (int r = 0; r < 4; r++) {
            memcpy(&head[r], w + r * rb + b * bs, 4);
            if (t == Q4_0) head[r] = (head[r] & 0xFFFF) * 0x10001u;
            const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + r * rb + b * bs + off)));
            qa[r] = _mm256_and_si256(v, mask);
            qb[r] = _mm256_srli_epi16(v, 4);
        }
        const __m256 dm = _mm256_cvtph_ps(_mm_set_epi32((int)head[3], (int)head[2], (int)head[1], (int)head[0]));
        for (int64_t i = 0; i < m; i++) {
            const int16_t *xq = bx[i].q, *lo = bx[i].lo;
            const __m256i h0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
            const __m256i h1 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b + 16));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b + 16));
            const __m256 xv = _mm256_blend_ps(_mm256_set1_ps(bx[i].scale[b]),
                                              _mm256_set1_ps(t == Q4_0 ? -8.0f * bx[i].sum[b] : bx[i].sum[b]), 0xAA);
            const __m256 scaled = _mm256_mul_ps(dm, xv);
            mins[i] = _mm256_add_ps(mins[i], scaled);
            for (int r = 0; r < 4; r++) {
                const __m256i ph = _mm256_add_epi32(_mm256_madd_epi16(qa[r], h0), _mm256_madd_epi16(qb[r], h1));
                const __m256i pl = _mm256_add_epi32(_mm256_madd_epi16(qa[r], l0), _mm256_madd_epi16(qb[r], l1));
                const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), unit, _mm256_cvtepi32_ps(ph));
                acc[i][r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(scaled, _mm256_set1_epi32(2 * r)), s, acc[i][r]);
            }
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float mm[8];
        _mm256_storeu_ps(mm, mins[i]);
        for (int r = 0; r < 4; r++) y[i * ldy + r] = hsum(acc[i][r]) + mm[2 * r + 1];
    }
}
"""

ANCHOR = ("/* y[r * ldy] = W[r] . x for the `rows` rows of W from w on (the callers take rows in groups of "
          "ROW_GROUP). */")
CALL = ("            for (int64_t i = 0; i < m; i++) dot_rows(t, w + j * rb, rb, rows, x + i * k, &bx[i], k, "
        "y + i * ldy + j, 1);")
SWAPPED = ("            if (rows == 4 && (t == Q4_0 || t == Q4_1)) "
           "rows_variant(t, w + j * rb, rb, x, k, bx, m, y + j, ldy);\n"
           "            else for (int64_t i = 0; i < m; i++) dot_rows(t, w + j * rb, rb, rows, x + i * k, &bx[i], k, "
           "y + i * ldy + j, 1);")


def build(variant: str, folder: Path) -> ctypes.CDLL:
    """The kernels with `variant`'s dot product for groups of four Q4 rows."""
    for src in cpu_build.SOURCE.parent.glob("cpu_*.c"):
        shutil.copy(src, folder)
    gguf = folder / "cpu_gguf.c"
    text = gguf.read_text()
    assert ANCHOR in text and CALL in text, "cpu_gguf.c changed: update the experiment's anchors"
    gguf.write_text(text.replace(ANCHOR, "#ifdef HAVE_AVX2\n" + variant + "#endif\n" + ANCHOR).replace(CALL, SWAPPED))
    out = folder / "variant.so"
    subprocess.run(["cc", *cpu_build.FLAGS, "-march=native", str(folder / "cpu_kernels.c"), "-o", str(out), "-lm",
                    "-lpthread"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.ninfer_gguf_linear.argtypes = cpu_gguf._SIGNATURES["ninfer_gguf_linear"][0]
    lib.ninfer_gguf_linear.restype = ctypes.c_int
    return lib


def timed(lib: ctypes.CDLL, part, k: int, x: torch.Tensor, threads: int) -> tuple[float, torch.Tensor]:
    m = x.shape[0]
    y = torch.empty(m, part.rows)
    times = []
    for _ in range(300):
        t = time.perf_counter()
        lib.ninfer_gguf_linear(part.qtype, part.data.data_ptr(), part.rows, k, x.data_ptr(), m, y.data_ptr(),
                               part.rows, threads)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine(EngineConfig(resolve("smollm2-135m", announce=False), device="cpu", dtype="float32"))
    shipped = cpu_gguf.library()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = {}
        for name, code in (("fp32", FP32), ("shared", SHARED)):
            (Path(tmp) / name).mkdir()
            variants[name] = build(code, Path(tmp) / name)
        print(f"{'weight':8s} {'rows':>4s} {'shipped us':>10s} {'fp32':>8s} {'shared':>8s}  shared bit-equal")
        for name in ("gate_up", "down"):
            w = eng.model.layers[3][name]
            part, k = w.parts[0], w.in_features
            want = dequantize(w, torch.float64)
            for m in (1, 2, 4, 8, 16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                base, y0 = timed(shipped, part, k, x, args.threads)
                got = {v: timed(lib, part, k, x, args.threads) for v, lib in variants.items()}
                ref = x.double() @ want.T
                row = {"weight": name, "rows": m, "threads": args.threads, "shipped_us": base,
                       **{f"{v}_us": us for v, (us, _) in got.items()},
                       **{f"{v}_rel_error": float((y - ref).norm() / ref.norm()) for v, (_, y) in got.items()},
                       "shipped_rel_error": float((y0 - ref).norm() / ref.norm()),
                       "shared_bit_equal": bool(torch.equal(got["shared"][1], y0))}
                rows.append(row)
                print(f"{name:8s} {m:4d} {base:10.1f} {row['fp32_us']:8.1f} {row['shared_us']:8.1f}  "
                      f"{row['shared_bit_equal']}")
    print("wrote", write_results("cpu_rows_matmul", rows, tag="cpu"))


if __name__ == "__main__":
    main()
