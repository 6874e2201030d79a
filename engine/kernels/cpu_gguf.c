/* GGUF block-quantized weights on the CPU, read as the file stores them (ggml's block layouts):
 * y[i, j] = x[i, :] . dequantize(W[j, :]) for a few rows of x (decode, verify), and dequantization of rows (the
 * embedding lookup, prefill-sized matmuls). x and y are fp32; the legacy types (Q4_0, Q4_1, Q8_0) multiply x as
 * two int16 planes per block of 32 (`planes_dot`), the K-quants dequantize each block and multiply in fp32.
 *
 * Part of cpu_kernels.c (built at first use by `cpu_build.py` with the machine's C compiler, -O3 -march=native);
 * the work is shared by the team of cpu_pool.c.
 * -ffp-contract=off: the dequantized values are the gguf package's bit for bit (its numpy rounds each product).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define MAX_X_ROWS 16 /* rows of x per linear call: a verify step's (cpu_gguf.py MAX_ROWS) */
/* Below this many products a matmul or a dequantization runs on the calling thread: waking the team and waiting
 * for it costs a few microseconds. */
#define PARALLEL_MIN_VALUES (1 << 16)
enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define QK_K 256

static float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef HAVE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Bytes of one block and values in it, per type. */
static int64_t block_bytes(int t) {
    switch (t) {
    case F32: return 4;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int64_t block_values(int t) {
    switch (t) {
    case F32: return 1;
    case Q4_0: case Q4_1: case Q8_0: return 32;
    default: return QK_K;
    }
}

static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block's values (block_values(t) floats), rounded as the gguf package rounds them. */
static void dequantize_block(int t, const uint8_t *b, float *y) {
    switch (t) {
    case F32:
        memcpy(y, b, 4);
        return;
    case Q4_0: {
        const float d = half_to_float(b);
        for (int l = 0; l < 16; l++) {
            y[l] = (float)((b[2 + l] & 0xF) - 8) * d;
            y[l + 16] = (float)((b[2 + l] >> 4) - 8) * d;
        }
        return;
    }
    case Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int l = 0; l < 16; l++) {
            y[l] = (float)(b[4 + l] & 0xF) * d + m;
            y[l + 16] = (float)(b[4 + l] >> 4) * d + m;
        }
        return;
    }
    case Q8_0: {
        const float d = half_to_float(b);
        for (int l = 0; l < 32; l++) y[l] = (float)(int8_t)b[2 + l] * d;
        return;
    }
    case Q4_K: case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (t == Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++) { /* 64 values: two sub-blocks of 32 share the bytes' low and high nibbles */
            uint8_t sc, m;
            scale_min_k4(2 * j, scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            scale_min_k4(2 * j + 1, scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int lo = ql[32 * j + l] & 0xF, hi = ql[32 * j + l] >> 4;
                if (t == Q5_K) {
                    lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                }
                y[64 * j + l] = d1 * (float)lo - m1;
                y[64 * j + 32 + l] = d2 * (float)hi - m2;
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int n = 0; n < 2; n++) { /* 128 values per half */
            for (int l = 0; l < 32; l++) {
                const int s = l / 16;
                const int q1 = (int8_t)((ql[64 * n + l] & 0xF) | (((qh[32 * n + l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int8_t)((ql[64 * n + l + 32] & 0xF) | (((qh[32 * n + l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int8_t)((ql[64 * n + l] >> 4) | (((qh[32 * n + l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int8_t)((ql[64 * n + l + 32] >> 4) | (((qh[32 * n + l] >> 6) & 3) << 4)) - 32;
                y[128 * n + l] = (d * (float)sc[8 * n + s]) * (float)q1;
                y[128 * n + l + 32] = (d * (float)sc[8 * n + s + 2]) * (float)q2;
                y[128 * n + l + 64] = (d * (float)sc[8 * n + s + 4]) * (float)q3;
                y[128 * n + l + 96] = (d * (float)sc[8 * n + s + 6]) * (float)q4;
            }
        }
        return;
    }
    }
}

/* Eight independent partial sums: the loop vectorizes without reassociating a single sum. */
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 8; l++) s += acc[l];
    return s;
}

#ifdef HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The legacy types' dot products take x per block of 32 as two int16 planes, x = scale * (hi + lo / 32768) with the
 * block's absmax / 32767 for scale: within 1/2^31 of the block's largest value (below fp32's own rounding), and 16
 * multiply-adds per madd instruction, exact in int32, where unpacking codes to floats costs more instructions than
 * the bytes take to arrive. One plane alone (1/65534) moved SmolLM2's decode logits by up to 5e-4, enough to flip
 * near-ties of the greedy pick. */
/* sum_l q_l x_l for one block with x as two int16 planes, x = scale * (hi + lo / 32768): each plane's products
 * summed exactly in int32, then hi + lo / 32768 in fp32. */
static inline __m256 planes_dot(__m256i q_lo16, __m256i q_hi16, const int16_t *hi, const int16_t *lo) {
    const __m256i ph = _mm256_add_epi32(_mm256_madd_epi16(q_lo16, _mm256_loadu_si256((const __m256i *)hi)),
                                        _mm256_madd_epi16(q_hi16, _mm256_loadu_si256((const __m256i *)(hi + 16))));
    const __m256i pl = _mm256_add_epi32(_mm256_madd_epi16(q_lo16, _mm256_loadu_si256((const __m256i *)lo)),
                                        _mm256_madd_epi16(q_hi16, _mm256_loadu_si256((const __m256i *)(lo + 16))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), _mm256_set1_ps(1.0f / 32768), _mm256_cvtepi32_ps(ph));
}

static inline __m256 q4_block(const uint8_t *qs, const int16_t *hi, const int16_t *lo, float scale, __m256 acc) {
    /* 16 bytes widened to 16-bit lanes: the low nibbles are values 0-15, the high ones 16-31 */
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256 s = planes_dot(_mm256_and_si256(v, _mm256_set1_epi16(0xF)), _mm256_srli_epi16(v, 4), hi, lo);
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), s, acc);
}

/* Two blocks per iteration into separate sums: each block's multiply-add would otherwise wait on the last's. */
static float dot_q4(int t, const uint8_t *w, const int16_t *x, const int16_t *lo, const float *xs, const float *xsum,
                    int64_t nb) {
    const int64_t bs = t == Q4_0 ? 18 : 20, off = t == Q4_0 ? 2 : 4;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float m0 = 0, m1 = 0;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = w + b * bs, *b1 = b0 + bs;
        const float d0 = half_to_float(b0), d1 = half_to_float(b1);
        acc0 = q4_block(b0 + off, x + 32 * b, lo + 32 * b, d0 * xs[b], acc0);
        acc1 = q4_block(b1 + off, x + 32 * b + 32, lo + 32 * b + 32, d1 * xs[b + 1], acc1);
        m0 += (t == Q4_0 ? -8.0f * d0 : half_to_float(b0 + 2)) * xsum[b];
        m1 += (t == Q4_0 ? -8.0f * d1 : half_to_float(b1 + 2)) * xsum[b + 1];
    }
    for (; b < nb; b++) {
        const uint8_t *b0 = w + b * bs;
        const float d0 = half_to_float(b0);
        acc0 = q4_block(b0 + off, x + 32 * b, lo + 32 * b, d0 * xs[b], acc0);
        m0 += (t == Q4_0 ? -8.0f * d0 : half_to_float(b0 + 2)) * xsum[b];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + (m0 + m1);
}

/* The weights AHEAD groups of four rows on (`group` bytes each) from `at`, this block iteration's share of them:
 * the rows of a group lie one after another, so the weights stream in order, but the cores' own prefetchers leave
 * a decode step's matmuls waiting on memory for a third of their time, and two threads streaming at once need the
 * lines asked for well ahead (NOTES.md, cpu_gguf.c). Two lines per iteration cover a group's bytes. */
#define AHEAD 16
static inline void prefetch_ahead(const uint8_t *at, int64_t group) {
    _mm_prefetch((const char *)(at + AHEAD * group), _MM_HINT_T0);
    _mm_prefetch((const char *)(at + AHEAD * group + 64), _MM_HINT_T0);
}

/* Four rows of W (rb bytes apart) against one x: each block of x is loaded once for the four, whose sums are
 * independent chains, and the four rows' block scales are converted and multiplied by x's in one vector. */
static void dot_q4_x4(int t, const uint8_t *w, int64_t rb, const int16_t *x, const int16_t *lo, const float *xs,
                      const float *xsum, int64_t nb, float *y) {
    const int64_t bs = t == Q4_0 ? 18 : 20, off = t == Q4_0 ? 2 : 4;
    const __m256i mask = _mm256_set1_epi16(0xF);
    const __m256 unit = _mm256_set1_ps(1.0f / 32768);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 mins = _mm256_setzero_ps(); /* odd lanes: each row's sum of block minimum times block sum of x */
    for (int64_t b = 0; b < nb; b++) {
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(x + 32 * b + 16));
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b + 16));
        prefetch_ahead(w + b * 4 * bs, 4 * rb);
        /* per row the scale d and the minimum m (Q4_0: m = -8 d, made as d times -8 sum) as fp16 pairs */
        uint32_t head[4];
        for (int r = 0; r < 4; r++) {
            memcpy(&head[r], w + r * rb + b * bs, 4);
            if (t == Q4_0) head[r] = (head[r] & 0xFFFF) * 0x10001u;
        }
        const __m256 dm = _mm256_cvtph_ps(_mm_set_epi32((int)head[3], (int)head[2], (int)head[1], (int)head[0]));
        const __m256 xv = _mm256_blend_ps(_mm256_set1_ps(xs[b]),
                                          _mm256_set1_ps(t == Q4_0 ? -8.0f * xsum[b] : xsum[b]), 0xAA);
        const __m256 scaled = _mm256_mul_ps(dm, xv); /* d_r xs, m_r xsum for each row r */
        mins = _mm256_add_ps(mins, scaled);
        for (int r = 0; r < 4; r++) {
            const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + r * rb + b * bs + off)));
            const __m256i qa = _mm256_and_si256(v, mask), qb = _mm256_srli_epi16(v, 4);
            const __m256i ph = _mm256_add_epi32(_mm256_madd_epi16(qa, h0), _mm256_madd_epi16(qb, h1));
            const __m256i pl = _mm256_add_epi32(_mm256_madd_epi16(qa, l0), _mm256_madd_epi16(qb, l1));
            const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), unit, _mm256_cvtepi32_ps(ph));
            acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(scaled, _mm256_set1_epi32(2 * r)), s, acc[r]);
        }
    }
    float m[8];
    _mm256_storeu_ps(m, mins);
    for (int r = 0; r < 4; r++) y[r] = hsum(acc[r]) + m[2 * r + 1];
}

/* Four rows of Q8_0 at once, as dot_q4_x4. */
static void dot_q8_0_x4(const uint8_t *w, int64_t rb, const int16_t *x, const int16_t *lo, const float *xs,
                        int64_t nb, float *y) {
    const __m256 unit = _mm256_set1_ps(1.0f / 32768);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(x + 32 * b));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(x + 32 * b + 16));
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(lo + 32 * b + 16));
        prefetch_ahead(w + b * 4 * 34, 4 * rb);
        uint16_t d[4];
        for (int r = 0; r < 4; r++) memcpy(&d[r], w + r * rb + b * 34, 2);
        const __m256 scaled = _mm256_castps128_ps256(_mm_mul_ps(
            _mm_cvtph_ps(_mm_setr_epi16((short)d[0], (short)d[1], (short)d[2], (short)d[3], 0, 0, 0, 0)),
            _mm_set1_ps(xs[b])));
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * rb + b * 34;
            const __m256i qa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
            const __m256i qb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
            const __m256i ph = _mm256_add_epi32(_mm256_madd_epi16(qa, h0), _mm256_madd_epi16(qb, h1));
            const __m256i pl = _mm256_add_epi32(_mm256_madd_epi16(qa, l0), _mm256_madd_epi16(qb, l1));
            const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), unit, _mm256_cvtepi32_ps(ph));
            acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(scaled, _mm256_set1_epi32(r)), s, acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) y[r] = hsum(acc[r]);
}

static inline __m256 q8_block(const uint8_t *qs, const int16_t *hi, const int16_t *lo, float scale, __m256 acc) {
    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)));
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), planes_dot(a, b, hi, lo), acc);
}

static float dot_q8_0(const uint8_t *w, const int16_t *x, const int16_t *lo, const float *xs, int64_t nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        acc0 = q8_block(w + b * 34 + 2, x + 32 * b, lo + 32 * b, half_to_float(w + b * 34) * xs[b], acc0);
        acc1 = q8_block(w + b * 34 + 36, x + 32 * b + 32, lo + 32 * b + 32, half_to_float(w + b * 34 + 34) * xs[b + 1],
                        acc1);
    }
    for (; b < nb; b++) acc0 = q8_block(w + b * 34 + 2, x + 32 * b, lo + 32 * b, half_to_float(w + b * 34) * xs[b], acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}
#endif

/* x rows made once per call for the dot products: per block of 32, the int16 values and their scale, and the
 * exact float sum (Q4_1's minimum and Q4_0's offset multiply it). */
typedef struct {
    int16_t *q, *lo;
    float *scale, *sum;
} BlockedX;

static int int16_rows(int t) {
#ifdef HAVE_AVX2
    return t == Q4_0 || t == Q4_1 || t == Q8_0;
#else
    (void)t;
    return 0;
#endif
}

/* A row's BlockedX in `mem` (blocked_bytes(k) of it). */
static BlockedX blocked_at(char *mem, int64_t k) {
    BlockedX b;
    b.scale = (float *)mem;
    b.sum = b.scale + k / 32;
    b.q = (int16_t *)(b.sum + k / 32);
    b.lo = b.q + k;
    return b;
}

static int64_t blocked_bytes(int64_t k) {
    return 2 * k * (int64_t)sizeof(int16_t) + 2 * (k / 32) * (int64_t)sizeof(float);
}

static void block_x(const float *x, int64_t n, BlockedX *out) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0, s = 0;
        for (int l = 0; l < 32; l++) {
            const float a = v[l] < 0 ? -v[l] : v[l];
            amax = a > amax ? a : amax;
            s += v[l];
        }
        const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        for (int l = 0; l < 32; l++) {
            const float scaled = v[l] * inv, hi = rintf(scaled);
            out->q[32 * b + l] = (int16_t)hi;
            out->lo[32 * b + l] = (int16_t)rintf((scaled - hi) * 32768.0f);
        }
        out->scale[b] = amax / 32767.0f;
        out->sum[b] = s;
    }
}

/* One weight row (k values) . x, any type: the fast paths above, or each block dequantized then dotted. */
static float dot_row(int t, const uint8_t *w, const float *x, const BlockedX *bx, int64_t k) {
    if (t == F32) return dot_f32((const float *)w, x, k);
#ifdef HAVE_AVX2
    if (t == Q4_0 || t == Q4_1) return dot_q4(t, w, bx->q, bx->lo, bx->scale, bx->sum, k / 32);
    if (t == Q8_0) return dot_q8_0(w, bx->q, bx->lo, bx->scale, k / 32);
#else
    (void)bx;
#endif
    const int64_t bv = block_values(t), bb = block_bytes(t);
    float buf[QK_K], s = 0;
    for (int64_t b = 0; b < k / bv; b++) {
        dequantize_block(t, w + b * bb, buf);
        s += dot_f32(buf, x + b * bv, bv);
    }
    return s;
}

/* y[r * ldy] = W[r] . x for the `rows` rows of W from w on (the callers take rows in groups of ROW_GROUP). */
#define ROW_GROUP 4
static void dot_rows(int t, const uint8_t *w, int64_t rb, int64_t rows, const float *x, const BlockedX *bx, int64_t k,
                     float *y, int64_t ldy) {
#ifdef HAVE_AVX2
    if (rows == 4 && ldy == 1 && (t == Q4_0 || t == Q4_1)) {
        dot_q4_x4(t, w, rb, bx->q, bx->lo, bx->scale, bx->sum, k / 32, y);
        return;
    }
    if (rows == 4 && ldy == 1 && t == Q8_0) {
        dot_q8_0_x4(w, rb, bx->q, bx->lo, bx->scale, k / 32, y);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) y[r * ldy] = dot_row(t, w + r * rb, x, bx, k);
}

int64_t ninfer_gguf_row_bytes(int t, int64_t k) {
    const int64_t bv = block_values(t);
    return bv && k % bv == 0 ? k / bv * block_bytes(t) : 0;
}

/* The rows of W (n rows of type t) that work items from `next` give this thread, each against the m rows of x:
 * y[i * ldy + j] = x[i, :] . W[j, :]. Items are a few microseconds of work, handed to whichever thread asks: the
 * cores may be shared with other processes, and a thread the OS holds back then takes fewer rows instead of
 * holding up the others at the end. Each item's rows stay in its thread's cache for all m rows of x. */
static void linear_share(int t, const uint8_t *w, int64_t n, int64_t k, const float *x, const BlockedX *bx, int64_t m,
                         float *y, int64_t ldy, atomic_llong *next) {
    enum { CHUNK = 8 }; /* row groups per item */
    const int64_t rb = ninfer_gguf_row_bytes(t, k), groups = (n + ROW_GROUP - 1) / ROW_GROUP;
    const int64_t items = (groups + CHUNK - 1) / CHUNK;
    for (int64_t item; (item = pool_next(next)) < items;)
        for (int64_t g = item * CHUNK; g < groups && g < (item + 1) * CHUNK; g++) {
            const int64_t j = g * ROW_GROUP, rows = n - j < ROW_GROUP ? n - j : ROW_GROUP;
            for (int64_t i = 0; i < m; i++) dot_rows(t, w + j * rb, rb, rows, x + i * k, &bx[i], k, y + i * ldy + j, 1);
        }
}

/* A job over the n rows of a weight W (type t, k values a row): a matmul's (x, its blocks, y) or a lookup's
 * (the rows, out in y). */
typedef struct {
    int t;
    const uint8_t *w;
    int64_t n, k, m, ldy;
    const float *x;
    const BlockedX *bx;
    const int64_t *rows;
    float *y;
    atomic_llong next;
} RowsJob;

static void linear_work(void *arg, int id, int team) {
    RowsJob *j = arg;
    (void)id, (void)team;
    linear_share(j->t, j->w, j->n, j->k, j->x, j->bx, j->m, j->y, j->ldy, &j->next);
}

/* y[i * ldy + j] = x[i, :] . W[j, :] for i < m, j < n; W is n rows of k values of type t, its rows shared among
 * the threads. Returns 0, or -1 for more than MAX_X_ROWS rows or no memory. */
int ninfer_gguf_linear(int t, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                       int64_t ldy, int threads) {
    const int64_t row_mem = blocked_bytes(k);
    RowsJob job = {.t = t, .w = w, .n = n, .k = k, .m = m, .ldy = ldy, .x = x, .y = y};
    BlockedX bx[MAX_X_ROWS];
    char stack[32768];  /* a decode step's x fits: no allocation per call */
    char *mem = NULL;
    if (m > MAX_X_ROWS) return -1;
    if (int16_rows(t)) {
        mem = m * row_mem <= (int64_t)sizeof(stack) ? stack : malloc(m * row_mem);
        if (mem == NULL) return -1;
        for (int64_t i = 0; i < m; i++) {
            bx[i] = blocked_at(mem + i * row_mem, k);
            block_x(x + i * k, k, &bx[i]);
        }
    }
    job.bx = bx;
    atomic_init(&job.next, 0);
    pool_run(linear_work, &job, n * k * m >= PARALLEL_MIN_VALUES ? threads : 1);
    if (mem != stack) free(mem);
    return 0;
}

static void dequantize_work(void *arg, int id, int team) {
    RowsJob *j = arg;
    (void)id, (void)team;
    enum { CHUNK = 16 }; /* rows per item */
    const int64_t rb = ninfer_gguf_row_bytes(j->t, j->k), bv = block_values(j->t), bb = block_bytes(j->t);
    for (int64_t item; (item = pool_next(&j->next)) * CHUNK < j->n;)
        for (int64_t r = item * CHUNK; r < j->n && r < (item + 1) * CHUNK; r++) {
            const uint8_t *row = j->w + (j->rows ? j->rows[r] : r) * rb;
            for (int64_t b = 0; b < j->k / bv; b++) dequantize_block(j->t, row + b * bb, j->y + r * j->k + b * bv);
        }
}

/* out[r, :] = dequantize(W[rows[r], :]) (rows NULL: the first n rows in order). */
void ninfer_gguf_dequantize(int t, const uint8_t *w, int64_t k, const int64_t *rows, int64_t n, float *out,
                            int threads) {
    RowsJob job = {.t = t, .w = w, .n = n, .k = k, .rows = rows, .y = out};
    atomic_init(&job.next, 0);
    pool_run(dequantize_work, &job, n * k >= PARALLEL_MIN_VALUES ? threads : 1);
}
