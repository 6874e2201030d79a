"""The int8 activation-row quantizer as a Triton function (module-level, so other kernels can call it): the
`actquant` kernel runs it alone, and the kernels that produce a matmul's input rows (RMSNorm variants, SiLU*up)
run it on the values they have just computed, which saves the separate quantize launch before the matmul.
The math and layout are actquant.py's (per row and group of 64: absmax scale, rounded int8 codes, code sums;
q4/q5 rows as even-k / odd-k planes)."""
import triton
import triton.language as tl

from .pdl import enter


@triton.jit
def quantize_groups(x, g0, g_ok, row, K, codes_ptr, scales_ptr, sums_ptr, SPLIT: tl.constexpr,
                    GROUPS: tl.constexpr):
    """x [GROUPS, 64] fp32: groups g0 .. g0+GROUPS-1 of row `row` (K columns); g_ok [GROUPS] masks them."""
    rg = g0 + tl.arange(0, GROUPS)
    ri = tl.arange(0, 64)
    groups = K // 64
    absmax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)
    codes = tl.minimum(tl.maximum(tl.floor(x * (127.0 / absmax)[:, None] + 0.5), -127.0), 127.0)
    k = rg[:, None] * 64 + ri[None, :]
    dest = k
    if SPLIT:
        dest = (k % 2) * (K // 2) + k // 2
    tl.store(codes_ptr + row * K + dest, codes.to(tl.int8), mask=g_ok[:, None])
    tl.store(scales_ptr + row * groups + rg, absmax / 127.0, mask=g_ok)
    tl.store(sums_ptr + row * groups + rg, tl.sum(codes, 1).to(tl.int32), mask=g_ok)


@triton.jit
def quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, sums_ptr, K, SPLIT: tl.constexpr, GROUPS: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    row, pid = tl.program_id(0), tl.program_id(1)
    g0 = pid * GROUPS
    rg = g0 + tl.arange(0, GROUPS)
    g_ok = rg < K // 64
    k = rg[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(x_ptr + row * K + k, mask=g_ok[:, None], other=0.0).to(tl.float32)
    quantize_groups(x, g0, g_ok, row, K, codes_ptr, scales_ptr, sums_ptr, SPLIT, GROUPS)
