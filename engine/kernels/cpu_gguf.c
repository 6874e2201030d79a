/* GGUF block-quantized weights on the CPU, read as the file stores them (ggml's block layouts):
 * y[i, j] = x[i, :] . dequantize(W[j, :]) for a few rows of x (decode, verify), and dequantization of rows (the
 * embedding lookup, prefill-sized matmuls). x and y are fp32; the legacy types (Q4_0, Q4_1, Q8_0) multiply x as
 * two int16 planes per block of 32 (`planes_dot`), the K-quants dequantize each block and multiply in fp32.
 *
 * Built at first use by `cpu_build.py` with the machine's C compiler (-O3 -march=native -fopenmp); under torch the
 * OpenMP runtime is torch's own libgomp (same soname), so these loops and torch's share one thread pool.
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
/* Below this many weights a matmul runs on the calling thread: in a whole decode step the fork, the join and the
 * worker spinning between a small model's projections cost more than splitting them saves (NOTES.md, CPU). */
#define PARALLEL_MIN_VALUES (1 << 22)
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

int64_t ninfer_gguf_row_bytes(int t, int64_t k) {
    const int64_t bv = block_values(t);
    return bv && k % bv == 0 ? k / bv * block_bytes(t) : 0;
}

/* y[i * ldy + j] = x[i, :] . W[j, :] for i < m, j < n; W is n rows of k values of type t. The rows of W are shared
 * among the threads; each thread runs all m rows of x over its rows, which stay in its cache meanwhile. Guided
 * scheduling: the cores may be shared with other processes, and a thread the OS holds back then takes fewer rows
 * instead of holding up the others at the end. Returns 0, or -1 for more than MAX_X_ROWS rows or no memory. */
int ninfer_gguf_linear(int t, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                       int64_t ldy, int threads) {
    const int64_t rb = ninfer_gguf_row_bytes(t, k), nb = k / 32;
    const int64_t row_mem = 2 * k * sizeof(int16_t) + 2 * nb * sizeof(float);
    BlockedX bx[MAX_X_ROWS];
    char stack[32768];  /* a decode step's x fits: no allocation per call */
    char *mem = NULL;
    if (m > MAX_X_ROWS) return -1;
    if (int16_rows(t)) {
        mem = m * row_mem <= (int64_t)sizeof(stack) ? stack : malloc(m * row_mem);
        if (mem == NULL) return -1;
        for (int64_t i = 0; i < m; i++) {
            bx[i].scale = (float *)(mem + i * row_mem);
            bx[i].sum = bx[i].scale + nb;
            bx[i].q = (int16_t *)(bx[i].sum + nb);
            bx[i].lo = bx[i].q + k;
            block_x(x + i * k, k, &bx[i]);
        }
    }
    if (threads > 1 && n * k >= PARALLEL_MIN_VALUES) {
#pragma omp parallel for schedule(guided) num_threads(threads)
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) y[i * ldy + j] = dot_row(t, w + j * rb, x + i * k, &bx[i], k);
    } else {
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) y[i * ldy + j] = dot_row(t, w + j * rb, x + i * k, &bx[i], k);
    }
    if (mem != stack) free(mem);
    return 0;
}

/* out[r, :] = dequantize(W[rows[r], :]) (rows NULL: the first n rows in order). */
void ninfer_gguf_dequantize(int t, const uint8_t *w, int64_t k, const int64_t *rows, int64_t n, float *out,
                            int threads) {
    const int64_t rb = ninfer_gguf_row_bytes(t, k), bv = block_values(t), bb = block_bytes(t);
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1 && n * k >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + (rows ? rows[r] : r) * rb;
        for (int64_t b = 0; b < k / bv; b++) dequantize_block(t, row + b * bb, out + r * k + b * bv);
    }
}
