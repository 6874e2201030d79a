"""qmatmul's int8-row kernels over row-major weights: integer dot products of quantized weights with int8
activation rows (see qmatmul.py and actquant.py). `int8_dp4a_kernel` multiplies with dp4a (the one-row decode
kernel), `int8_mma_kernel` and `int8_mma_groups_kernel` on int8 tensor cores (the verify and batch kernels).
A q4 word holds codes 8w..8w+7 (+8), even k in the low nibbles: masked to 0x0F0F0F0F it is four unsigned byte
lanes that dp4a multiplies with a word of x's even plane; shifted by 4, with the odd plane. q5 ORs each lane's
5th bit in at bit 4 (the bit plane's byte w spread by one multiply). USE_ASM is off only in the interpreter,
which runs the same sums in plain integer ops."""
import triton
import triton.language as tl

from .pdl import enter


@triton.jit
def dp4a(a, b, c, SIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    if USE_ASM:
        if SIGNED:
            d = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            d = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        d = c
        for i in tl.static_range(4):
            ai = (a >> (8 * i)) & 0xFF
            if SIGNED:
                ai = (ai ^ 0x80) - 0x80
            d += ai * ((((b >> (8 * i)) & 0xFF) ^ 0x80) - 0x80)
    return d


@triton.jit
def spread(bits):
    # bits 0, 2, 4, 6 of a byte -> bit 4 of byte lanes 0..3 (the partial products never carry into them)
    return ((bits & 0x55) * 0x410410) & 0x10101010


@triton.jit
def prefetch_rows(ptr, rows, stride, first, last, LINE: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for LINES lines of LINE elements of each of `rows`, from element `first` of the row on (clamped to
    `last`, the row's slice end, so no address leaves it); returns no value and waits for nothing."""
    at = rows.to(tl.int64)[:, None] * stride + tl.minimum(first + tl.arange(0, LINES)[None, :] * LINE, last)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + at], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def row_tile(codes_ptr, high_ptr, scales_ptr, rn, n_ok, rw, rg, g0, code_stride, high_stride, scale_stride,
             FMT: tl.constexpr, WPG: tl.constexpr):
    """`int8_dp4a_kernel`'s weight tile at group g0: code words [BLOCK_N, GROUPS * WPG], q5's bit-plane bytes
    (the words again for q4/q8, unused) and the group scales."""
    ok = n_ok[:, None]
    wi = g0 * WPG + rw
    words = tl.load(codes_ptr + rn[:, None] * code_stride + wi[None, :], mask=ok, other=0)
    hb = words
    if FMT == 5:
        hb = tl.load(high_ptr + rn[:, None] * high_stride + wi[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(scales_ptr + rn[:, None] * scale_stride + (g0 + rg)[None, :], mask=ok, other=0.0).to(tl.float32)
    return words, hb, s


@triton.jit
def int8_dp4a_kernel(xq_ptr, xs_ptr, xsum_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K,
                     code_stride, high_stride, scale_stride,
                     FMT: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """dp4a over 32-bit weight words, the rows of x one after another over 2-D tiles (ROWS = M; ROWS_P2 the
    next power of two): a row's arithmetic and summation order are those of a one-row call. Each iteration issues
    the loads of the next weight tile before it computes on the one it holds in registers: Triton pipelines only
    loads that feed a dot, and without this every iteration of a long K row (the N = 5120 projections) waited one
    full memory latency. A prefetch past the K-slice's end reads its last tile again (from L2), never outside it.
    (Two tiles ahead, x's rows fetched ahead too, the group sums deferred to one reduction after the loop, or
    asking L2 for the next matmul's weights as the programs end all measured no faster.)"""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, ROWS_P2)
    n_ok = rn < N
    groups = K // 64
    per = groups // SPLIT
    WPG: tl.constexpr = 16 if FMT == 8 else 8
    rw = tl.arange(0, GROUPS * WPG)
    rg = tl.arange(0, GROUPS)
    x_row = K // 4
    start, end = pid_k * per, (pid_k + 1) * per
    words, hb, s = row_tile(codes_ptr, high_ptr, scales_ptr, rn, n_ok, rw, rg, start, code_stride, high_stride,
                            scale_stride, FMT, WPG)
    # the first weight tile is in flight before the wait: weights never depend on the kernel before. (Asking L2
    # for the next two tiles there as well was slower: those requests compete with the first tile's loads.)
    enter(PDL)
    acc = tl.zeros((ROWS_P2, BLOCK_N), dtype=tl.float32)
    for g0 in range(start, end, GROUPS):
        words1, hb1, s1 = row_tile(codes_ptr, high_ptr, scales_ptr, rn, n_ok, rw, rg,
                                   tl.minimum(g0 + GROUPS, end - GROUPS), code_stride, high_stride, scale_stride,
                                   FMT, WPG)
        wi = g0 * WPG + rw
        gi = g0 + rg
        if FMT != 8:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
            if FMT == 5:
                lo = lo | spread(hb)
                hi = hi | spread(hb >> 1)
        for m in tl.static_range(ROWS):
            xe = tl.load(xq_ptr + m * x_row + wi)
            xo = xe if FMT == 8 else tl.load(xq_ptr + m * x_row + K // 8 + wi)
            if FMT == 8:
                d = dp4a(words, tl.broadcast_to(xe[None, :], (BLOCK_N, GROUPS * WPG)), 0, True, USE_ASM)
            else:
                d = dp4a(lo, tl.broadcast_to(xe[None, :], (BLOCK_N, GROUPS * WPG)), 0, False, USE_ASM)
                d = dp4a(hi, tl.broadcast_to(xo[None, :], (BLOCK_N, GROUPS * WPG)), d, False, USE_ASM)
            gsum = tl.sum(tl.reshape(d, (BLOCK_N, GROUPS, WPG)), 2)
            if FMT != 8:
                gsum -= (8 if FMT == 4 else 16) * tl.load(xsum_ptr + m * groups + gi)[None, :]
            xs = tl.load(xs_ptr + m * groups + gi)
            part = tl.sum(gsum.to(tl.float32) * xs[None, :] * s, 1)
            acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
        words, hb, s = words1, hb1, s1
    out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


@triton.jit
def mma_tile(M, N, K, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tensor-core kernels' program: its BLOCK_N output features, x's rows padded to the dot's 16,
    their masks, the groups of 64 along K and how many of them its K-slice holds."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    groups = K // 64
    return rn, rm, rn < N, rm < M, groups, groups // SPLIT


@triton.jit
def int8_mma_kernel(xq_ptr, xs_ptr, xsum_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K,
                    code_stride, high_stride, scale_stride,
                    FMT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """The int8 rows times the weight codes on int8 tensor cores (mma s8, int32 accumulators), one group of
    64 per iteration: codes are loaded as the dot's [K, N] operand, q4/q5 bytes split into their even-k (low)
    and odd-k (high) planes, which meet x's even and odd planes; the group scales multiply the exact integer
    partial. Rows are padded to 16 for the dot: where several rows share a call this keeps their cost near
    one row's, which the dp4a kernel (work per row) cannot."""
    enter(PDL)
    rn, rm, n_ok, m_ok, groups, per = mma_tile(M, N, K, SPLIT, BLOCK_N)
    pid_k = tl.program_id(1)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for gi in range(pid_k * per, (pid_k + 1) * per):
        if FMT == 8:
            rk = tl.arange(0, 64)
            c = tl.load(codes_ptr + rn[None, :] * code_stride + (gi * 64 + rk)[:, None], mask=n_ok[None, :],
                        other=0)
            xq = tl.load(xq_ptr + rm[:, None] * K + (gi * 64 + rk)[None, :], mask=m_ok[:, None], other=0)
            part = tl.dot(xq, c, out_dtype=tl.int32)
        else:
            ri = tl.arange(0, 32)
            byte = tl.load(codes_ptr + rn[None, :] * code_stride + (gi * 32 + ri)[:, None], mask=n_ok[None, :],
                           other=0).to(tl.int32)
            lo, hi = byte & 0xF, byte >> 4
            if FMT == 5:
                hb = tl.load(high_ptr + rn[None, :] * high_stride + (gi * 8 + ri // 4)[:, None],
                             mask=n_ok[None, :], other=0).to(tl.int32)
                shift = (2 * (ri % 4))[:, None]
                lo = lo | (((hb >> shift) & 1) << 4)
                hi = hi | (((hb >> (shift + 1)) & 1) << 4)
            xe = tl.load(xq_ptr + rm[:, None] * K + (gi * 32 + ri)[None, :], mask=m_ok[:, None], other=0)
            xo = tl.load(xq_ptr + rm[:, None] * K + K // 2 + (gi * 32 + ri)[None, :], mask=m_ok[:, None],
                         other=0)
            part = tl.dot(xe, lo.to(tl.int8), out_dtype=tl.int32) + tl.dot(xo, hi.to(tl.int8), out_dtype=tl.int32)
            xsum = tl.load(xsum_ptr + rm * groups + gi, mask=m_ok, other=0)
            part -= (8 if FMT == 4 else 16) * xsum[:, None]
        xs = tl.load(xs_ptr + rm * groups + gi, mask=m_ok, other=0.0)
        s = tl.load(scales_ptr + rn * scale_stride + gi, mask=n_ok, other=0.0).to(tl.float32)
        acc += part.to(tl.float32) * xs[:, None] * s[None, :]
    out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def planes(b, h, lane, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """(even-k, odd-k) int8 codes of q4/q5 bytes `b` [..., 4] (the last dim a 32-bit word's bytes); q5's `h` is
    each word's bit-plane byte (bits 2j, 2j + 1: the 5th bits of byte j's codes) broadcast over its bytes, `lane`
    the byte's j. With USE_ASM a word's four bytes share a 32-bit register (pack=4): one instruction per word
    where per-byte ops take one per byte."""
    if USE_ASM:
        if FMT == 4:
            lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [b], dtype=tl.int8,
                                           is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                           "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        else:  # h: four copies of one byte; its bits 0, 2, 4, 6 spread to bit 4 of byte lanes 0..3 (as `spread`)
            lo = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $2, 0x55; mul.lo.u32 t, t, 0x410410; and.b32 t, t, 0x10101010;"
                " and.b32 $0, $1, 0x0F0F0F0F; or.b32 $0, $0, t; }", "=r,r,r", [b, h], dtype=tl.int8,
                is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; .reg .b32 u; shr.b32 t, $2, 1; and.b32 t, t, 0x55; mul.lo.u32 t, t, 0x410410;"
                " and.b32 t, t, 0x10101010; shr.b32 u, $1, 4; and.b32 u, u, 0x0F0F0F0F; or.b32 $0, u, t; }",
                "=r,r,r", [b, h], dtype=tl.int8, is_pure=True, pack=4)
    else:
        u = b.to(tl.int32)
        lo, hi = u & 0xF, u >> 4
        if FMT == 5:
            hb = h.to(tl.int32)
            lo = lo | (((hb >> (2 * lane)) & 1) << 4)
            hi = hi | (((hb >> (2 * lane + 1)) & 1) << 4)
        lo, hi = lo.to(tl.int8), hi.to(tl.int8)
    return lo, hi


@triton.jit
def int8_mma_groups_kernel(xq_ptr, xs_ptr, xsum_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, M, N, K,
                           code_stride, high_stride, scale_stride,
                           FMT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                           USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    """`int8_mma_kernel`'s int8 tensor-core dot with GROUPS groups of 64 per iteration (more bytes in flight per
    program: one 2 KB group at a time left the loop waiting on each load), the codes read in their stored order as
    the dot's A operand ([N, K]; x's rows are B, so 16 padded rows cost an n16 tile), q4/q5 nibbles split
    word-wise (`planes`), one batched dot over the groups, and a per-group accumulator summed once at the end
    (the groups sit in different warps)."""
    rn, rm, n_ok, m_ok, groups, per = mma_tile(M, N, K, SPLIT, BLOCK_N)
    pid_k = tl.program_id(1)
    BYTES: tl.constexpr = 64 if FMT == 8 else 32  # per row and group (q4/q5: one plane's codes)
    # the slice's first PREFETCH_LINES 128-byte lines of codes per row asked of L2 before the wait: the loop's
    # pipeline issues its first loads only after it, so without this nothing of the weights is on its way while
    # the kernel before drains
    if PDL and PREFETCH_LINES > 0:
        prefetch_rows(codes_ptr, tl.minimum(rn, N - 1), code_stride, pid_k * per * BYTES,
                      (pid_k + 1) * per * BYTES - 1, 128, PREFETCH_LINES)
    enter(PDL)
    rb = tl.arange(0, GROUPS * BYTES)
    rg = tl.arange(0, GROUPS)
    ri = tl.arange(0, BYTES)
    rw = tl.arange(0, GROUPS * 8)  # q5: bit-plane bytes, one per 4-byte word of codes
    lane = tl.arange(0, 4)[None, None, :]
    xmask = m_ok[None, None, :]
    acc = tl.zeros((GROUPS, BLOCK_N, 16), dtype=tl.float32)
    # The dot accumulates onto 1.5 * 2**23's bits, so its int32 result read as a float is that number plus the
    # exact sum (|sum| < 2**22 for 64 int8 x 8-bit products); one float subtraction then gives the sum and takes
    # the q4/q5 zero-point correction with it, where an int32 -> float conversion (a quarter of the FMA rate) and
    # an integer correction would take two.
    magic = tl.full((GROUPS, BLOCK_N, 16), 0x4B400000, tl.int32)
    for g0 in range(pid_k * per, (pid_k + 1) * per, GROUPS):
        b = tl.load(codes_ptr + rn[:, None] * code_stride + (g0 * BYTES + rb)[None, :], mask=n_ok[:, None], other=0)
        # x's rows as B [groups, bytes, rows]: q4/q5 rows are [even plane K/2 | odd plane K/2]
        xoff = rm[None, None, :] * K + (g0 + rg)[:, None, None] * BYTES + ri[None, :, None]
        zero = tl.zeros((GROUPS, 1, 16), tl.int32)  # the zero point's share: codes are stored offset by 8 or 16
        xe = tl.load(xq_ptr + xoff, mask=xmask, other=0)
        xo = xe if FMT == 8 else tl.load(xq_ptr + K // 2 + xoff, mask=xmask, other=0)
        if FMT == 8:
            a = tl.permute(tl.reshape(b, (BLOCK_N, GROUPS, BYTES)), (1, 0, 2))
            part = tl.dot(a, xe, magic, out_dtype=tl.int32)
        else:
            b = tl.reshape(b, (BLOCK_N, GROUPS * 8, 4))
            h = b
            if FMT == 5:
                h = tl.load(high_ptr + rn[:, None] * high_stride + (g0 * 8 + rw)[None, :], mask=n_ok[:, None],
                            other=0)
                h = tl.broadcast_to(h[:, :, None], (BLOCK_N, GROUPS * 8, 4))
            lo, hi = planes(b, h, lane, FMT, USE_ASM)
            lo = tl.permute(tl.reshape(lo, (BLOCK_N, GROUPS, BYTES)), (1, 0, 2))
            hi = tl.permute(tl.reshape(hi, (BLOCK_N, GROUPS, BYTES)), (1, 0, 2))
            part = tl.dot(lo, xe, magic, out_dtype=tl.int32)
            part = tl.dot(hi, xo, part, out_dtype=tl.int32)
            xsum = tl.load(xsum_ptr + rm[None, None, :] * groups + (g0 + rg)[:, None, None], mask=xmask, other=0)
            zero = (8 if FMT == 4 else 16) * xsum
        exact = part.to(tl.float32, bitcast=True) - (zero.to(tl.float32) + 12582912.0)
        xs = tl.load(xs_ptr + rm[None, None, :] * groups + (g0 + rg)[:, None, None], mask=xmask, other=0.0)
        s = tl.load(scales_ptr + rn[None, :, None] * scale_stride + (g0 + rg)[:, None, None],
                    mask=n_ok[None, :, None], other=0.0).to(tl.float32)
        acc += exact * (xs * s)
    out = out_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
    tl.store(out, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
