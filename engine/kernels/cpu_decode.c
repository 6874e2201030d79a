/* Llama-family decoder layers over a few rows of one or more sequences (their decode or verify steps) in one call:
 * per layer, residual add + RMSNorm, the fused q/k/v projection over every row (the weights read once for all
 * the sequences), RoPE, each row's K/V written into its sequence's paged cache, causal attention over that
 * sequence's cached keys, the output projection, residual add + RMSNorm, gate/up, SiLU-and-multiply
 * and the down projection. A small model's decode step is otherwise ~20 library calls per layer whose dispatch
 * outweighs their arithmetic, and its projections are too small to be worth waking threads for each: here one job
 * of the thread team (cpu_pool.c) spans the layers, its threads share the rows of every projection and the heads
 * of the attention, and meet at a barrier between the steps that read each other's output.
 *
 * The arithmetic is the per-op kernels' own (cpu_gguf.c, cpu_layers.c: one translation unit, cpu_kernels.c), so
 * the layers round as the model's composition of those kernels does; the reference is that composition in torch
 * (`models/llama.py` without these kernels). fp32 activations and KV rows; weights in GGUF blocks or fp32.
 */
#define MAX_PARTS 4 /* row ranges of different types in one fused projection (cpu_decode.py MAX_PARTS) */

/* A projection's weight: row ranges stacked in output order, each of one type (cpu_gguf.c's types). */
typedef struct {
    int64_t parts;
    int64_t qtype[MAX_PARTS];
    const uint8_t *data[MAX_PARTS];
    int64_t rows[MAX_PARTS];
} Weight;

/* One layer's geometry and weights (cpu_decode.py `_Layer`). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, ffn;
    float eps, scale;
    const float *in_norm, *post_norm;
    Weight qkv, o, gate_up, down;
} Layer;

/* The rows [first, end) of n items that thread `id` of `team` takes in a static split. */
static void share(int64_t n, int id, int team, int64_t *first, int64_t *end) {
    *first = n * id / team;
    *end = n * (id + 1) / team;
}

/* y[i * ldy + j] = x[i] . W[j] for the m rows of x, each part's rows handed out by its counter in `next`; the
 * barrier at the end: the output is whole when any thread goes on. */
static void team_linear(const Weight *w, int64_t k, const float *x, const BlockedX *bx, int64_t m, float *y,
                        int64_t ldy, atomic_llong *next, int team) {
    int64_t first = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        linear_share((int)w->qtype[p], w->data[p], w->rows[p], k, x, bx, m, y + first, ldy, &next[p]);
        first += w->rows[p];
    }
    pool_barrier(team);
}

/* Each row's BlockedX of x [m, k], the blocks split among the team (no barrier: the caller's next one). */
static void team_block_x(const float *x, int64_t m, int64_t k, BlockedX *bx, int id, int team) {
    const int64_t nb = k / 32;
    int64_t first, end;
    share(m * nb, id, team, &first, &end);
    for (int64_t r = first; r < end; r++) {
        const int64_t i = r / nb, b = r % nb;
        BlockedX one = {bx[i].q + 32 * b, bx[i].lo + 32 * b, bx[i].scale + b, bx[i].sum + b};
        block_x(x + i * k + 32 * b, 32, &one);
    }
}

/* act [m, f] = silu(gate) * up of gate_up [m, 2f] = [gate | up], and act's BlockedX rows: per block of 32
 * columns, both at once, the blocks split among the team. */
static void team_silu_mul(const float *gate_up, int64_t m, int64_t f, float *act, BlockedX *bx, int id, int team) {
    const int64_t nb = (f + 31) / 32;
    int64_t first, end;
    share(m * nb, id, team, &first, &end);
    for (int64_t r = first; r < end; r++) {
        const int64_t i = r / nb, b = r % nb, c = 32 * b, n = f - c < 32 ? f - c : 32;
        for (int64_t j = c; j < c + n; j++) {
            const float g = gate_up[i * 2 * f + j];
            act[i * f + j] = g / (1.0f + expf(-g)) * gate_up[i * 2 * f + f + j];
        }
        if (n == 32) {
            BlockedX one = {bx[i].q + c, bx[i].lo + c, bx[i].scale + b, bx[i].sum + b};
            block_x(act + i * f + c, 32, &one);
        }
    }
}

/* The scratch one call needs, carved from one allocation. */
typedef struct {
    float *normed, *qkv, *q, *attn, *o, *gate_up, *act, *scores;
    BlockedX bx_hidden[MAX_X_ROWS], bx_attn[MAX_X_ROWS], bx_act[MAX_X_ROWS];
} Scratch;

static char *carve(char **at, int64_t bytes) {
    char *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

static char *scratch_new(const Layer *L, int64_t t, int64_t len, Scratch *s) {
    const int64_t qkv_n = (L->heads + 2 * L->kv_heads) * L->head_dim, qd = L->heads * L->head_dim;
    const int64_t floats[] = {t * L->hidden, t * qkv_n, t * qd, t * qd, t * L->hidden, t * 2 * L->ffn, t * L->ffn,
                              t * L->heads * len};
    const int64_t bx[] = {blocked_bytes(L->hidden), blocked_bytes(qd), blocked_bytes(L->ffn)};
    int64_t total = 0;
    for (int i = 0; i < 8; i++) total += (floats[i] * 4 + 63) / 64 * 64;
    for (int i = 0; i < 3; i++) total += t * ((bx[i] + 63) / 64 * 64);
    char *mem = malloc(total), *at = mem;
    if (mem == NULL) return NULL;
    float **dst[] = {&s->normed, &s->qkv, &s->q, &s->attn, &s->o, &s->gate_up, &s->act, &s->scores};
    for (int i = 0; i < 8; i++) *dst[i] = (float *)carve(&at, floats[i] * 4);
    BlockedX *rows[] = {s->bx_hidden, s->bx_attn, s->bx_act};
    const int64_t ks[] = {L->hidden, qd, L->ffn};
    for (int i = 0; i < 3; i++)
        for (int64_t r = 0; r < t; r++) rows[i][r] = blocked_at(carve(&at, bx[i]), ks[i]);
    return mem;
}

/* The attention of query head j (at position pos) over keys and values 0..pos of its kv head, which lie in the
 * store's rows of block table[p / page] (the division once per block, not per key): the table of the row's own
 * sequence, so a step's sequences never see each other's keys. */
static void attend(const Layer *L, const float *q, const float *kst, const float *vst, const int32_t *table,
                   int64_t page, int64_t pos, int64_t j, float *scores, float *out) {
    const int64_t d = L->head_dim, g = j / (L->heads / L->kv_heads), stride = L->kv_heads * d, n = pos + 1;
    for (int64_t first = 0; first < n; first += page)
        key_scores(q, kst + (int64_t)table[first / page] * page * stride + g * d, stride, d,
                   n - first < page ? n - first : page, L->scale, scores + first);
    softmax(scores, n);
    for (int64_t c = 0; c < d; c++) out[c] = 0;
    for (int64_t first = 0; first < n; first += page)
        weighted_sum(scores + first, vst + (int64_t)table[first / page] * page * stride + g * d, stride,
                     n - first < page ? n - first : page, d, out);
}

/* A step's rows and where its KV goes (cpu_decode.py `_Step`): x and h are updated in place, layer after layer.
 * Each row has its position and its sequence's block table: a sequence's rows are consecutive, at consecutive
 * positions, so each row attends to its own sequence's earlier rows of the step as to its cached keys. */
typedef struct {
    float *x, *h;   /* [t, hidden]: the residual stream, and the last layer's output still to be added to it */
    int64_t has_h;  /* 0 before the first layer: h holds nothing yet */
    int64_t t;
    const int64_t *pos;           /* [t] */
    const int32_t *const *table;  /* [t] */
    const float *cos, *sin;
    float *k, *v;   /* the K and V store [layers, rows, kv_heads, head_dim], which every sequence's blocks index */
    int64_t layer_floats;
    int64_t page;
    int64_t len;    /* the longest row's keys: 1 + its position */
} Step;

#define COUNTERS (4 * MAX_PARTS + 1) /* work items of each part of the four projections, and of the attention */

/* One call's work, shared by the team (`layers_work`). */
typedef struct {
    const Layer *layers;
    int64_t first, last;
    Step *S;
    Scratch s;
    atomic_llong *next; /* COUNTERS per layer */
} Job;

static void layer_work(Job *job, int64_t i, int id, int team) {
    const Layer *L = &job->layers[i];
    const Step *S = job->S;
    Scratch *s = &job->s;
    atomic_llong *next = job->next + (i - job->first) * COUNTERS;
    const int64_t t = S->t, d = L->hidden, hd = L->head_dim, qd = L->heads * hd, kvd = L->kv_heads * hd;
    const int64_t f = L->ffn, qkv_n = qd + 2 * kvd, len = S->len;
    float *kst = S->k + i * S->layer_floats, *vst = S->v + i * S->layer_floats;
    if (id == 0) { /* too little to share: a barrier costs more */
        ninfer_add_rms_norm(S->x, S->has_h || i > job->first ? S->h : NULL, L->in_norm, t, d, L->eps, 0, S->x,
                            s->normed);
        team_block_x(s->normed, t, d, s->bx_hidden, 0, 1);
    }
    pool_barrier(team);
    team_linear(&L->qkv, d, s->normed, s->bx_hidden, t, s->qkv, qkv_n, &next[0], team);
    if (id == 0) {
        ninfer_rope(s->qkv, t, qkv_n, L->heads, hd, L->rotary_dim, S->cos, S->sin, s->q);
        for (int64_t r = 0; r < t; r++) { /* this step's keys (rotated) and values into the cache */
            const int64_t p = S->pos[r], row = ((int64_t)S->table[r][p / S->page] * S->page + p % S->page) * kvd;
            ninfer_rope(s->qkv + r * qkv_n + qd, 1, qkv_n, L->kv_heads, hd, L->rotary_dim, S->cos + r * L->rotary_dim,
                        S->sin + r * L->rotary_dim, kst + row);
            memcpy(vst + row, s->qkv + r * qkv_n + qd + kvd, kvd * sizeof(float));
        }
    }
    pool_barrier(team);
    for (int64_t task; (task = pool_next(&next[4 * MAX_PARTS])) < t * L->heads;) {
        const int64_t r = task / L->heads, j = task % L->heads;
        attend(L, s->q + task * hd, kst, vst, S->table[r], S->page, S->pos[r], j, s->scores + task * len,
               s->attn + task * hd);
    }
    pool_barrier(team);
    team_block_x(s->attn, t, qd, s->bx_attn, id, team);
    pool_barrier(team);
    team_linear(&L->o, qd, s->attn, s->bx_attn, t, s->o, d, &next[MAX_PARTS], team);
    if (id == 0) {
        ninfer_add_rms_norm(S->x, s->o, L->post_norm, t, d, L->eps, 0, S->x, s->normed);
        team_block_x(s->normed, t, d, s->bx_hidden, 0, 1);
    }
    pool_barrier(team);
    team_linear(&L->gate_up, d, s->normed, s->bx_hidden, t, s->gate_up, 2 * f, &next[2 * MAX_PARTS], team);
    team_silu_mul(s->gate_up, t, f, s->act, s->bx_act, id, team);
    pool_barrier(team);
    team_linear(&L->down, f, s->act, s->bx_act, t, S->h, d, &next[3 * MAX_PARTS], team);
}

static void layers_work(void *arg, int id, int team) {
    Job *job = arg;
    for (int64_t i = job->first; i < job->last; i++) layer_work(job, i, id, team);
}

/* Layers first..last-1 over the step's rows x [t, hidden], row r at position pos[r]: for each, x += h (the last
 * layer's output, none before the first layer) + attention, h = the MLP's output (the next layer, or the caller,
 * adds it). Layer i's K and V store is k, v + i * layer_floats ([rows, kv_heads, head_dim]), row r's keys found
 * through table[r] (int32 block ids) in blocks of `page`. cos, sin [t, rotary_dim]. Returns 0, or -1 for more
 * than MAX_X_ROWS rows or no memory. */
int ninfer_llama_layers(const Layer *layers, int64_t first, int64_t last, Step *S, int threads) {
    if (S->t > MAX_X_ROWS) return -1;
    S->len = 0;
    for (int64_t r = 0; r < S->t; r++) S->len = S->pos[r] + 1 > S->len ? S->pos[r] + 1 : S->len;
    Job job = {.layers = layers, .first = first, .last = last, .S = S};
    char *mem = scratch_new(&layers[first], S->t, S->len, &job.s);
    job.next = malloc(sizeof(atomic_llong) * COUNTERS * (last - first));
    if (mem == NULL || job.next == NULL) {
        free(mem);
        free(job.next);
        return -1;
    }
    for (int64_t i = 0; i < COUNTERS * (last - first); i++) atomic_init(&job.next[i], 0);
    pool_run(layers_work, &job, threads);
    S->has_h = 1;
    free(job.next);
    free(mem);
    return 0;
}
