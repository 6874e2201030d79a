/* The small per-token ops of a CPU decode step, one call each instead of a handful of torch ops (a few microseconds
 * of dispatch apiece, which on a small model is most of the step): residual add + RMSNorm, rotate-half RoPE,
 * causal attention over a sequence's cached keys, and SiLU-and-multiply. fp32 throughout; part of cpu_kernels.c
 * (-ffp-contract=off: each product and sum rounds as torch's reference ops round them, `layers.py`).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

static float dot(const float *a, const float *b, int64_t n) {
#ifdef HAVE_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (int64_t i = 8; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
#endif
    float acc[8] = {0}, s = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 8; l++) s += acc[l];
    return s;
}

/* sum (x + r) into s (r may be NULL) and its RMSNorm into out: x / sqrt(mean(x^2) + eps) times w, or (1 + w) for
 * the zero-centred norms. */
void ninfer_add_rms_norm(const float *x, const float *r, const float *w, int64_t rows, int64_t d, float eps,
                         int zero_centred, float *s, float *out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * d;
        float *si = s + i * d;
        for (int64_t j = 0; j < d; j++) si[j] = r ? xi[j] + r[i * d + j] : xi[j];
        const float inv = 1.0f / sqrtf(dot(si, si, d) / (float)d + eps);
        for (int64_t j = 0; j < d; j++) out[i * d + j] = si[j] * inv * (zero_centred ? 1.0f + w[j] : w[j]);
    }
}

/* out [T, H, D] = x with its first `rot` dims of each head rotated (NeoX halves); row t of x starts at t * stride
 * (a view of a fused projection's output), each head's D values contiguous; cos/sin [T, rot]. */
void ninfer_rope(const float *x, int64_t t_rows, int64_t stride, int64_t h, int64_t d, int64_t rot,
                 const float *cos, const float *sin, float *out) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < t_rows; t++)
        for (int64_t k = 0; k < h; k++) {
            const float *xi = x + t * stride + k * d, *c = cos + t * rot, *sn = sin + t * rot;
            float *o = out + (t * h + k) * d;
            for (int64_t i = 0; i < half; i++) o[i] = xi[i] * c[i] + (-xi[i + half]) * sn[i];
            for (int64_t i = half; i < rot; i++) o[i] = xi[i] * c[i] + xi[i - half] * sn[i];
            for (int64_t i = rot; i < d; i++) o[i] = xi[i];
        }
}

#ifdef HAVE_AVX2
/* exp(x) for x <= 0 (softmax scores less their max): 2^n * p(r), Cephes' polynomial; within 2 ulp. */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* o[0..n) += p * v[0..n) */
static void axpy(float *o, float p, const float *v, int64_t n) {
    int64_t c = 0;
#ifdef HAVE_AVX2
    const __m256 pv = _mm256_set1_ps(p);
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(o + c, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + c), _mm256_loadu_ps(o + c)));
#endif
    for (; c < n; c++) o[c] += p * v[c];
}

/* out[i] = (q . k[i * stride]) * scale for i < n: four keys a pass, their sums reduced together (one key's
 * horizontal sum costs as much as its products at a head's 64 values). */
static void key_scores(const float *q, const float *k, int64_t stride, int64_t d, int64_t n, float scale, float *out) {
    int64_t i = 0;
#ifdef HAVE_AVX2
    if (d % 8 == 0)
        for (; i + 4 <= n; i += 4) {
            const float *k0 = k + i * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
            __m256 q8 = _mm256_loadu_ps(q);
            __m256 a0 = _mm256_mul_ps(q8, _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(q8, _mm256_loadu_ps(k1));
            __m256 a2 = _mm256_mul_ps(q8, _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(q8, _mm256_loadu_ps(k3));
            for (int64_t c = 8; c < d; c += 8) {
                q8 = _mm256_loadu_ps(q + c);
                a0 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k0 + c), a0);
                a1 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k1 + c), a1);
                a2 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k2 + c), a2);
                a3 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(k3 + c), a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(out + i, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
#endif
    for (; i < n; i++) out[i] = dot(q, k + i * stride, d) * scale;
}

/* out[0..d) += sum_i p[i] v[i * stride + 0..d), key after key as `axpy` adds them (the same roundings), with 64
 * columns of out held in registers across the keys. */
static void weighted_sum(const float *p, const float *v, int64_t stride, int64_t n, int64_t d, float *out) {
    int64_t c = 0;
#ifdef HAVE_AVX2
    for (; c + 64 <= d; c += 64) {
        __m256 o[8];
        for (int r = 0; r < 8; r++) o[r] = _mm256_loadu_ps(out + c + 8 * r);
        for (int64_t i = 0; i < n; i++) {
            const __m256 pv = _mm256_set1_ps(p[i]);
            const float *vi = v + i * stride + c;
            for (int r = 0; r < 8; r++) o[r] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 8 * r), o[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + c + 8 * r, o[r]);
    }
#endif
    if (c < d)
        for (int64_t i = 0; i < n; i++) axpy(out + c, p[i], v + i * stride + c, d - c);
}

/* Softmax over p[0..n) in place: p = exp(p - max) / sum. */
static void softmax(float *p, int64_t n) {
    float m = p[0], sum = 0;
    for (int64_t i = 1; i < n; i++) m = p[i] > m ? p[i] : m;
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) sum += lanes[l];
#endif
    for (; i < n; i++) {
        p[i] = expf(p[i] - m);
        sum += p[i];
    }
    const float inv = 1.0f / sum;
    for (i = 0; i < n; i++) p[i] *= inv;
}

typedef struct {
    const float *q, *k, *v;
    int64_t t_rows, h, d, hkv, start;
    float scale, *scores, *out;
    atomic_llong next;
} AttentionJob;

static void attention_work(void *arg, int id, int team) {
    AttentionJob *a = arg;
    (void)id, (void)team;
    const int64_t len = a->start + a->t_rows, group = a->h / a->hkv, d = a->d;
    for (int64_t task; (task = pool_next(&a->next)) < a->t_rows * a->hkv;) {
        const int64_t t = task / a->hkv, g = task % a->hkv, n = a->start + t + 1, first = t * a->h + g * group;
        for (int64_t j = first; j < first + group; j++) { /* the group's keys and values stay in cache between */
            float *scores = a->scores + j * len, *out = a->out + j * d;
            key_scores(a->q + j * d, a->k + g * d, a->hkv * d, d, n, a->scale, scores);
            softmax(scores, n);
            for (int64_t c = 0; c < d; c++) out[c] = 0;
            weighted_sum(scores, a->v + g * d, a->hkv * d, n, d, out);
        }
    }
}

/* out [T, H, D]: query t of q [T, H, D] (at position start + t) attends over keys and values [start + T, Hkv, D]
 * (rows contiguous) up to its own position; head j reads kv head j / (H / Hkv). One task per (query, kv head):
 * the heads sharing a kv head read each key and value row once between them. Returns 0, or -1 without memory
 * for the scores. */
int ninfer_attention(const float *q, int64_t t_rows, int64_t h, int64_t d, const float *k, const float *v,
                     int64_t hkv, int64_t start, float scale, float *out, int threads) {
    const int64_t len = start + t_rows;
    AttentionJob job = {.q = q, .k = k, .v = v, .t_rows = t_rows, .h = h, .d = d, .hkv = hkv, .start = start,
                        .scale = scale, .scores = malloc(sizeof(float) * len * t_rows * h), .out = out};
    if (job.scores == NULL) return -1;
    atomic_init(&job.next, 0);
    pool_run(attention_work, &job, len * h * d >= 262144 ? threads : 1);
    free(job.scores);
    return 0;
}

/* out [rows, f] = silu(gate) * up for gu [rows, 2f] = [gate | up]. */
void ninfer_silu_mul(const float *gu, int64_t rows, int64_t f, float *out) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < f; j++) {
            const float g = gu[i * 2 * f + j];
            out[i * f + j] = g / (1.0f + expf(-g)) * gu[i * 2 * f + f + j];
        }
}
