/* Native CPU kernels for decode steps (asyncpage/native.py builds and loads them): attention
   (attend_rows_f32, for the compiled steps) and the quantized linears (linear_q8, linear_q4).

   Why hand-written, attention: at a few decode rows the work of attention is microseconds, and what torch
   spends around it is not. One row's attention over its slice of the pool took ~110 us a layer as a
   dozen torch ops around scaled_dot_product_attention (2 ms of a ~20 ms step, measured by replacing
   it with a no-op); the gathering path for other block tables (a shared prefix's blocks, several
   rows) more. Here each is one call. Plain C, auto-vectorized (-O3 -march=native): no torch
   headers, so it builds in about a second with the C compiler torch.compile already needs. */

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Decode rows (one query token each) attending to their sequences' blocks in the pool, in place:
   no gather, no mask. q [rows, H, D]; k, v [rows, KVH, D]: each row's new token, written first to
   its slot (slots[r], a flat slot of the pools [slots, KVH, D]). Row r's context is its first
   lens[r] positions; position t lives in block tables[r * width + t / block] at t % block. With
   window > 0 a row sees its last `window` positions. out [rows, H, D]. Query head h reads KV head
   h / (H / KVH) (grouped-query attention). Returns 0, or -1 if its scratch could not be allocated
   (out is then not written). */
int attend_rows_f32(const float *q, const float *k, const float *v, float *k_cache, float *v_cache,
                    const long *tables, long width, const long *lens, const long *slots, long window,
                    int rows, int heads, int kv_heads, int dim, int block, float scale, float *out) {
    const long row = (long)kv_heads * dim;
    const int group = heads / kv_heads;
    for (int r = 0; r < rows; r++) {
        memcpy(k_cache + slots[r] * row, k + r * row, (size_t)row * sizeof(float));
        memcpy(v_cache + slots[r] * row, v + r * row, (size_t)row * sizeof(float));
    }
    long most = 0;
    for (int r = 0; r < rows; r++)
        most = lens[r] > most ? lens[r] : most;
    float *scores = malloc((size_t)(most > 0 ? most : 1) * sizeof(float));
    long *at = malloc((size_t)(most > 0 ? most : 1) * sizeof(long));
    if (scores == NULL || at == NULL) {
        free(scores);
        free(at);
        return -1;
    }
    for (int r = 0; r < rows; r++) {
        const long ctx = lens[r];
        const long first = window > 0 && ctx > window ? ctx - window : 0;
        const long len = ctx - first;
        const long *table = tables + r * width;
        for (long t = 0; t < len; t++) /* each position's offset in the pools, once for all heads */
            at[t] = (table[(first + t) / block] * block + (first + t) % block) * row;
        for (int h = 0; h < heads; h++) {
            const float *qh = q + ((long)r * heads + h) * dim;
            const long off = (long)(h / group) * dim;
            float top = -INFINITY;
            for (long t = 0; t < len; t++) {
                const float *kr = k_cache + at[t] + off;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < dim; d++)
                    s += qh[d] * kr[d];
                s *= scale;
                scores[t] = s;
                top = s > top ? s : top;
            }
            float sum = 0.0f;
            for (long t = 0; t < len; t++) {
                scores[t] = expf(scores[t] - top);
                sum += scores[t];
            }
            const float inv = 1.0f / sum;
            float *oh = out + ((long)r * heads + h) * dim;
            for (int d = 0; d < dim; d++)
                oh[d] = 0.0f;
            for (long t = 0; t < len; t++) {
                const float *vr = v_cache + at[t] + off;
                const float p = scores[t] * inv;
#pragma omp simd
                for (int d = 0; d < dim; d++)
                    oh[d] += p * vr[d];
            }
        }
    }
    free(scores);
    free(at);
    return 0;
}

/* ---- int8 weights times activations rounded to int8 (linear_q8) ----

   Why hand-written: at a decode step's few rows a projection is a matrix-vector product, bound by
   the bytes of its weight. torch's `_weight_int8pack_mm` widens every weight byte to bfloat16 and
   ran at 5.5-6 GB/s a core here (10-12 GB/s on two): compute-bound, at half what the memory gives.
   Rounding the activations to int8 as well, in blocks of 32 with a scale each (llama.cpp's Q8_0,
   what its CPU dot products take), makes each 64 weight bytes one integer dot-product instruction,
   and prefetching the next rows' weights keeps both cores' loads in flight: the default model's 72
   layer projections ran 2.8-3.3 ms against 8-10 ms with the weights in L3, 5.6 against 9.0-9.2 ms
   from memory (100 MB, 2 threads).

   x [rows, k] float32; w [n, k] int8 (per-output-channel scale[n]); out [rows, n] float32.
   Rows are independent (each is rounded on its own), so a row's output never depends on the
   others in its call. A row holding a NaN or infinity gives NaN throughout. Threads: OpenMP over
   output channels, in the runtime torch loaded (the same libgomp, so the same pool of threads).
   linear_q8_granule(): the k this build takes a multiple of (0: no integer dot product here). */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q8_GRANULE 64
#elif defined(__AVX2__)
#include <immintrin.h>
#define Q8_GRANULE 32
#else
#define Q8_GRANULE 0
#endif

int linear_q8_granule(void) { return Q8_GRANULE; }

#if Q8_GRANULE
/* Row r's blocks of 32 rounded to int8 with scale max|x| / 127: xq [rows, k]. In a row whose largest
   |x| passes 2^64 the scales are kept divided by a power of two (bs [rows, k/32]), and unit[r]
   multiplies it back once per output: so a block's integer sum (up to 4 * 127 * 127 a lane) times its scale
   overflows nowhere unless the true result does (at |x| ~ 1e36 it did, and opposite lanes gave
   inf - inf). unit[r] is NaN for a row holding a NaN or infinity (its outputs are then NaN).
   sums (NULL for linear_q8): bs[b] * sum(xq in b), what linear_q4's minimums multiply. */
static void quantize_rows(const float *x, long k, int rows, signed char *xq, float *bs, float *unit, float *sums) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * k;
        float top = 0.0f;
        int finite = 1;
        for (long d = 0; d < k; d++) {
            const float a = fabsf(xr[d]);
            top = a > top ? a : top;
            finite &= a <= FLT_MAX; /* NaN and infinity: a max alone would skip a NaN */
        }
        /* Only rows past 2^64 shift (by their exponent beyond it): a shift of every row would push a
           small block of a huge row's into subnormal scales, and lose it where the rest cancels. */
        const int e = top > 0x1p64f && finite ? ilogbf(top) - 64 : 0;
        unit[r] = finite ? ldexpf(1.0f, e) : NAN;
        for (long b = 0; b < k / 32; b++) {
            float amax = 0.0f;
            for (int d = 0; d < 32; d++) {
                const float a = fabsf(xr[b * 32 + d]);
                amax = a > amax ? a : amax;
            }
            if (!finite)
                amax = 0.0f; /* the row's output is NaN (unit[r]); its integers need only be defined */
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            if (inv > FLT_MAX) /* a block below ~4e-37: rounds to zeros (127 / amax would overflow) */
                inv = amax = 0.0f;
            int sum = 0;
            for (int d = 0; d < 32; d++) {
                const int q = (int)lrintf(xr[b * 32 + d] * inv);
                xq[(long)r * k + b * 32 + d] = (signed char)q;
                sum += q;
            }
            bs[(long)r * (k / 32) + b] = ldexpf(amax / 127.0f, -e);
            if (sums != NULL)
                sums[(long)r * (k / 32) + b] = bs[(long)r * (k / 32) + b] * (float)sum;
        }
    }
}

#endif

#if Q8_GRANULE
/* One call's activations rounded (quantize_rows), and for AVX-512 each 64 bytes' scales laid out as
   its 16 int32 sums fall (8 lanes per block). sums only where asked (linear_q4). */
typedef struct {
    signed char *xq;
    float *bs, *unit, *sums, *lanes;
} Rounded;

static void rounded_free(Rounded *a) {
    free(a->xq);
    free(a->bs);
    free(a->unit);
    free(a->sums);
    free(a->lanes);
}

/* 0, or -1 when out of memory (nothing is left allocated). */
static int round_activations(const float *x, long k, int rows, int with_sums, Rounded *a) {
    a->xq = malloc((size_t)rows * k);
    a->bs = malloc((size_t)rows * (k / 32) * sizeof(float));
    a->unit = malloc((size_t)rows * sizeof(float));
    a->sums = with_sums ? malloc((size_t)rows * (k / 32) * sizeof(float)) : NULL;
    a->lanes = Q8_GRANULE == 64 ? malloc((size_t)rows * (k / 4) * sizeof(float)) : NULL;
    if (a->xq == NULL || a->bs == NULL || a->unit == NULL || (with_sums && a->sums == NULL) ||
        (Q8_GRANULE == 64 && a->lanes == NULL)) {
        rounded_free(a);
        return -1;
    }
    quantize_rows(x, k, rows, a->xq, a->bs, a->unit, a->sums);
    if (a->lanes != NULL)
        for (long i = 0; i < (long)rows * (k / 4); i++)
            a->lanes[i] = a->bs[i / 8];
    return 0;
}
#endif

#if Q8_GRANULE == 64
/* Dot products of four weight rows (w[j] for j < 4; a short group repeats its last row) with one
   rounded activation row, per 64 bytes: the weights flipped to unsigned (w ^ 0x80 = w + 128) for
   vpdpbusd, which starts each lane from -128 * (its four x), so the int32 sums are exactly w . x;
   each lane's sum times its block's scale. `ahead`: rows to prefetch. */
static void dot4_q8(const signed char *const w[4], const signed char *ahead, long k, const signed char *xq,
                    const float *lanes, float dots[4]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long c = 0; c < k; c += 64) {
        if (ahead != NULL)
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(ahead + j * k + c), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + c));
        const __m512 sv = _mm512_loadu_ps(lanes + c / 4);
        const __m512i base = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, xv)); /* -128 * x */
#define Q8_LANE(acc, row)                                                                               \
    acc = _mm512_fmadd_ps(                                                                              \
        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(                                                         \
            base, _mm512_xor_si512(_mm512_loadu_si512((const void *)(row + c)), flip), xv)), sv, acc)
        Q8_LANE(a0, w[0]);
        Q8_LANE(a1, w[1]);
        Q8_LANE(a2, w[2]);
        Q8_LANE(a3, w[3]);
#undef Q8_LANE
    }
    dots[0] = _mm512_reduce_add_ps(a0);
    dots[1] = _mm512_reduce_add_ps(a1);
    dots[2] = _mm512_reduce_add_ps(a2);
    dots[3] = _mm512_reduce_add_ps(a3);
}
#elif Q8_GRANULE == 32
static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The AVX2 form (llama.cpp's): |w| unsigned times x carrying w's sign, pairs summed to int16
   (at most 2 * 128 * 127: no saturation), then to int32; one scale per 32 bytes. |w| read as
   unsigned holds w = -128 (as 128); x is never -128. */
static void dot4_q8(const signed char *const w[4], const signed char *ahead, long k, const signed char *xq,
                    const float *bs, float dots[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long c = 0; c < k; c += 32) {
        if (ahead != NULL)
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(ahead + j * k + c), _MM_HINT_T0);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + c));
        const __m256 sv = _mm256_set1_ps(bs[c / 32]);
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w[j] + c));
            const __m256i p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
            a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sv, a[j]);
        }
    }
    for (int j = 0; j < 4; j++)
        dots[j] = hsum256(a[j]);
}
#endif

/* Returns 0; -1 if its scratch could not be allocated, -2 if this build cannot (granule 0, or k
   not a multiple of it): out is then not written. */
int linear_q8(const float *x, const signed char *w, const float *scale, long n, long k, int rows, int threads,
              float *out) {
#if Q8_GRANULE
    (void)threads; /* read by OpenMP's clause only: unused in a serial build */
    if (k <= 0 || k % Q8_GRANULE != 0 || rows <= 0)
        return -2;
    Rounded a;
    if (round_activations(x, k, rows, 0, &a) != 0)
        return -1;
    const long groups = (n + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long g = 0; g < groups; g++) {
        const long i = g * 4, m = n - i < 4 ? n - i : 4;
        const signed char *rows4[4];
        for (int j = 0; j < 4; j++)
            rows4[j] = w + (i + (j < m ? j : m - 1)) * k;
        /* the next group's rows, while this one's are summed (none past the weight's end) */
        const signed char *ahead = i + 8 <= n ? w + (i + 4) * k : NULL;
        for (int r = 0; r < rows; r++) {
            float dots[4];
            const signed char *xr = a.xq + (long)r * k;
#if Q8_GRANULE == 64
            dot4_q8(rows4, r == 0 ? ahead : NULL, k, xr, a.lanes + (long)r * (k / 4), dots);
            for (long j = 0; j < m; j++)
                out[(long)r * n + i + j] = scale[i + j] * dots[j] * a.unit[r];
#else
            dot4_q8(rows4, r == 0 ? ahead : NULL, k, xr, a.bs + (long)r * (k / 32), dots);
            for (long j = 0; j < m; j++)
                out[(long)r * n + i + j] = scale[i + j] * dots[j] * a.unit[r];
#endif
        }
    }
    rounded_free(&a);
    return 0;
#else
    (void)x, (void)w, (void)scale, (void)n, (void)k, (void)rows, (void)threads, (void)out;
    return -2;
#endif
}

/* ---- int4 weights in groups of 32 times activations rounded to int8 (linear_q4) ----

   The GGUF's Q4_K weights as they are (w = q * scale + minimum per group of 32, q in 0..15): half
   the bytes of int8. torch's `_weight_int4pack_mm_for_cpu` took 4.3 ms for 72 projections of the
   default model's shapes at one row, from memory; this takes 3.4 ms. As in linear_q8, the activations
   are rounded to int8 in blocks of 32 (one per weight group). Each group's integer dot product is
   one vpdpbusd (q unsigned, x signed: no offset), times the group's scale; the minimums multiply each
   block's sum. A scale and a minimum per group of weights, bfloat16.

   w [n, k / 2] bytes: each 128 weights of a channel are 64 bytes, byte j holding weight j in its low
   nibble and weight 64 + j in its high one (so one 64-byte load splits into two runs of 64 weights);
   scale, minimum [n, k / 32] bfloat16 bits. k: a multiple of 128. Otherwise as linear_q8. */

#if Q8_GRANULE
static inline __m128 bf16x4(const unsigned short *p) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)p)), 16));
}

static inline float hsum128(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
#endif

#if Q8_GRANULE == 64
/* Four channels (a short group repeats its last) against one rounded row: per 128 weights, two
   vpdpbusd of 64 each; their 16 int32 sums are 8 per group, scaled by the group's weight scale
   (spread over its 8 lanes) times the row's block scale (`lanes`, as linear_q8's). */
static void dot4_q4(const unsigned char *const w[4], const unsigned short *const sc[4],
                    const unsigned short *const mn[4], const unsigned char *ahead, long k, const signed char *xq,
                    const float *lanes, const float *sums, float dots[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 m[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (long c = 0; c < k; c += 128) {
        if (ahead != NULL)
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(ahead + j * (k / 2) + c / 2), _MM_HINT_T0);
        const __m512i xa = _mm512_loadu_si512((const void *)(xq + c));
        const __m512i xb = _mm512_loadu_si512((const void *)(xq + c + 64));
        const __m512 la = _mm512_loadu_ps(lanes + c / 4), lb = _mm512_loadu_ps(lanes + c / 4 + 16);
        const __m128 s4 = _mm_loadu_ps(sums + c / 32);
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(w[j] + c / 2));
            const __m512i qa = _mm512_and_si512(v, low), qb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512 sw = _mm512_castps128_ps512(bf16x4(sc[j] + c / 32));
            const __m512 da = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, qa, xa));
            const __m512 db = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, qb, xb));
            a[j] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_permutexvar_ps(first, sw), la), a[j]);
            a[j] = _mm512_fmadd_ps(db, _mm512_mul_ps(_mm512_permutexvar_ps(second, sw), lb), a[j]);
            m[j] = _mm_fmadd_ps(bf16x4(mn[j] + c / 32), s4, m[j]);
        }
    }
    for (int j = 0; j < 4; j++)
        dots[j] = _mm512_reduce_add_ps(a[j]) + hsum128(m[j]);
}
#elif Q8_GRANULE == 32
/* The AVX2 form: per group of 32, |q| is already unsigned (0..15), so maddubs takes q and x as
   they are (pairs at most 2 * 15 * 127: no saturation). */
static void dot4_q4(const unsigned char *const w[4], const unsigned short *const sc[4],
                    const unsigned short *const mn[4], const unsigned char *ahead, long k, const signed char *xq,
                    const float *bs, const float *sums, float dots[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 m[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (long c = 0; c < k; c += 128) {
        if (ahead != NULL)
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(ahead + j * (k / 2) + c / 2), _MM_HINT_T0);
        const long g = c / 32; /* groups g, g + 1 (low nibbles of the two halves), g + 2, g + 3 (high) */
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + c));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + c + 32));
        const __m256i x2 = _mm256_loadu_si256((const __m256i *)(xq + c + 64));
        const __m256i x3 = _mm256_loadu_si256((const __m256i *)(xq + c + 96));
        const __m128 s4 = _mm_loadu_ps(sums + g), b4 = _mm_loadu_ps(bs + g);
        for (int j = 0; j < 4; j++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w[j] + c / 2));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w[j] + c / 2 + 32));
            float f[4];
            _mm_storeu_ps(f, _mm_mul_ps(bf16x4(sc[j] + g), b4));
#define Q4_GROUP(q, x, scale)                                                                           \
    a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones)),   \
                           _mm256_set1_ps(scale), a[j])
            Q4_GROUP(_mm256_and_si256(v0, low), x0, f[0]);
            Q4_GROUP(_mm256_and_si256(v1, low), x1, f[1]);
            Q4_GROUP(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), x2, f[2]);
            Q4_GROUP(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), x3, f[3]);
#undef Q4_GROUP
            m[j] = _mm_fmadd_ps(bf16x4(mn[j] + g), s4, m[j]);
        }
    }
    for (int j = 0; j < 4; j++)
        dots[j] = hsum256(a[j]) + hsum128(m[j]);
}
#endif

/* Returns as linear_q8; -2 also where k is not a multiple of 128. */
int linear_q4(const float *x, const unsigned char *w, const unsigned short *scale, const unsigned short *minimum,
              long n, long k, int rows, int threads, float *out) {
#if Q8_GRANULE
    (void)threads; /* read by OpenMP's clause only: unused in a serial build */
    if (k <= 0 || k % 128 != 0 || rows <= 0)
        return -2;
    Rounded a;
    if (round_activations(x, k, rows, 1, &a) != 0)
        return -1;
    const long groups = (n + 3) / 4, half = k / 2, per = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long g = 0; g < groups; g++) {
        const long i = g * 4, m = n - i < 4 ? n - i : 4;
        const unsigned char *w4[4];
        const unsigned short *s4[4], *m4[4];
        for (int j = 0; j < 4; j++) {
            const long row = i + (j < m ? j : m - 1);
            w4[j] = w + row * half;
            s4[j] = scale + row * per;
            m4[j] = minimum + row * per;
        }
        const unsigned char *ahead = i + 8 <= n ? w + (i + 4) * half : NULL;
        for (int r = 0; r < rows; r++) {
            float dots[4];
#if Q8_GRANULE == 64
            dot4_q4(w4, s4, m4, r == 0 ? ahead : NULL, k, a.xq + (long)r * k, a.lanes + (long)r * (k / 4),
                    a.sums + (long)r * per, dots);
#else
            dot4_q4(w4, s4, m4, r == 0 ? ahead : NULL, k, a.xq + (long)r * k, a.bs + (long)r * per,
                    a.sums + (long)r * per, dots);
#endif
            for (long j = 0; j < m; j++)
                out[(long)r * n + i + j] = dots[j] * a.unit[r];
        }
    }
    rounded_free(&a);
    return 0;
#else
    (void)x, (void)w, (void)scale, (void)minimum, (void)n, (void)k, (void)rows, (void)threads, (void)out;
    return -2;
#endif
}
