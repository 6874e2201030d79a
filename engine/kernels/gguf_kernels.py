"""Triton kernels over GGUF blocks as the file stores them (Q8_0, Q4_K, Q5_K, Q6_K; `gguf_matmul.py` launches
them): `gguf_matmul_kernel` multiplies a few rows of x by the weight, `gguf_dequant_kernel` writes weight rows
out as values (a prefill's scratch for cuBLAS, an embedding lookup).

The layouts, per row of the weight (blocks along K; ggml's `block_q*` structs, which `gguf.quants` decodes):
- Q8_0, 34 bytes per 32 weights: fp16 d, 32 int8 codes; w = d * q.
- Q4_K, 144 bytes per 256: fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes
  of nibbles (byte 32p + l: low nibble = weight l of sub-block 2p, high nibble = of 2p + 1);
  w = (d * sc) * q - dmin * m.
- Q5_K, 176 bytes per 256: Q4_K's header, 32 bytes whose bit j of byte l is the 5th bit of weight l of sub-block
  j, then Q4_K's nibbles.
- Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of 2-bit pairs, 16 int8 scales (one per sub-block of 16),
  fp16 d; weight e = 128h + r takes nibble r // 64 of byte 64h + r % 64 and pair r // 32 of byte 128 + 32h + r % 32;
  w = (d * sc) * (q - 32).
Every product of a scale and a code is exact in fp32 (at most 23 significant bits), so a value computed here, d*sc
first, then times the code, then less dmin*m, rounds exactly where gguf.quants' numpy does: the values are equal
to the bit, FMA contraction or not.

The matmul never forms the values: per sub-block it multiplies x (in its own dtype) by the integer codes, which
every float type holds exactly, then applies the sub-block's scale and subtracts its min times the sum of x over
the sub-block, all in fp32: the result is x @ W.T within fp32 rounding, only the order of the sums differs.
`MMA` does each sub-block's product on tensor cores (x rows padded to 16; fp32 x as IEEE fp32, never TF32), else
one row of x multiplies on CUDA cores, each thread its codes (made floats by `exact_float`) by their k's x.

Only 2-byte alignment holds within Q6_K and Q8_0 rows (210- and 34-byte blocks), so their fields are read as
bytes and 16-bit words; Q4_K and Q5_K blocks are 16-byte aligned and their fields read as 32-bit words. Rows past
N read row 0 (never stored) so that the weight loads need no mask. QTYPE is the GGMLQuantizationType value: 8
(Q8_0), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K).
"""
import triton
import triton.language as tl

from .pdl import enter
from .slices import summed_slices


@triton.jit
def half(bits):
    """The fp16 in the low 16 bits of int32 `bits`, as fp32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def k_header(words_ptr, blk):
    """A Q4_K/Q5_K block's d and dmin (fp32) and its three words of packed scales and mins."""
    w = blk // 4
    w0 = tl.load(words_ptr + w)
    return half(w0), half(w0 >> 16), tl.load(words_ptr + w + 1), tl.load(words_ptr + w + 2), \
        tl.load(words_ptr + w + 3)


@triton.jit
def k_scale_min(w1, w2, w3, J: tl.constexpr):
    """Sub-block J's 6-bit scale and min (fp32): bytes 0-3 hold the scales of 0-3 and the top bits of those of
    4-7, bytes 4-7 the mins likewise, bytes 8-11 the low nibbles of the scales (and high ones of the mins) of 4-7."""
    if J < 4:
        sc = (w1 >> (8 * J)) & 63
        m = (w2 >> (8 * J)) & 63
    else:
        sc = ((w3 >> (8 * (J - 4))) & 0xF) | (((w1 >> (8 * (J - 4) + 6)) & 3) << 4)
        m = ((w3 >> (8 * (J - 4) + 4)) & 0xF) | (((w2 >> (8 * (J - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def k_codes(data_ptr, blk, ri, P: tl.constexpr, FIVE: tl.constexpr, qh):
    """Codes [32, R] of sub-blocks 2P and 2P + 1 of Q4_K (FIVE false) or Q5_K blocks at byte offsets `blk` [R]."""
    q = tl.load(data_ptr + blk[None, :] + (48 if FIVE else 16) + 32 * P + ri[:, None]).to(tl.int32)
    lo, hi = q & 0xF, q >> 4
    if FIVE:
        lo = lo | (((qh >> (2 * P)) & 1) << 4)
        hi = hi | (((qh >> (2 * P + 1)) & 1) << 4)
    return lo, hi


@triton.jit
def q6_codes(data_ptr, blk, ri, H: tl.constexpr, T: tl.constexpr, qh):
    """Codes - 32 [16, R] of Q6_K sub-blocks 8H + T and 8H + T + 4 (T < 4): the low and high nibbles of bytes
    64H + 16T.. of the block, with 2-bit pairs T // 2 and T // 2 + 2 of `qh` (`q6_pairs` H, T % 2)."""
    q = tl.load(data_ptr + blk[None, :] + 64 * H + 16 * T + ri[:, None]).to(tl.int32)
    lo = ((q & 0xF) | (((qh >> (2 * (T // 2))) & 3) << 4)) - 32
    hi = ((q >> 4) | (((qh >> (2 * (T // 2) + 4)) & 3) << 4)) - 32
    return lo, hi


@triton.jit
def q6_pairs(data_ptr, blk, ri, H: tl.constexpr, A: tl.constexpr):
    """Bytes [16, R] 128 + 32H + 16A.. of Q6_K blocks: four 2-bit pairs each, the high bits of four sub-blocks."""
    return tl.load(data_ptr + blk[None, :] + 128 + 32 * H + 16 * A + ri[:, None]).to(tl.int32)


@triton.jit
def q6_scale(data_ptr, blk, d, S: tl.constexpr):
    """d times sub-block S's int8 scale (fp32, exact)."""
    return d * tl.load(data_ptr + blk + 192 + S).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def q8_codes(data_ptr, blk, ri):
    """The int8 codes [32, R] of Q8_0 blocks."""
    return tl.load(data_ptr + blk[None, :] + 2 + ri[:, None]).to(tl.int8, bitcast=True).to(tl.int32)


# ---- the matmul ----------------------------------------------------------------------------------------------


@triton.jit
def exact_float(codes, LOW: tl.constexpr):
    """Integer codes in [LOW, LOW + 2^23) as fp32, exactly: the code - LOW ORed into the mantissa of 2^23, less
    2^23 - LOW (two full-rate ops where an int-to-float conversion runs at a quarter of the rate)."""
    return ((codes - LOW) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 - LOW)


@triton.jit
def sub_product(acc, x_ptr, x_rows, m_ok, k, codes, scale, minus, LOW: tl.constexpr, MMA: tl.constexpr,
                MIN: tl.constexpr):
    """acc + x[:, k:k+S] @ (scale * codes - minus).T for one sub-block of S weights (codes [S, N], integers from
    LOW). Without MMA, x is one row: each thread multiplies its codes by the x values of their k on CUDA cores."""
    S: tl.constexpr = codes.shape[0]
    if MMA:
        xt = tl.load(x_ptr + x_rows[:, None] + (k + tl.arange(0, S))[None, :], mask=m_ok[:, None], other=0.0)
        if xt.dtype == tl.float32:
            part = tl.dot(xt, codes.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(xt, codes.to(xt.dtype))
        acc += part * scale[None, :]
        if MIN:  # the sums of x by a dot with ones: in the accumulator's layout, no reduction across lanes
            ones = tl.full(codes.shape, 1.0, xt.dtype)
            if xt.dtype == tl.float32:
                total = tl.dot(xt, ones, input_precision="ieee")
            else:
                total = tl.dot(xt, ones)
            acc -= total * minus[None, :]
    else:
        xv = tl.load(x_ptr + k + tl.arange(0, S)).to(tl.float32)
        part = tl.sum(exact_float(codes, LOW) * xv[:, None], axis=0) * scale
        if MIN:
            part -= tl.sum(xv) * minus
        acc += part[None, :]
    return acc


@triton.jit
def k_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, words_ptr, blk, MMA: tl.constexpr, FIVE: tl.constexpr):
    """One Q4_K/Q5_K block (256 weights of each row) into acc."""
    ri = tl.arange(0, 32)
    d, dmin, w1, w2, w3 = k_header(words_ptr, blk)
    qh = 0  # Q4_K has no 5th bits
    if FIVE:
        qh = tl.load(data_ptr + blk[None, :] + 16 + ri[:, None]).to(tl.int32)
    for p in tl.static_range(4):
        lo, hi = k_codes(data_ptr, blk, ri, p, FIVE, qh)
        sc, m = k_scale_min(w1, w2, w3, 2 * p)
        acc = sub_product(acc, x_ptr, x_rows, m_ok, k0 + 64 * p, lo, d * sc, dmin * m, 0, MMA, True)
        sc, m = k_scale_min(w1, w2, w3, 2 * p + 1)
        acc = sub_product(acc, x_ptr, x_rows, m_ok, k0 + 64 * p + 32, hi, d * sc, dmin * m, 0, MMA, True)
    return acc


@triton.jit
def q6_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, halves_ptr, blk, MMA: tl.constexpr):
    """One Q6_K block (256 weights of each row, 16 sub-blocks of 16) into acc."""
    ri = tl.arange(0, 16)
    d = tl.load(halves_ptr + blk // 2 + 104).to(tl.float16, bitcast=True).to(tl.float32)
    for h in tl.static_range(2):
        for a in tl.static_range(2):
            qh = q6_pairs(data_ptr, blk, ri, h, a)
            for b in tl.static_range(2):
                t = a + 2 * b
                lo, hi = q6_codes(data_ptr, blk, ri, h, t, qh)
                s = 8 * h + t
                acc = sub_product(acc, x_ptr, x_rows, m_ok, k0 + 16 * s, lo, q6_scale(data_ptr, blk, d, s), d,
                                  -32, MMA, False)
                acc = sub_product(acc, x_ptr, x_rows, m_ok, k0 + 16 * s + 64, hi,
                                  q6_scale(data_ptr, blk, d, s + 4), d, -32, MMA, False)
    return acc


@triton.jit
def q8_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, halves_ptr, blk, BLOCKS: tl.constexpr, MMA: tl.constexpr):
    """BLOCKS Q8_0 blocks (32 weights of each row each) into acc."""
    ri = tl.arange(0, 32)
    for b in tl.static_range(BLOCKS):
        at = blk + 34 * b
        d = tl.load(halves_ptr + at // 2).to(tl.float16, bitcast=True).to(tl.float32)
        acc = sub_product(acc, x_ptr, x_rows, m_ok, k0 + 32 * b, q8_codes(data_ptr, at, ri), d, d, -128, MMA,
                          False)
    return acc


@triton.jit
def gguf_matmul_kernel(x_ptr, data_ptr, wide_ptr, out_ptr, M, N, K, row_stride, per_split, split_stride,
                       out_stride, QTYPE: tl.constexpr, Q8_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, MMA: tl.constexpr, PDL: tl.constexpr):
    """out[pid_k] (rows x N, row stride out_stride; slices split_stride apart) = x [M, K] @ W.T over K-slice pid_k
    of `per_split` units (a Q4_K/Q5_K/Q6_K block, or Q8_BLOCKS Q8_0 blocks). `wide_ptr`: the weight's bytes as
    int32 words (Q4_K, Q5_K) or int16 (Q6_K, Q8_0)."""
    enter(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    row = tl.where(n_ok, rn, 0).to(tl.int64) * row_stride
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    x_rows = rm * K
    WEIGHTS: tl.constexpr = 32 * Q8_BLOCKS if QTYPE == 8 else 256
    UNIT_BYTES: tl.constexpr = 34 * Q8_BLOCKS if QTYPE == 8 else (144 if QTYPE == 12 else (176 if QTYPE == 13 else 210))
    units = K // WEIGHTS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for u in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, units)):
        blk = row + u * UNIT_BYTES
        k0 = u * WEIGHTS
        if QTYPE == 12 or QTYPE == 13:
            acc = k_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, wide_ptr, tl.multiple_of(blk, 16), MMA, QTYPE == 13)
        elif QTYPE == 14:
            acc = q6_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, wide_ptr, tl.multiple_of(blk, 2), MMA)
        else:
            acc = q8_unit(acc, x_ptr, x_rows, m_ok, k0, data_ptr, wide_ptr, tl.multiple_of(blk, 2), Q8_BLOCKS, MMA)
    out = out_ptr + pid_k * split_stride + rm[:, None] * out_stride + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- weight rows as values -----------------------------------------------------------------------------------


@triton.jit
def store_values(out_ptr, out_rows, r_ok, k, codes, scale, minus, MIN: tl.constexpr):
    """Values (scale * codes - minus, fp32, then the output's dtype) of one sub-block [S, R] into columns k.. of
    the output rows `out_rows` (element offsets of each row's start)."""
    S: tl.constexpr = codes.shape[0]
    value = codes.to(tl.float32) * scale[None, :]
    if MIN:
        value = value - minus[None, :]
    tl.store(out_ptr + out_rows[None, :] + (k + tl.arange(0, S))[:, None], value.to(out_ptr.dtype.element_ty),
             mask=r_ok[None, :])


@triton.jit
def gguf_dequant_kernel(data_ptr, wide_ptr, ids_ptr, out_ptr, R, K, row_stride, row0, QTYPE: tl.constexpr,
                        Q8_BLOCKS: tl.constexpr, GATHER: tl.constexpr, BLOCK_R: tl.constexpr):
    """Output rows i (of R, K values each, contiguous) = weight row ids[i] (GATHER) or row0 + i, dequantized; a
    program takes BLOCK_R rows and one unit (a K-quant block, or Q8_BLOCKS Q8_0 blocks) of each."""
    pid_r, u = tl.program_id(0), tl.program_id(1)
    i = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = i < R
    if GATHER:
        r = tl.load(ids_ptr + i, mask=r_ok, other=0).to(tl.int64)
    else:
        r = (row0 + tl.where(r_ok, i, 0)).to(tl.int64)
    out_rows = i.to(tl.int64) * K
    WEIGHTS: tl.constexpr = 32 * Q8_BLOCKS if QTYPE == 8 else 256
    UNIT_BYTES: tl.constexpr = 34 * Q8_BLOCKS if QTYPE == 8 else (144 if QTYPE == 12 else (176 if QTYPE == 13 else 210))
    blk = r * row_stride + u * UNIT_BYTES
    k0 = u * WEIGHTS
    if QTYPE == 12 or QTYPE == 13:
        FIVE: tl.constexpr = QTYPE == 13
        blk = tl.multiple_of(blk, 16)
        ri = tl.arange(0, 32)
        d, dmin, w1, w2, w3 = k_header(wide_ptr, blk)
        qh = 0  # Q4_K has no 5th bits
        if FIVE:
            qh = tl.load(data_ptr + blk[None, :] + 16 + ri[:, None]).to(tl.int32)
        for p in tl.static_range(4):
            lo, hi = k_codes(data_ptr, blk, ri, p, FIVE, qh)
            sc, m = k_scale_min(w1, w2, w3, 2 * p)
            store_values(out_ptr, out_rows, r_ok, k0 + 64 * p, lo, d * sc, dmin * m, True)
            sc, m = k_scale_min(w1, w2, w3, 2 * p + 1)
            store_values(out_ptr, out_rows, r_ok, k0 + 64 * p + 32, hi, d * sc, dmin * m, True)
    elif QTYPE == 14:
        blk = tl.multiple_of(blk, 2)
        ri = tl.arange(0, 16)
        d = tl.load(wide_ptr + blk // 2 + 104).to(tl.float16, bitcast=True).to(tl.float32)
        for h in tl.static_range(2):
            for a in tl.static_range(2):
                qh = q6_pairs(data_ptr, blk, ri, h, a)
                for b in tl.static_range(2):
                    t = a + 2 * b
                    lo, hi = q6_codes(data_ptr, blk, ri, h, t, qh)
                    s = 8 * h + t
                    store_values(out_ptr, out_rows, r_ok, k0 + 16 * s, lo, q6_scale(data_ptr, blk, d, s), d, False)
                    store_values(out_ptr, out_rows, r_ok, k0 + 16 * s + 64, hi, q6_scale(data_ptr, blk, d, s + 4),
                                 d, False)
    else:
        blk = tl.multiple_of(blk, 2)
        ri = tl.arange(0, 32)
        for b in tl.static_range(Q8_BLOCKS):
            at = blk + 34 * b
            d = tl.load(wide_ptr + at // 2).to(tl.float16, bitcast=True).to(tl.float32)
            store_values(out_ptr, out_rows, r_ok, k0 + 32 * b, q8_codes(data_ptr, at, ri), d, d, False)


@triton.jit
def sum_into_kernel(part_ptr, out_ptr, M, N, out_stride, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """out[m, :N] (rows out_stride apart) = the sum of the SPLIT fp32 slices [M, N] at part_ptr: one part's columns
    of a weight stacked from several (`GGUFWeight.parts`)."""
    enter(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < M * N
    total = summed_slices(part_ptr, r, ok, M * N, SPLIT)
    tl.store(out_ptr + (r // N) * out_stride + r % N, total.to(out_ptr.dtype.element_ty), mask=ok)
