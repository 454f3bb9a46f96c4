/* The fused decode step: a whole decoder stack (Gemma 3 and the Llama family) for 1..8 decode rows (up to
   FWD_MAX_ROWS where every product runs the VNNI or AVX2 form) in one call (asyncpage/model/native_step.py is its Python face and says when it is used).

   Why: at a few rows a layer is ~40 small torch ops around seven matrix-vector products, and their
   dispatch, not their bytes, set the time (one-stream decode of the default model: ~40 ms a step
   on a 2-core AVX-512 box, of which the weights' bytes need ~4 ms). Here a step is one call: the
   embedding lookup, RMSNorms, the quantized Q/K/V, O, gate/up and down matrix-vector products (the
   block kernels of gguf_quants.c, called directly: no Python between them), QK-norm, RoPE, the
   new K/V written into the paged pool at the slot mapping, paged attention over the block tables
   (a sliding window on the layers that have one), gelu-tanh / SiLU gating, residuals, and the
   final norm. The LM head stays the caller's (one GGUFLinear call on the result).

   Threads: one OpenMP parallel region per step (torch's libgomp, see native.py), every op a
   work-shared loop inside it with the loop's barrier between ops: ggml's threadpool model, about
   nine barriers a layer. Matrix rows are handed out in chunks (dynamically: a descheduled thread
   on a shared machine does not hold the others back by a whole static share); the ops between
   them (norms, rounding the next input to int8, RoPE, attention) split over rows, heads or a KV head's query heads.

   Numbers: activations float32 throughout (whatever the torch model's dtype); each matrix input
   rounded to int8 blocks once per op exactly as gguf_matmul does (quantize_row), so a product
   gives what the unfused kernels give on the same input. The K/V pool keeps the model's dtype
   (float32, bfloat16 or float16: rounded to nearest even when written). Norms sum squares in
   double; attention is two passes (scores, then softmax-weighted values) in float32.

   Set-up (once, at load): fwd_create, then fwd_set_* for every weight (pointers into the torch
   tensors: the GGUF blocks as stored, or dense float32 / bfloat16 rows for a tensor without a block
   kernel), then fwd_ready. The caller keeps every tensor alive while the handle lives. */

#include "gguf_quants.c" /* the block formats, the activations' rounding and the dot kernels */

/* The most rows a step may have (fwd_create's max_rows): 8 where the portable tile kernels take a product, up to 32
   in the VNNI and AVX2 forms, whose rows past 8 go through the paths gguf_matmul's take (mat_part: the VNNI form's
   interleaved one, rows repacked by eight, the K-quants' row tiles). */
#define FWD_MAX_ROWS 32

#ifdef _OPENMP
#include <omp.h>
#define TID() omp_get_thread_num()
#else
#define TID() 0
#endif

enum { MAT_F32 = -1, MAT_BF16 = -2 };            /* dense rows (a tensor without a block kernel) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };    /* the pool's dtype */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { M_Q, M_K, M_V, M_O, M_GATE, M_UP, M_DOWN, N_MATS };
enum { N_ATTN_IN, N_ATTN_OUT, N_FFN_IN, N_FFN_OUT, N_QNORM, N_KNORM, N_NORMS };
enum { MAX_ROPES = 4, E_SETUP = -6 };
/* What a matrix input is rounded to for its consumers (Act): blocks of 32 with their offsets'
   sums (8: Q4_0, 16: Q5_0, 128: Q8_0 in the VNNI form), blocks of 256 (K-quants). */
enum { NEED32 = 1, NEED256 = 2, NEED_OFF = 4 /* << 0, 1, 2: offsets 8, 16, 128 */ };
static const int OFFSETS[3] = {8, 16, 128};

typedef struct {
    int type, form, offset; /* ggml type or MAT_*; kernel form; the weights' offset the form reads */
    const uint8_t *w;
    long n, k, rb, nb; /* rows, values per row, bytes per row, blocks per row */
    row_kernel kern;
    const float *bias;
} Mat;

typedef struct {
    Mat mat[N_MATS];
    const float *norm[N_NORMS]; /* NULL: the family has no such norm */
    int rope;                   /* index of its rotary (cos/sin made once a step per rotary) */
    long window;                /* 0: full attention */
    float scale;
    int need[4];                /* what each input (QKV, O, gate/up, down) is rounded to */
} Layer;

/* One matrix input rounded to int8 for its consumers ([rows, k] each, k the input's length). */
typedef struct {
    int8_t *q32, *q256;
    float *d32, *d256;
    int16_t *s32, *s256;
    int32_t *c[3];
} Rounded;

typedef struct {
    float *x, *xn, *o, *q, *k, *v, *att, *h, *cos, *sin, *scores;
    long *at;
    /* in: the norms' and attention's outputs; hr: h, rounded chunk by chunk while gate and up still
       read `in` (one buffer for both gave the gate/up chunks after the first a half-overwritten input) */
    Rounded in, hr;
    long scores_len; /* positions per thread in at (scores: ATTEND_GROUP times as many) */
    int threads;
} Scratch;

typedef struct {
    int n_layers, hidden, heads, kv_heads, head_dim, inter, act, max_rows, n_ropes, ready;
    float eps, embed_scale;
    int embed_type;
    const uint8_t *embed;
    long vocab, embed_rb;
    const float *final_norm;
    const float *inv_freq[MAX_ROPES];
    float rope_scaling[MAX_ROPES];
    Layer *layers;
    long maxk;
    int busy;
    Scratch s;
} Model;

/* ---------------- small numeric pieces ---------------- */

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Float to IEEE half, rounded to nearest even (what torch's .to(float16) gives). */
static uint16_t f32_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
    if (a >= 0x477ff000u) /* rounds to at least 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal half: a subnormal (units of 2^-24) or zero */
        const int shift = 126 - (int)(a >> 23); /* value = m * 2^-shift in those units */
        if (shift > 24)
            return (uint16_t)sign;
        const uint32_t m = (a & 0x7fffffu) | 0x800000u, q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
        return (uint16_t)(sign | (q + (rem > halfway || (rem == halfway && (q & 1u)))));
    }
    const uint32_t bias = a - 0x38000000u; /* rebias the exponent: 127 -> 15 */
    const uint32_t q = bias >> 13, rem = bias & 0x1fffu;
    return (uint16_t)(sign | (q + (rem > 0x1000u || (rem == 0x1000u && (q & 1u)))));
}

static void rmsnorm(const float *x, const float *w, long n, float eps, float *out) {
    double ss = 0.0;
    for (long i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (long i = 0; i < n; i++)
        out[i] = x[i] * inv * w[i];
}

static inline float activate(float g, int act) {
    if (act == ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* RoPE, rotate-half (NeoX) pairs (i, i + D/2), as layers.apply_rotary. */
static void rope(float *x, const float *c, const float *s, int dim) {
    const int half = dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

static void store_kv(void *pool, long at, const float *src, int n, int dt) {
    if (dt == KV_F32)
        memcpy((float *)pool + at, src, (size_t)n * sizeof(float));
    else if (dt == KV_BF16)
        for (int i = 0; i < n; i++)
            ((uint16_t *)pool)[at + i] = f32_bf16(src[i]);
    else
        for (int i = 0; i < n; i++)
            ((uint16_t *)pool)[at + i] = f32_f16(src[i]);
}

/* ---------------- attention: one query head of one row over its block table ---------------- */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FWD_SIMD 1
static inline __m256 kv8(const void *p, long i, int dt) {
    if (dt == KV_F32)
        return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
#else
#define FWD_SIMD 0
#endif

static inline float kv1(const void *p, long i, int dt) {
    if (dt == KV_F32)
        return ((const float *)p)[i];
    return dt == KV_BF16 ? bf16_f32(((const uint16_t *)p)[i]) : half(((const uint16_t *)p)[i]);
}

/* N (1-4) query heads of one KV head over the same positions: at[t] the element offset of position t's row of the
   KV head in the pools; the heads' queries and outputs `dim` apart (q + i * dim, out + i * dim), their scores `stride`
   apart. Each K and V element is converted once for all N, and each head's arithmetic is the same whatever N
   (the products' order, the sums' trees, the V pass per output value over the positions in order): a head gives
   the same bits alone or grouped. */
static inline __attribute__((always_inline)) void attend_heads_n(const float *q, const void *kc, const void *vc, int dt,
                                                               const long *at, long len, int dim, float scale,
                                                               float *scores, long stride, float *out, const int N) {
    float top[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (long t = 0; t < len; t++) {
#if FWD_SIMD
        if (dim % 32 == 0) {
            __m256 a[4][4];
            for (int i = 0; i < N; i++)
                a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 32) {
                const __m256 k0 = kv8(kc, at[t] + d, dt), k1 = kv8(kc, at[t] + d + 8, dt);
                const __m256 k2 = kv8(kc, at[t] + d + 16, dt), k3 = kv8(kc, at[t] + d + 24, dt);
                for (int i = 0; i < N; i++) {
                    const float *qh = q + (long)i * dim;
                    a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), k0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), k1, a[i][1]);
                    a[i][2] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 16), k2, a[i][2]);
                    a[i][3] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 24), k3, a[i][3]);
                }
            }
            for (int i = 0; i < N; i++) {
                const float sc = hsum_avx2(_mm256_add_ps(_mm256_add_ps(a[i][0], a[i][1]),
                                                         _mm256_add_ps(a[i][2], a[i][3]))) * scale;
                scores[i * stride + t] = sc;
                top[i] = sc > top[i] ? sc : top[i];
            }
            continue;
        }
#endif
        for (int i = 0; i < N; i++) {
            float sc = 0.0f;
            for (int d = 0; d < dim; d++)
                sc += q[(long)i * dim + d] * kv1(kc, at[t] + d, dt);
            sc *= scale;
            scores[i * stride + t] = sc;
            top[i] = sc > top[i] ? sc : top[i];
        }
    }
    for (int i = 0; i < N; i++) {
        float *sc = scores + i * stride, sum = 0.0f;
        for (long t = 0; t < len; t++) {
            sc[t] = expf(sc[t] - top[i]);
            sum += sc[t];
        }
        const float inv = 1.0f / sum;
        for (long t = 0; t < len; t++)
            sc[t] *= inv;
    }
    int d0 = 0;
#if FWD_SIMD
    for (; d0 + 64 <= dim; d0 += 64) /* 64 output values at a time, over every position: V read once */
        for (int half = 0; half < 64; half += 32) {
            __m256 acc[4][4];
            for (int i = 0; i < N; i++)
                acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
            for (long t = 0; t < len; t++) {
                __m256 v[4];
                for (int j = 0; j < 4; j++)
                    v[j] = kv8(vc, at[t] + d0 + half + 8 * j, dt);
                for (int i = 0; i < N; i++) {
                    const __m256 p = _mm256_set1_ps(scores[i * stride + t]);
                    for (int j = 0; j < 4; j++)
                        acc[i][j] = _mm256_fmadd_ps(p, v[j], acc[i][j]);
                }
            }
            for (int i = 0; i < N; i++)
                for (int j = 0; j < 4; j++)
                    _mm256_storeu_ps(out + (long)i * dim + d0 + half + 8 * j, acc[i][j]);
        }
#endif
    for (int i = 0; i < N; i++) {
        float *oh = out + (long)i * dim;
        const float *sc = scores + i * stride;
        for (int d = d0; d < dim; d++)
            oh[d] = 0.0f;
        for (long t = 0; t < len && d0 < dim; t++)
            for (int d = d0; d < dim; d++)
                oh[d] += sc[t] * kv1(vc, at[t] + d, dt);
    }
}

/* Query heads h .. h + n - 1 (n <= ATTEND_GROUP) of one KV head, in a row whose context is `ctx` positions on
   `table` (blocks of `block` slots), over the last `window` of them (0: all): the positions' offsets into `at`, then
   attend_heads_n. kvd: values per pool slot (KV heads x dim); group: query heads per KV head; scores: n buffers
   `stride` apart. The fused step and fwd_attend_rows (one head) both attend so. Each K and V element converted once
   for the n (a Gemma 3 270M layer's 4 heads of one KV head at one row: two units of two for two threads): one greedy
   stream at 1,200-1,400 positions of context, the default model (Xeon VM, three alternating runs), the layers
   15.6-16.5 -> 14.6-16.3 ms a step, the same bits (f32 and bf16 pools, groups of 1-8 query heads, 1-8 rows, 1-2
   threads, sliding windows). */
enum { ATTEND_GROUP = 4 };
static void attend_row_heads(const float *q, const void *kc, const void *vc, int dt, const long *table, long ctx,
                             long block, long window, long kvd, int h, int n, int group, int dim, float scale, long *at,
                             float *scores, long stride, float *out) {
    const long first = window > 0 && ctx > window ? ctx - window : 0, len = ctx - first;
    const long off = (long)(h / group) * dim;
    for (long t = 0; t < len; t++) {
        const long p = first + t;
        at[t] = (table[p / block] * block + p % block) * kvd + off;
    }
    switch (n) {
    case 1: attend_heads_n(q, kc, vc, dt, at, len, dim, scale, scores, stride, out, 1); return;
    case 2: attend_heads_n(q, kc, vc, dt, at, len, dim, scale, scores, stride, out, 2); return;
    case 3: attend_heads_n(q, kc, vc, dt, at, len, dim, scale, scores, stride, out, 3); return;
    default: attend_heads_n(q, kc, vc, dt, at, len, dim, scale, scores, stride, out, 4); return;
    }
}

/* Query heads per unit of a step's attention: as many of a KV head's (at most ATTEND_GROUP) as still leave every
   thread a unit (rows x KV heads x units per KV head >= threads). */
static int heads_per_unit(int rows, int kv_heads, int group, int threads) {
    int n = group < ATTEND_GROUP ? group : ATTEND_GROUP;
    while (n > 1 && (long)rows * kv_heads * ((group + n - 1) / n) < threads)
        n--;
    return n;
}

/* Whether every row's context fits its table (1..width * block positions) and every block it uses is in the pool
   (E_INDEX otherwise); `most` gets the longest context. */
static int check_tables(int rows, const long *lens, const long *tables, long width, long block, long kv_blocks,
                        long *most) {
    *most = 1;
    for (int r = 0; r < rows; r++) {
        if (lens[r] < 1 || lens[r] > width * block)
            return E_INDEX;
        for (long b = 0; b < (lens[r] + block - 1) / block; b++)
            if (tables[r * width + b] < 0 || tables[r * width + b] >= kv_blocks)
                return E_INDEX;
        *most = lens[r] > *most ? lens[r] : *most;
    }
    return 0;
}

/* ---------------- matrix rows ---------------- */

/* Rows [i0, i1) of m for activation rows 0..rows-1: out[r * ldo + i - col0] (+ bias). a: the
   rounded input (block kernels); xf: the float input [rows, m->k] (dense rows). */
static void mat_part(const Mat *m, const Act *a, const float *xf, int rows, long i0, long i1, float *out, long ldo,
                     long col0) {
    if (m->type < 0) {
        for (int r = 0; r < rows; r++)
            for (long i = i0; i < i1; i++) {
                const float *x = xf + (long)r * m->k;
                float s = 0.0f;
                if (m->type == MAT_F32) {
                    const float *w = (const float *)(m->w + i * m->rb);
#pragma omp simd reduction(+ : s)
                    for (long j = 0; j < m->k; j++)
                        s += x[j] * w[j];
                } else {
                    const uint16_t *w = (const uint16_t *)(m->w + i * m->rb);
#pragma omp simd reduction(+ : s)
                    for (long j = 0; j < m->k; j++)
                        s += x[j] * bf16_f32(w[j]);
                }
                out[(long)r * ldo + i - col0] = s + (m->bias ? m->bias[i] : 0.0f);
            }
        return;
    }
#if GQ_X86
    if (r8_base(m->type) >= 0) { /* rows repacked by eight (i0 and i1 whole groups: chunk_rows, run_ffn) */
        if (m->form == FORM_VNNI)
            r8_range_vnni(r8_base(m->type), m->w, m->nb, i0, i1, a, rows, out + i0 - col0, ldo);
        else
            r8_range_avx2(r8_base(m->type), m->w, m->nb, i0, i1, a, rows, out + i0 - col0, ldo);
        if (m->bias)
            for (int r = 0; r < rows; r++)
                for (long i = i0; i < i1; i++)
                    out[(long)r * ldo + i - col0] += m->bias[i];
        return;
    }
    if (uses_ilv(m->type, m->form, rows)) { /* past 8 rows: the interleaved path, as gguf_matmul takes it */
        const int kq = gguf_block_elems(m->type) == 256;
        void *u = aligned_alloc(32, kq ? (size_t)m->nb * sizeof(KTile_vnni) : (size_t)m->nb * 8 * sizeof(__m256i));
        float *dw = kq ? NULL : aligned_alloc(32, (size_t)m->nb * 8 * sizeof(float));
        if (u != NULL && (kq || dw != NULL)) {
            ilv_range_vnni(m->type, m->w, m->rb, i0, i1, a, rows, out + i0 - col0, ldo, u, dw);
            if (m->bias)
                for (int r = 0; r < rows; r++)
                    for (long i = i0; i < i1; i++)
                        out[(long)r * ldo + i - col0] += m->bias[i];
            free(u);
            free(dw);
            return;
        }
        free(u);
        free(dw); /* no memory for the unpacked tile: the tile kernels (the same products, summed in another order) */
    }
#endif
    tile_pass(m->kern, m->type, m->form, m->w, m->rb, m->nb, a, rows, i0, i1, out, ldo, col0, m->bias);
}

static Act act_for(const Rounded *s, const Mat *m, long k) {
    if (m->type >= 0 && gguf_block_elems(m->type) == 256)
        return (Act){s->q256, s->d256, s->s256, NULL, k, k / 256};
    const int o = m->offset == 16 ? 1 : m->offset == 128 ? 2 : 0;
    return (Act){s->q32, s->d32, s->s32, s->c[o], k, k / 32};
}

static int need_of(const Mat *m) {
    if (m->type < 0)
        return 0;
    if (gguf_block_elems(m->type) == 256)
        return NEED256;
    const int o = m->offset == 8 ? 0 : m->offset == 16 ? 1 : m->offset == 128 ? 2 : -1;
    return NEED32 | (o >= 0 ? NEED_OFF << o : 0);
}

/* Columns [i0, i1) (block aligned) of row r of an input of k values, rounded for `need`. */
static void quantize_part(const Rounded *s, int need, const float *xr, long k, int r, long i0, long i1) {
    if (need & NEED32) {
        int16_t *sums = s->s32 + (long)r * (k / 16) + i0 / 16;
        quantize_row(xr + i0, i1 - i0, 32, s->q32 + (long)r * k + i0, s->d32 + (long)r * (k / 32) + i0 / 32, sums);
        for (int o = 0; o < 3; o++)
            if (need & (NEED_OFF << o))
                block_offsets(sums, (i1 - i0) / 32, OFFSETS[o], s->c[o] + (long)r * (k / 32) + i0 / 32);
    }
    if (need & NEED256)
        quantize_row(xr + i0, i1 - i0, 256, s->q256 + (long)r * k + i0, s->d256 + (long)r * (k / 256) + i0 / 256,
                     s->s256 + (long)r * (k / 16) + i0 / 16);
}

static long chunk_rows(long n, int threads) {
    long chunk = 64;
    while (chunk > 8 && (n + chunk - 1) / chunk < 4L * threads) /* 8: whole groups of rows repacked by eight */
        chunk /= 2;
    return chunk;
}

typedef struct {
    const Mat *m;
    float *out;
    long ldo;
} Job;

/* Several products of the same input (Q, K, V), their rows handed out in chunks. */
static void run_jobs(const Rounded *s, const Job *jobs, int nj, const float *xf, long k, int rows, int threads) {
    long chunk[3] = {1, 1, 1}, units[3] = {0, 0, 0}, total = 0;
    Act acts[3];
    for (int j = 0; j < nj; j++) {
        chunk[j] = chunk_rows(jobs[j].m->n, threads);
        units[j] = (jobs[j].m->n + chunk[j] - 1) / chunk[j];
        total += units[j];
        acts[j] = act_for(s, jobs[j].m, k);
    }
#pragma omp for schedule(dynamic, 1)
    for (long u = 0; u < total; u++) {
        long v = u;
        int j = 0;
        while (v >= units[j])
            v -= units[j++];
        const long i0 = v * chunk[j], i1 = i0 + chunk[j] < jobs[j].m->n ? i0 + chunk[j] : jobs[j].m->n;
        mat_part(jobs[j].m, &acts[j], xf, rows, i0, i1, jobs[j].out, jobs[j].ldo, 0);
    }
}

/* gate and up for the same chunk of the intermediate rows, act(gate) * up into h, and that chunk of
   h rounded for the down product (chunks aligned to its blocks): one op, one barrier. */
static void run_ffn(const Model *m, const Layer *L, const Scratch *s, int rows, int threads) {
    const Mat *g = &L->mat[M_GATE], *u = &L->mat[M_UP];
    const long inter = m->inter;
    const int need = L->need[3];
    const long align = need & NEED256 ? 256 : 32;
    long chunk = align > 64 ? align : 64;
    while (chunk > align && inter / chunk < 4L * threads)
        chunk /= 2;
    const long units = (inter + chunk - 1) / chunk;
    const Act ag = act_for(&s->in, g, m->hidden), au = act_for(&s->in, u, m->hidden);
#pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < units; c++) {
        float gt[256 * rows], ut[256 * rows]; /* chunk <= 256; rows <= max_rows (fwd_create): 64 KiB at 32 */
        const long i0 = c * chunk, i1 = i0 + chunk < inter ? i0 + chunk : inter, w = i1 - i0;
        mat_part(g, &ag, s->xn, rows, i0, i1, gt, w, i0);
        mat_part(u, &au, s->xn, rows, i0, i1, ut, w, i0);
        for (int r = 0; r < rows; r++) {
            float *hr = s->h + (long)r * inter;
            for (long i = 0; i < w; i++)
                hr[i0 + i] = activate(gt[r * w + i], m->act) * ut[r * w + i];
            quantize_part(&s->hr, need, hr, inter, r, i0, i1);
        }
    }
}

/* ---------------- set-up ---------------- */

void *fwd_create(int n_layers, int hidden, int heads, int kv_heads, int head_dim, int inter, float eps, int act,
                 float embed_scale, int max_rows) {
    if (n_layers <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 ||
        head_dim % 2 || inter <= 0 || max_rows <= 0 || max_rows > FWD_MAX_ROWS)
        return NULL;
    Model *m = calloc(1, sizeof(Model));
    Layer *layers = calloc((size_t)n_layers, sizeof(Layer));
    if (m == NULL || layers == NULL) {
        free(m);
        free(layers);
        return NULL;
    }
    *m = (Model){.n_layers = n_layers, .hidden = hidden, .heads = heads, .kv_heads = kv_heads,
                 .head_dim = head_dim, .inter = inter, .act = act, .max_rows = max_rows, .eps = eps,
                 .embed_scale = embed_scale, .embed_type = -100, .layers = layers};
    return m;
}

/* The embedding table: a ggml type (its blocks) or MAT_F32 / MAT_BF16 rows; vocab rows of hidden. */
int fwd_set_embed(Model *m, int type, const void *w, long vocab) {
    long rb;
    if (type >= 0) {
        const int block = gguf_block_elems(type);
        if (block == 0)
            return E_TYPE;
        if (m->hidden % block || (r8_base(type) >= 0 && vocab % 8))
            return E_SHAPE;
        rb = m->hidden / block * gguf_block_bytes(type);
    } else if (type == MAT_F32 || type == MAT_BF16)
        rb = (long)m->hidden * (type == MAT_F32 ? 4 : 2);
    else
        return E_TYPE;
    m->embed_type = type, m->embed = w, m->vocab = vocab, m->embed_rb = rb;
    return 0;
}

int fwd_set_mat(Model *m, int layer, int which, int type, int form, const void *w, long n, long k,
                const float *bias) {
    if (layer < 0 || layer >= m->n_layers || which < 0 || which >= N_MATS || w == NULL)
        return E_SHAPE;
    const long qd = (long)m->heads * m->head_dim, kvd = (long)m->kv_heads * m->head_dim;
    const long want_n[N_MATS] = {qd, kvd, kvd, m->hidden, m->inter, m->inter, m->hidden};
    const long want_k[N_MATS] = {m->hidden, m->hidden, m->hidden, qd, m->hidden, m->hidden, m->inter};
    if (n != want_n[which] || k != want_k[which])
        return E_SHAPE;
    Mat t = {.type = type, .form = form, .w = w, .n = n, .k = k, .bias = bias};
    if (type >= 0) {
        const int block = gguf_block_elems(type);
        const int base = r8_base(type);
        if (block == 0)
            return E_TYPE;
        if (k % block || (base >= 0 && n % 8))
            return E_SHAPE;
        if (form < 0 || form > gguf_form_best() || (base >= 0 && form == FORM_PORTABLE))
            return E_FORM;
        t.nb = k / block, t.rb = t.nb * gguf_block_bytes(type), t.kern = base >= 0 ? NULL : kernel_for(type, form);
        t.offset = form == FORM_PORTABLE ? 0 : act_offset(type, form);
    } else if (type == MAT_F32 || type == MAT_BF16)
        t.rb = k * (type == MAT_F32 ? 4 : 2);
    else
        return E_TYPE;
    m->layers[layer].mat[which] = t;
    return 0;
}

/* A norm's float32 scales (Gemma's 1 + w already added); layer -1, which 0: the final norm. */
int fwd_set_norm(Model *m, int layer, int which, const float *w) {
    if (layer == -1 && which == 0) {
        m->final_norm = w;
        return 0;
    }
    if (layer < 0 || layer >= m->n_layers || which < 0 || which >= N_NORMS)
        return E_SHAPE;
    m->layers[layer].norm[which] = w;
    return 0;
}

/* A layer's rotary (inv_freq [head_dim / 2], float32, and the cos/sin scaling), its sliding window
   (0: none) and its attention scale. Layers passing the same inv_freq share one cos/sin table. */
int fwd_set_attention(Model *m, int layer, const float *inv_freq, float scaling, long window, float scale) {
    if (layer < 0 || layer >= m->n_layers || inv_freq == NULL || window < 0)
        return E_SHAPE;
    int r = 0;
    while (r < m->n_ropes && !(m->inv_freq[r] == inv_freq && m->rope_scaling[r] == scaling))
        r++;
    if (r == m->n_ropes) {
        if (r == MAX_ROPES)
            return E_SHAPE;
        m->inv_freq[r] = inv_freq, m->rope_scaling[r] = scaling, m->n_ropes++;
    }
    Layer *L = &m->layers[layer];
    L->rope = r, L->window = window, L->scale = scale;
    return 0;
}

static void rounded_free(Rounded *r) {
    void *all[] = {r->q32, r->q256, r->d32, r->d256, r->s32, r->s256, r->c[0], r->c[1], r->c[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
}

static int rounded_alloc(Rounded *r, long values) {
    r->q32 = malloc(values), r->q256 = malloc(values), r->d32 = malloc(values / 32 * 4);
    r->d256 = malloc(values / 32 * 4), r->s32 = malloc(values / 16 * 2), r->s256 = malloc(values / 16 * 2);
    for (int o = 0; o < 3; o++)
        r->c[o] = malloc(values / 32 * 4);
    void *all[] = {r->q32, r->q256, r->d32, r->d256, r->s32, r->s256, r->c[0], r->c[1], r->c[2]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i] == NULL)
            return E_MEMORY;
    return 0;
}

static void scratch_free(Scratch *s) {
    void *all[] = {s->x, s->xn, s->o, s->q, s->k, s->v, s->att, s->h, s->cos, s->sin, s->scores, s->at};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
    rounded_free(&s->in);
    rounded_free(&s->hr);
    memset(s, 0, sizeof *s);
}

static int scratch_alloc(const Model *m, Scratch *s) {
    const long R = m->max_rows, H = m->hidden, qd = (long)m->heads * m->head_dim;
    const long kvd = (long)m->kv_heads * m->head_dim, rot = (long)MAX_ROPES * R * m->head_dim / 2;
    memset(s, 0, sizeof *s);
    s->x = malloc(R * H * 4), s->xn = malloc(R * H * 4), s->o = malloc(R * H * 4);
    s->q = malloc(R * qd * 4), s->att = malloc(R * qd * 4), s->k = malloc(R * kvd * 4), s->v = malloc(R * kvd * 4);
    s->h = malloc(R * m->inter * 4), s->cos = malloc(rot * 4), s->sin = malloc(rot * 4);
    int rc = rounded_alloc(&s->in, R * m->maxk) | rounded_alloc(&s->hr, R * m->inter);
    void *all[] = {s->x, s->xn, s->o, s->q, s->k, s->v, s->att, s->h, s->cos, s->sin};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        rc |= all[i] == NULL ? E_MEMORY : 0;
    if (rc) {
        scratch_free(s);
        return E_MEMORY;
    }
    return 0;
}

/* Room in scratch for `len` positions per thread for `threads` threads. */
static int scratch_positions(Scratch *s, long len, int threads) {
    if (len <= s->scores_len && threads <= s->threads)
        return 0;
    len = len > s->scores_len ? len + len / 2 + 64 : s->scores_len;
    threads = threads > s->threads ? threads : s->threads;
    free(s->scores);
    free(s->at);
    s->scores = malloc((size_t)len * threads * ATTEND_GROUP * sizeof(float)); /* attend_row_heads' n buffers */
    s->at = malloc((size_t)len * threads * sizeof(long));
    s->scores_len = s->scores && s->at ? len : 0;
    s->threads = s->scores && s->at ? threads : 0;
    return s->scores && s->at ? 0 : E_MEMORY;
}

/* Checks that every weight is set and sizes the scratch. 0, E_SETUP or E_MEMORY. */
int fwd_ready(Model *m) {
    if (m->embed_type == -100 || m->final_norm == NULL || m->n_ropes == 0)
        return E_SETUP;
    m->maxk = m->hidden > m->inter ? m->hidden : m->inter;
    const long qd = (long)m->heads * m->head_dim;
    m->maxk = qd > m->maxk ? qd : m->maxk;
    for (int l = 0; l < m->n_layers; l++) {
        Layer *L = &m->layers[l];
        for (int j = 0; j < N_MATS; j++)
            if (L->mat[j].w == NULL)
                return E_SETUP;
        if (L->norm[N_ATTN_IN] == NULL || L->norm[N_FFN_IN] == NULL || (L->norm[N_QNORM] == NULL) != (L->norm[N_KNORM] == NULL))
            return E_SETUP;
        L->need[0] = need_of(&L->mat[M_Q]) | need_of(&L->mat[M_K]) | need_of(&L->mat[M_V]);
        L->need[1] = need_of(&L->mat[M_O]);
        L->need[2] = need_of(&L->mat[M_GATE]) | need_of(&L->mat[M_UP]);
        L->need[3] = need_of(&L->mat[M_DOWN]);
    }
    if (m->s.x == NULL && scratch_alloc(m, &m->s))
        return E_MEMORY;
    m->ready = 1;
    return 0;
}

void fwd_free(Model *m) {
    if (m == NULL)
        return;
    scratch_free(&m->s);
    free(m->layers);
    free(m);
}

/* ---------------- the step ---------------- */

typedef struct {
    const Model *m;
    const Scratch *s;
    int rows, threads, dt, block;
    const long *pos, *slots, *tables, *lens;
    long width;
    void *const *kv;
} Step;

/* Row r's input norm for layer l (or the final norm past the last layer), rounded for QKV. */
static void next_input(const Step *st, int l, int r) {
    const Model *m = st->m;
    const Scratch *s = st->s;
    const long H = m->hidden;
    if (l == m->n_layers) {
        rmsnorm(s->x + r * H, m->final_norm, H, m->eps, s->xn + r * H);
        return;
    }
    rmsnorm(s->x + r * H, m->layers[l].norm[N_ATTN_IN], H, m->eps, s->xn + r * H);
    quantize_part(&s->in, m->layers[l].need[0], s->xn + r * H, H, r, 0, H);
}

static void layer_step(const Step *st, int l) {
    const Model *m = st->m;
    const Layer *L = &m->layers[l];
    const Scratch *s = st->s;
    const int R = st->rows, T = st->threads, D = m->head_dim, NH = m->heads, KVH = m->kv_heads;
    const long H = m->hidden, qd = (long)NH * D, kvd = (long)KVH * D;
    void *kc = st->kv[2 * l], *vc = st->kv[2 * l + 1];

    const Job qkv[3] = {{&L->mat[M_Q], s->q, qd}, {&L->mat[M_K], s->k, kvd}, {&L->mat[M_V], s->v, kvd}};
    run_jobs(&s->in, qkv, 3, s->xn, H, R, T);

    /* QK-norm and RoPE per head; the new K and V into the pool. */
    const int per = NH + 2 * KVH;
#pragma omp for schedule(static)
    for (int u = 0; u < R * per; u++) {
        const int r = u / per, e = u % per;
        const float *c = s->cos + ((long)L->rope * m->max_rows + r) * (D / 2);
        const float *sn = s->sin + ((long)L->rope * m->max_rows + r) * (D / 2);
        if (e < NH + KVH) {
            float *x = e < NH ? s->q + (long)r * qd + (long)e * D : s->k + (long)r * kvd + (long)(e - NH) * D;
            const float *w = L->norm[e < NH ? N_QNORM : N_KNORM];
            if (w != NULL)
                rmsnorm(x, w, D, m->eps, x);
            rope(x, c, sn, D);
            if (e >= NH)
                store_kv(kc, (st->slots[r] * KVH + (e - NH)) * D, x, D, st->dt);
        } else
            store_kv(vc, (st->slots[r] * KVH + (e - NH - KVH)) * D, s->v + (long)r * kvd + (long)(e - NH - KVH) * D,
                     D, st->dt);
    }

    const int group = NH / KVH, hpu = heads_per_unit(R, KVH, group, T), units = (group + hpu - 1) / hpu;
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < R * KVH * units; u++) {
        const int r = u / (KVH * units), h = (u % (KVH * units)) / units * group + u % units * hpu, tid = TID();
        const int n = group - (h % group) < hpu ? group - (h % group) : hpu;
        attend_row_heads(s->q + (long)r * qd + (long)h * D, kc, vc, st->dt, st->tables + (long)r * st->width,
                         st->lens[r], st->block, L->window, kvd, h, n, group, D, L->scale,
                         s->at + (long)tid * s->scores_len, s->scores + (long)tid * ATTEND_GROUP * s->scores_len,
                         s->scores_len, s->att + (long)r * qd + (long)h * D);
    }

#pragma omp for schedule(static)
    for (int r = 0; r < R; r++)
        quantize_part(&s->in, L->need[1], s->att + r * qd, qd, r, 0, qd);

    const Job o = {&L->mat[M_O], s->o, H};
    run_jobs(&s->in, &o, 1, s->att, qd, R, T);

#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        float *y = s->o + r * H, *x = s->x + r * H;
        if (L->norm[N_ATTN_OUT] != NULL)
            rmsnorm(y, L->norm[N_ATTN_OUT], H, m->eps, y);
        for (long i = 0; i < H; i++)
            x[i] += y[i];
        rmsnorm(x, L->norm[N_FFN_IN], H, m->eps, s->xn + r * H);
        quantize_part(&s->in, L->need[2], s->xn + r * H, H, r, 0, H);
    }

    run_ffn(m, L, s, R, T);

    const Job down = {&L->mat[M_DOWN], s->o, H};
    run_jobs(&s->hr, &down, 1, s->h, m->inter, R, T);

#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        float *y = s->o + r * H, *x = s->x + r * H;
        if (L->norm[N_FFN_OUT] != NULL)
            rmsnorm(y, L->norm[N_FFN_OUT], H, m->eps, y);
        for (long i = 0; i < H; i++)
            x[i] += y[i];
        next_input(st, l + 1, r);
    }
}

/* One decode step of `rows` rows (one token each, row r its sequence's newest): ids [rows] (or x_in
   [rows, hidden], already embedded, when not NULL), pos [rows], slots [rows] (where the new K/V go:
   flat slots of the pools), tables [rows, width] (each row's blocks), lens [rows] (context
   lengths, the new token included). kv: 2 * n_layers pool pointers (K, V of layer 0, ...), each
   [kv_blocks, block, kv_heads, head_dim] of dtype kv_dtype. out [rows, hidden] float32: the last
   layer's output after the final norm. Returns 0, or E_SHAPE / E_INDEX (an index out of range:
   nothing is written then), E_SETUP, E_MEMORY. */
int fwd_step(Model *m, int rows, const long *ids, const float *x_in, const long *pos, const long *slots,
             const long *tables, long width, const long *lens, void *const *kv, int kv_dtype, long kv_blocks,
             int block, int threads, float *out) {
    if (!m->ready)
        return E_SETUP;
    if (rows <= 0 || rows > m->max_rows || width <= 0 || block <= 0 || kv_blocks <= 0 || kv_dtype < 0 || kv_dtype > 2)
        return E_SHAPE;
    long most;
    if (check_tables(rows, lens, tables, width, block, kv_blocks, &most))
        return E_INDEX;
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= kv_blocks * block || pos[r] < 0)
            return E_INDEX;
        if (x_in == NULL && (ids[r] < 0 || ids[r] >= m->vocab))
            return E_INDEX;
    }
    for (int l = 0; l < 2 * m->n_layers; l++)
        if (kv[l] == NULL)
            return E_SHAPE;
    threads = threads > 0 ? threads : 1;
    Scratch own, *s = &m->s;
    const int shared = !__atomic_exchange_n(&m->busy, 1, __ATOMIC_ACQUIRE);
    if (!shared) { /* another thread runs a step on this model: scratch of this call's own */
        s = &own;
        if (scratch_alloc(m, s))
            return E_MEMORY;
    }
    int rc = scratch_positions(s, most, threads);
    if (rc == 0) {
        const Step st = {m, s, rows, threads, kv_dtype, block, pos, slots, tables, lens, width, kv};
        const long H = m->hidden;
        const int half = m->head_dim / 2;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
#pragma omp for schedule(static)
            for (int u = 0; u < rows * (1 + m->n_ropes); u++) {
                const int r = u % rows, which = u / rows;
                if (which == 0) {
                    float *x = s->x + r * H;
                    if (x_in != NULL)
                        memcpy(x, x_in + r * H, (size_t)H * sizeof(float));
                    else if (m->embed_type >= 0)
                        read_row(m->embed_type, m->embed, m->embed_rb, ids[r], H / gguf_block_elems(m->embed_type), x);
                    else if (m->embed_type == MAT_F32)
                        memcpy(x, m->embed + ids[r] * m->embed_rb, (size_t)H * sizeof(float));
                    else
                        for (long i = 0; i < H; i++)
                            x[i] = bf16_f32(((const uint16_t *)(m->embed + ids[r] * m->embed_rb))[i]);
                    if (x_in == NULL && m->embed_scale != 0.0f)
                        for (long i = 0; i < H; i++)
                            x[i] *= m->embed_scale;
                } else { /* cos / sin of rotary which - 1 at this row's position, as Rotary.cos_sin */
                    const int k = which - 1;
                    float *c = s->cos + ((long)k * m->max_rows + r) * half, *sn = s->sin + ((long)k * m->max_rows + r) * half;
                    for (int i = 0; i < half; i++) {
                        const float f = (float)pos[r] * m->inv_freq[k][i];
                        c[i] = cosf(f) * m->rope_scaling[k];
                        sn[i] = sinf(f) * m->rope_scaling[k];
                    }
                }
            }
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++)
                next_input(&st, 0, r);
            for (int l = 0; l < m->n_layers; l++)
                layer_step(&st, l);
        }
        memcpy(out, s->xn, (size_t)rows * H * sizeof(float));
    }
    if (shared)
        __atomic_store_n(&m->busy, 0, __ATOMIC_RELEASE);
    else
        scratch_free(s);
    return rc;
}

/* Test hook: float to the pool's 16-bit dtypes as the step writes them (1: bfloat16, 2: float16). */
void fwd_round16(const float *x, long n, int dt, uint16_t *out) {
    for (long i = 0; i < n; i++)
        out[i] = dt == KV_BF16 ? f32_bf16(x[i]) : f32_f16(x[i]);
}


/* Paged attention for decode rows outside the fused step: the rows of a step the eager forward takes (a step with
   prefill chunks in it, or past max_rows), through the fused step's own attend_row_heads, so that a decode row's
   attention is computed alike in either. q [rows, heads, dim] and out [rows, heads, dim] float32; kc/vc the layer's pools
   [blocks, block, kv_heads, dim] of kv_dtype; tables [rows, width]; lens [rows] (the context, the row's own new
   K/V written already); window 0 for full attention. Why: the torch form gathers every row's context out of the
   pool (one copy a row and layer) and runs bf16 matmuls on it; with 64 beams at ~1,000 tokens of context that was
   21 of the 79 s of `asyncpage bench --workload extract --copy-fields auto`'s 16 records. */
int fwd_attend_rows(const float *q, int rows, int heads, int kv_heads, int dim, const void *kc, const void *vc,
                    int kv_dtype, long kv_blocks, const long *tables, long width, const long *lens, long block,
                    long window, float scale, int threads, float *out) {
    if (rows <= 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || dim <= 0 || width <= 0 || block <= 0
        || kv_blocks <= 0 || kv_dtype < 0 || kv_dtype > 2 || window < 0)
        return E_SHAPE;
    long most;
    if (check_tables(rows, lens, tables, width, block, kv_blocks, &most))
        return E_INDEX;
    threads = threads > 0 ? threads : 1;
    const long kvd = (long)kv_heads * dim;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scores = malloc((size_t)most * sizeof(float));
        long *at = malloc((size_t)most * sizeof(long));
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < (long)rows * heads; u++) {
            if (scores == NULL || at == NULL) {
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
                continue;
            }
            const int r = (int)(u / heads), h = (int)(u % heads);
            attend_row_heads(q + ((long)r * heads + h) * dim, kc, vc, kv_dtype, tables + (long)r * width, lens[r],
                             block, window, kvd, h, 1, heads / kv_heads, dim, scale, at, scores, 0,
                             out + ((long)r * heads + h) * dim);
        }
        free(scores);
        free(at);
    }
    return failed ? E_MEMORY : 0;
}
