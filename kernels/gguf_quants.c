/* GGUF quantized blocks, read in place: matrix times activations, and rows dequantized
   (asyncpage/model/native.py builds this file; asyncpage/model/gguf_kernels.py is its Python face).

   Formats (ggml's block layouts, as the file stores them; ggml type numbers):
     Q4_0 (2)  32 elems, 18 B: fp16 d, qs[16]; byte j low nibble = elem j, high = elem j+16; w = d*(q-8)
     Q5_0 (6)  32 elems, 22 B: fp16 d, qh (32 bits, bit j = bit 4 of elem j), qs[16] as Q4_0; w = d*(q-16)
     Q8_0 (8)  32 elems, 34 B: fp16 d, int8 q[32]; w = d*q
     Q4_K (12) 256 elems, 144 B: fp16 d, fp16 dmin, scales[12] (8 six-bit scales, 8 six-bit mins),
               qs[128]; 64-elem chunk c: low nibbles sub-block 2c, high 2c+1; w = d*sc*q - dmin*m
     Q5_K (13) 256 elems, 176 B: as Q4_K with qh[32] before qs: bit j of qh[l] is bit 4 of elem 32j+l
     Q6_K (14) 256 elems, 210 B: ql[128], qh[64], int8 scales[16] (one per 16 elems), fp16 d last;
               w = d*sc*(q-32)

   Why hand-written (figures in gguf_kernels.py's docstring): nothing torch or a maintained library
   ships reads these blocks; torch's int4/int8 weight-only CPU matmuls need their own repacked copy
   (a second copy of the weights, or a lossy requantize for Q5_0/Q6_K/Q8_0) and widen each weight to
   float before multiplying.

   How: each call rounds its activation rows to int8 once, shared by every output row (blocks of 32
   with a float scale for the 32-element formats, blocks of 256 for the K-quants: d = max|x| / 127,
   q = rint(x / d); plus each 16 values' integer sum). The weights are read as unsigned integers (the
   format's offset -8 / -16 / -32 / -dmin*m, and Q8_0's +128 in the VNNI form, come back as the offset
   times the activations' block sums), so every product is u8 x s8 and sums exactly in int32; one float
   multiply-add per block (per 256 for the K-quants). Three forms of the same arithmetic:
     2 VNNI     AVX-512 VNNI, 256-bit (VL) vpdpbusd
     1 AVX2     vpmaddubsw + vpmaddwd (Q8_0 through the sign trick: |w| times x with w's sign)
     0 portable plain C
   gguf_form_best() says which this CPU runs (cpuid); any lower one can be asked for (the tests do).
   Results of the three agree up to float rounding (their integer sums are equal).

   Decode tiles: at one or two activation rows one weight row at a time, read as one stream with a software
   prefetch ahead of it (tile_rows says why); from three, the 32-element formats take 4 weight rows at a time
   (2 with AVX2), one __m256 accumulator per (weight row, activation row), the offsets folded into the int32
   dot; at 5-8 activation rows (VNNI form) two activation rows share each 512-bit register, lane for lane the
   same arithmetic, in one pass over the weights (rows32x2). The K-quants take one weight row, with the same
   prefetch. Past 8 activation rows (VNNI form, every format) the interleaved path: 8 weight rows
   unpacked once into a scratch tile (K-quants: with their sub-block scales and mins as int32 lanes),
   activation values broadcast against it (matmul_ilv; 2.0-4.7x the tiles at 32 rows).

   Threads: OpenMP over chunks of output rows (torch's libgomp, see native.py), taken dynamically.
   Within a chunk, activation rows go four (eight in the VNNI form) at a time: each weight block is unpacked
   once and used for all of them, and a chunk's weight rows (a few KB) stay in L1 while every activation
   tile passes them.

   Where a SIMD form runs, the 32-element formats' rows (Q4_0, Q5_0, Q8_0: the layers' and the LM head's) are
   repacked by eight in place at load (gguf_repack8: the same bytes, each block's 8 scales then its values in
   the interleaved path's order; T_*_R8), and one kernel reads them at every row count with the interleaved
   arithmetic and no unpacking (r8_rows): a verify's 8 rows cost little more than one (LM head [262144, 640]
   Q8_0: 6.5 ms against the tiles' 17; one row 5.0 either way), and an output's bits depend neither on the row
   count nor on the form (VNNI or AVX2). Lookups read the repacked rows too (read_row). The K-quants are read
   as the GGUF stores them (rows are not vector aligned: every load is unaligned; the interleaved path unpacks
   into a per-thread scratch tile of 8 weight rows: 9 bytes per value of k, about 12.4 for the K-quants), and
   so are the 32-element formats in the portable form. A NaN or infinity in
   an activation block gives NaN outputs. */

#ifndef GQ_SECTION /* the common part; the per-form section is at the end */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GQ_X86 1
#else
#define GQ_X86 0
#endif

/* The *_R8 types: no file's; the 32-element formats' rows repacked by eight in place (gguf_repack8), read by the
   VNNI and AVX2 forms (r8_rows). */
enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_Q4_0_R8 = 102, T_Q5_0_R8 = 106,
       T_Q8_0_R8 = 108 };
enum { FORM_PORTABLE = 0, FORM_AVX2 = 1, FORM_VNNI = 2 };
enum { E_MEMORY = -1, E_SHAPE = -2, E_TYPE = -3, E_FORM = -4, E_INDEX = -5 };
/* From this many activation rows every format takes the interleaved path (matmul_ilv, VNNI form):
   past the 8 rows of a decode or speculative-verify step (native_step.MAX_ROWS), so those keep the tile
   kernels' arithmetic whatever their row count and a verify gives the bits one-row steps give. */
#define ILV_ROWS 9
/* Bytes ahead of the block being read that the repacked path prefetches (r8_rows), into L2 (_MM_HINT_T1): a weight
   streamed from memory (the 170 MiB LM head, one row, on 2 MiB pages) took 8.0 ms prefetched into L1 against 6.9
   into L2 on a Xeon VM (likely the L1's few fill buffers held by prefetches far ahead), 9.0 against 8.3 at 4 rows. */
#define R8_AHEAD 8192

/* Elements and bytes per block; 0 for a type this file has no kernel for. */
int gguf_block_elems(int type) {
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_Q4_0_R8: case T_Q5_0_R8: case T_Q8_0_R8: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

int gguf_block_bytes(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_0_R8: return 18;
    case T_Q5_0: case T_Q5_0_R8: return 22;
    case T_Q8_0: case T_Q8_0_R8: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* The file's type of a type repacked by eight (T_Q5_0 for T_Q5_0_R8), or -1 for any other. */
static int r8_base(int type) {
    return type == T_Q4_0_R8 ? T_Q4_0 : type == T_Q5_0_R8 ? T_Q5_0 : type == T_Q8_0_R8 ? T_Q8_0 : -1;
}

/* The weights' offset the SIMD forms read a 32-element format (or its rows repacked by eight) with, which comes
   back through the activations' c: Q4_0's 8, Q5_0's 16, Q8_0's 128 in the VNNI form (its AVX2 form reads signed
   values), else 0. */
static int act_offset(int type, int form) {
    const int base = r8_base(type), plain = base >= 0 ? base : type;
    return plain == T_Q4_0 ? 8 : plain == T_Q5_0 ? 16 : plain == T_Q8_0 && form == FORM_VNNI ? 128 : 0;
}

/* The best form this CPU runs. */
int gguf_form_best(void) {
#if GQ_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return FORM_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return FORM_AVX2;
#endif
    return FORM_PORTABLE;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IEEE half to float, exactly (subnormals, infinities and NaN included). */
static inline float half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0x1f)
        bits = sign | 0x7f800000u | (m << 13);
    else if (e != 0)
        bits = sign | ((e + 112) << 23) | (m << 13);
    else if (m == 0)
        bits = sign;
    else {
        float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 8 six-bit scales and mins of a block's 12 scale bytes. */
static inline void k4_scales(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* One call's activations rounded to int8: q [rows, k]; d [rows, k / block]; s [rows, k / 16], the
   integer sum of each 16 values of q. */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *s;
    int32_t *c; /* blocks of 32 only: -offset * the block's integer sum, [rows, k / 32]: the weights' offset
                   (8 / 16 / Q8_0's 128 in the VNNI form), added to the integer dot so it stays exact */
    long k, nb; /* nb: blocks of activation scale per row */
} Act;

/* One row of k activations rounded to int8 blocks of `block` (q [k], d [k / block], s [k / 16]): what
   every call's activations go through, and the fused decode step's (kernels/cpu_forward.c). */
static void quantize_row(const float *xr, long k, int block, int8_t *q, float *d, int16_t *s) {
    const long nb = k / block;
    for (long b = 0; b < nb; b++) {
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < block; i++) {
            const float v = fabsf(xr[b * block + i]);
            amax = v > amax ? v : amax;
            finite &= v <= 3.4028234663852886e38f; /* false for NaN and infinity */
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        if (!finite || !(inv <= 3.4028234663852886e38f)) /* non-finite, or too small to scale */
            inv = 0.0f;
        d[b] = finite ? amax / 127.0f : NAN;
        for (int i = 0; i < block; i++)
            q[b * block + i] = (int8_t)lrintf(xr[b * block + i] * inv);
    }
    for (long g = 0; g < k / 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++)
            sum += q[g * 16 + i];
        s[g] = (int16_t)sum;
    }
}

/* Act.c of one row for blocks of 32: -offset times each block's integer sum (from its two 16-sums). */
static void block_offsets(const int16_t *s, long nb, int offset, int32_t *c) {
    for (long b = 0; b < nb; b++)
        c[b] = -offset * (s[2 * b] + s[2 * b + 1]);
}

static void quantize_rows(const float *x, long k, int block, int offset, int rows, int threads, Act *a) {
    const long nb = k / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        quantize_row(x + (long)r * k, k, block, a->q + (long)r * k, a->d + (long)r * nb, a->s + (long)r * (k / 16));
        if (block == 32)
            block_offsets(a->s + (long)r * (k / 16), nb, offset, a->c + (long)r * nb);
    }
}

/* A tile kernel: wr weight rows (w, w + rb, ..; nb blocks of its type each; wr = 1, 2 or 4: tile_rows)
   against activation rows r0 .. r0 + nr - 1 (nr <= tile_acts): res[i * nr + j] = dot of weight row i with
   activation row r0 + j. From three activation rows, several weight rows at once give independent
   accumulator chains and share each activation load; at one or two, one row streams faster from memory. */
typedef void (*row_kernel)(const uint8_t *w, long rb, int wr, long nb, const Act *a, int r0, int nr, float *res);

/* ---------------- portable form ---------------- */

static float dot32_c(int type, const uint8_t *w, long nb, const Act *a, int r) {
    const int8_t *xq = a->q + (long)r * a->k;
    const float *xd = a->d + (long)r * a->nb;
    const int16_t *xs = a->s + (long)r * (a->k / 16);
    const int bytes = gguf_block_bytes(type);
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes;
        const int8_t *x = xq + b * 32;
        int sum = 0, off = 0;
        if (type == T_Q8_0) {
            /* Read as int8 through its own pointer: gcc 12 at -O3 -march=native miscompiled the
               form with a cast of each uint8 (as an unsigned-by-signed dot product, vpdpbusd). */
            const int8_t *q = (const int8_t *)(p + 2);
            for (int i = 0; i < 32; i++)
                sum += q[i] * x[i];
        } else {
            const uint32_t qh = type == T_Q5_0 ? rd32(p + 2) : 0;
            const uint8_t *qs = p + (type == T_Q5_0 ? 6 : 2);
            for (int i = 0; i < 16; i++) {
                const int lo = (qs[i] & 15) | (int)(((qh >> i) & 1) << 4);
                const int hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
                sum += lo * x[i] + hi * x[i + 16];
            }
            off = (type == T_Q5_0 ? 16 : 8) * (xs[2 * b] + xs[2 * b + 1]);
        }
        acc += half(rd16(p)) * xd[b] * (float)(sum - off);
    }
    return acc;
}

static float dotk_c(int type, const uint8_t *w, long nb, const Act *a, int r) {
    const int8_t *xq = a->q + (long)r * a->k;
    const float *xd = a->d + (long)r * a->nb;
    const int16_t *xs = a->s + (long)r * (a->k / 16);
    const int bytes = gguf_block_bytes(type);
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes;
        const int8_t *x = xq + b * 256;
        const int16_t *s = xs + b * 16;
        if (type == T_Q6_K) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            int sum = 0, off = 0;
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) /* chunk c of half h: elements 128h + 32c + l */
                    for (int l = 0; l < 32; l++) {
                        const int lo = c & 1 ? ql[64 * h + 32 + l] : ql[64 * h + l];
                        const int q = ((c & 2 ? lo >> 4 : lo & 15) | (((qh[32 * h + l] >> (2 * c)) & 3) << 4));
                        const int e = 128 * h + 32 * c + l;
                        sum += sc[e / 16] * q * x[e];
                    }
            for (int j = 0; j < 16; j++)
                off += sc[j] * s[j];
            acc += half(rd16(p + 208)) * xd[b] * (float)(sum - 32 * off);
        } else {
            int sc[8], mn[8];
            k4_scales(p + 4, sc, mn);
            const uint8_t *qh = p + 16, *qs = p + (type == T_Q5_K ? 48 : 16);
            int sum = 0, msum = 0;
            for (int j = 0; j < 8; j++) {
                int dot = 0;
                for (int l = 0; l < 32; l++) {
                    const uint8_t byte = qs[32 * (j / 2) + l];
                    int q = j & 1 ? byte >> 4 : byte & 15;
                    if (type == T_Q5_K)
                        q |= ((qh[l] >> j) & 1) << 4;
                    dot += q * x[32 * j + l];
                }
                sum += sc[j] * dot;
                msum += mn[j] * (s[2 * j] + s[2 * j + 1]);
            }
            acc += xd[b] * (half(rd16(p)) * (float)sum - half(rd16(p + 2)) * (float)msum);
        }
    }
    return acc;
}

#define PORTABLE(NAME, DOT, TYPE)                                                                  \
    static void NAME(const uint8_t *w, long rb, int wr, long nb, const Act *a, int r0, int nr, float *res) { \
        for (int i = 0; i < wr; i++)                                                               \
            for (int j = 0; j < nr; j++)                                                           \
                res[i * nr + j] = DOT(TYPE, w + i * rb, nb, a, r0 + j);                            \
    }
PORTABLE(k_q4_0_c, dot32_c, T_Q4_0)
PORTABLE(k_q5_0_c, dot32_c, T_Q5_0)
PORTABLE(k_q8_0_c, dot32_c, T_Q8_0)
PORTABLE(k_q4_k_c, dotk_c, T_Q4_K)
PORTABLE(k_q5_k_c, dotk_c, T_Q5_K)
PORTABLE(k_q6_k_c, dotk_c, T_Q6_K)

/* ---------------- the SIMD forms: the section below, compiled once per form ---------------- */

#if GQ_X86
#define GQ_SECTION
#define GQ_FORM 1 /* FORM_AVX2 */
#include "gguf_quants.c" /* this file again: the section below */
#undef GQ_FORM
#define GQ_FORM 2 /* FORM_VNNI */
#include "gguf_quants.c" /* this file again: the section below */
#undef GQ_FORM
#undef GQ_SECTION
#endif

/* Weight rows per tile for nr activation rows. At one or two activation rows a tile is one weight row: the
   rows are read one after another, as one stream from memory with the software prefetch four rows ahead, which
   is what a decode step's weights are (a model's layers and head are far past the L3; each token reads them
   once). Four rows read interleaved (four streams a row apart) held one core to a third of a plain read
   (Q8_0 LM head 178 MB: 8.5 against 20 GB/s); measured on the 24 layers of a Qwen2.5-0.5B-shaped Q4_K_M, each
   call on the next layer's tensor (2-core AMD EPYC VM, 2 threads), ffn_gate Q5_0 4864 x 896 one row 210 ->
   128 us, two rows 212 -> 159 us, ffn_down Q4_K / Q6_K 206 -> 152 us. From three rows the tiles of four
   (VNNI; AVX2: two) weight rows are as fast or faster (their accumulators fill the registers: 32 with
   AVX-512, 16 with AVX2); the K-quants keep one weight row. Every tile width gives each output the same
   bits. */
static int tile_rows(int type, int form, int nr) {
    if (form == FORM_PORTABLE || nr <= 2 || gguf_block_elems(type) != 32)
        return 1;
    return form == FORM_VNNI ? 4 : 2;
}

/* Activation rows per tile: 8 in the VNNI form (rows32x2; the K-quants' rowsk unpacks each block once for 8 rows:
   at a verify's 8 rows Q4_K ffn_down [640, 2048] 166.5 -> 154.5 us, Q6_K 143.3 -> 134.9, scripts/gguf_kernel_bench.py),
   else 4. */
static int tile_acts(int type, int form) {
    return GQ_X86 && form == FORM_VNNI ? 8 : 4;
}

/* Whether a product of `rows` activation rows takes the interleaved path (matmul_ilv). */
static int uses_ilv(int type, int form, int rows) {
    return GQ_X86 && form == FORM_VNNI && rows >= ILV_ROWS;
}

static row_kernel kernel_for(int type, int form) {
#if GQ_X86
    if (form == FORM_VNNI)
        switch (type) {
        case T_Q4_0: return k_q4_0_vnni;
        case T_Q5_0: return k_q5_0_vnni;
        case T_Q8_0: return k_q8_0_vnni;
        case T_Q4_K: return k_q4_k_vnni;
        case T_Q5_K: return k_q5_k_vnni;
        case T_Q6_K: return k_q6_k_vnni;
        }
    if (form == FORM_AVX2)
        switch (type) {
        case T_Q4_0: return k_q4_0_avx2;
        case T_Q5_0: return k_q5_0_avx2;
        case T_Q8_0: return k_q8_0_avx2;
        case T_Q4_K: return k_q4_k_avx2;
        case T_Q5_K: return k_q5_k_avx2;
        case T_Q6_K: return k_q6_k_avx2;
        }
#endif
    switch (type) {
    case T_Q4_0: return k_q4_0_c;
    case T_Q5_0: return k_q5_0_c;
    case T_Q8_0: return k_q8_0_c;
    case T_Q4_K: return k_q4_k_c;
    case T_Q5_K: return k_q5_k_c;
    case T_Q6_K: return k_q6_k_c;
    }
    return NULL;
}

/* Weight rows [i0, i1) (rb bytes, nb blocks each, from w) against activation rows 0..rows-1 through the
   tile kernel `kern`: out[r * ldo + i - col0] (+ bias[i] where bias is given). gguf_matmul's chunks and
   the fused step's matrix parts (cpu_forward.c mat_part) both go through here. */
static void tile_pass(row_kernel kern, int type, int form, const uint8_t *w, long rb, long nb, const Act *a, int rows,
                      long i0, long i1, float *out, long ldo, long col0, const float *bias) {
    float res[32]; /* tile_rows (at most 4) x tile_acts (at most 8) */
    const int ta = tile_acts(type, form);
    for (int r0 = 0; r0 < rows; r0 += ta) {
        const int nr = rows - r0 < ta ? rows - r0 : ta;
        const int tw = tile_rows(type, form, nr);
        for (long i = i0; i < i1;) {
            const int wr = i1 - i >= tw ? tw : i1 - i >= 2 && tw >= 2 ? 2 : 1;
            kern(w + i * rb, rb, wr, nb, a, r0, nr, res);
            for (int t = 0; t < wr; t++)
                for (int j = 0; j < nr; j++)
                    out[(long)(r0 + j) * ldo + i + t - col0] = bias ? res[t * nr + j] + bias[i + t] : res[t * nr + j];
            i += wr;
        }
    }
}

/* A row's maximum so far and its first index (i < 0: nothing seen yet). NaN counts as the maximum (the first
   NaN's index), as torch's max(dim=-1) gives it: what the greedy sampler reads. */
typedef struct {
    float v;
    long i;
} Amax;

/* Whether (v, i) comes before m in that order: a larger value, NaN above all, the smaller index on a tie. Chunks are
   taken in any order (dynamic): the result does not depend on it. */
static inline int amax_before(float v, long i, const Amax *m) {
    if (m->i < 0)
        return 1;
    if (isnan(m->v))
        return isnan(v) && i < m->i;
    return isnan(v) || v > m->v || (v == m->v && i < m->i);
}

/* Each of the rows' maximum over out[r * n + i0 .. i1), merged into m[r]: run by the thread that has just written
   those outputs, while they are in its cache (the same search after the call, over outputs half of which the other
   core wrote, took 0.26 ms of a 262,144-wide row on a 2-core AMD EPYC VM). Sixteen at a time: a block below the
   maximum so far (nearly all) costs one vector maximum. */
static void amax_scan(const float *out, long n, int rows, long i0, long i1, Amax *m) {
    for (int r = 0; r < rows; r++) {
        const float *o = out + (long)r * n;
        Amax *a = &m[r];
        for (long b = i0; b < i1; b += 16) {
            const long e = b + 16 < i1 ? b + 16 : i1;
            if (e - b == 16 && a->i >= 0 && !isnan(a->v)) {
                float bm = o[b];
                int nan = 0;
                for (int j = 0; j < 16; j++) {
                    bm = o[b + j] > bm ? o[b + j] : bm;
                    nan |= o[b + j] != o[b + j];
                }
                if (!nan && bm < a->v)
                    continue;
            }
            for (long x = b; x < e; x++)
                if (amax_before(o[x], x, a)) {
                    a->v = o[x];
                    a->i = x;
                }
        }
    }
}

/* The threads' maxima (thread t's rows at part[t * rows]) merged: each row's maximum and first index. */
static void amax_reduce(const Amax *part, int threads, int rows, float *row_max, long *row_arg) {
    for (int r = 0; r < rows; r++) {
        Amax acc = {0.0f, -1};
        for (int t = 0; t < threads; t++)
            if (part[t * rows + r].i >= 0 && amax_before(part[t * rows + r].v, part[t * rows + r].i, &acc))
                acc = part[t * rows + r];
        row_max[r] = acc.v;
        row_arg[r] = acc.i;
    }
}

static Amax *amax_parts(int threads, int rows) {
    Amax *part = malloc((size_t)threads * rows * sizeof(Amax));
    if (part != NULL)
        for (long j = 0; j < (long)threads * rows; j++)
            part[j] = (Amax){0.0f, -1};
    return part;
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The rounded activations' buffers freed; returns rc. */
static int act_done(Act *a, int rc) {
    free(a->q);
    free(a->d);
    free(a->s);
    free(a->c);
    return rc;
}

/* out [rows, n] = x [rows, k] times w^T, w [n, k / block] blocks of `type` (rows of
   k / block * bytes). form: 0..2 (see above), at most gguf_form_best(). Returns 0, or E_SHAPE (k not a
   positive multiple of the block), E_TYPE, E_FORM, E_MEMORY (nothing written then). */
int gguf_matmul_max(int type, int form, const float *x, const uint8_t *w, long n, long k, int rows, int threads,
                    float *out, float *row_max, long *row_arg);

int gguf_matmul(int type, int form, const float *x, const uint8_t *w, long n, long k, int rows, int threads,
                float *out) {
    return gguf_matmul_max(type, form, x, w, n, k, rows, threads, out, NULL, NULL);
}

/* gguf_matmul, and where row_max is given each output row's maximum and its first index (row_max[r], row_arg[r];
   amax_scan), found as the outputs are written. The interleaved path (ILV_ROWS rows or more in the VNNI form, rows
   not repacked by eight) finds none: row_arg is then -1. */
int gguf_matmul_max(int type, int form, const float *x, const uint8_t *w, long n, long k, int rows, int threads,
                    float *out, float *row_max, long *row_arg) {
    const int block = gguf_block_elems(type);
    if (block == 0)
        return E_TYPE;
    const int base = r8_base(type);
    if (k <= 0 || k % block != 0 || n < 0 || rows < 0 || (base >= 0 && n % 8))
        return E_SHAPE;
    if (form < 0 || form > gguf_form_best() || (base >= 0 && form == FORM_PORTABLE))
        return E_FORM;
    row_kernel kern = kernel_for(type, form);
    if (rows == 0 || n == 0) {
        for (int r = 0; row_arg && r < rows; r++)
            row_arg[r] = -1; /* no outputs: no maximum */
        return 0;
    }
    threads = threads > 0 ? threads : 1;
    Act a = {malloc((size_t)rows * k), malloc((size_t)rows * (k / block) * sizeof(float)),
             malloc((size_t)rows * (k / 16) * sizeof(int16_t)), malloc((size_t)rows * (k / 32) * sizeof(int32_t)),
             k, k / block};
    if (a.q == NULL || a.d == NULL || a.s == NULL || a.c == NULL)
        return act_done(&a, E_MEMORY);
    /* The weights' offset the SIMD forms read them with (the portable form subtracts its own). */
    const int offset = act_offset(type, form);
    quantize_rows(x, k, block, offset, rows, threads, &a);
    const long nb = k / block, row_bytes = nb * gguf_block_bytes(type);
#if GQ_X86
    if (base >= 0) { /* groups of 8 weight rows, a few to a thread at once (the LM head: 32768) */
        const long groups = n / 8;
        long chunk = rows > 8 ? 2 : 64;
        while (chunk > 1 && (groups + chunk - 1) / chunk < 8L * threads)
            chunk /= 2;
        const long chunks = (groups + chunk - 1) / chunk;
        Amax *part = row_max ? amax_parts(threads, rows) : NULL;
        if (row_max && part == NULL)
            return act_done(&a, E_MEMORY);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && chunks > 1)
        for (long c = 0; c < chunks; c++) {
            const long g0 = c * chunk, g1 = g0 + chunk < groups ? g0 + chunk : groups;
            if (form == FORM_VNNI)
                r8_range_vnni(base, w, nb, 8 * g0, 8 * g1, &a, rows, out + 8 * g0, n);
            else
                r8_range_avx2(base, w, nb, 8 * g0, 8 * g1, &a, rows, out + 8 * g0, n);
            if (part)
                amax_scan(out, n, rows, 8 * g0, 8 * g1, part + thread_id() * rows);
        }
        if (part) {
            amax_reduce(part, threads, rows, row_max, row_arg);
            free(part);
        }
        return act_done(&a, 0);
    }
    if (uses_ilv(type, form, rows)) {
        const int rc = matmul_ilv_vnni(type, &a, w, n, row_bytes, rows, threads, out);
        for (int r = 0; row_arg && r < rows; r++)
            row_arg[r] = -1;
        return act_done(&a, rc);
    }
#endif
    /* Chunks of output rows: enough for every thread to take several (dynamic), small enough that a
       chunk's weights stay in L1 while the activation tiles pass (at many rows). */
    long chunk = rows > 8 ? 16 : 64;
    while (chunk > 4 && (n + chunk - 1) / chunk < 4L * threads)
        chunk /= 2;
    /* One activation tile (decode): nothing is reused across it, so chunks as long as leave every thread
       16 of them. Each chunk starts its software prefetch cold and hands its last tiles' prefetch to
       whichever thread takes the next: at 64 rows that was a quarter of every chunk unprefetched (LM
       head, one row: 10.3-10.5 -> 9.3-9.5 ms on a 2-core AMD EPYC VM, scripts/gguf_kernel_bench.py). */
    while (rows <= 4 && chunk < 1024 && n / (2 * chunk) >= 16L * threads)
        chunk *= 2;
    const long chunks = (n + chunk - 1) / chunk;
    Amax *part = row_max ? amax_parts(threads, rows) : NULL;
    if (row_max && part == NULL)
        return act_done(&a, E_MEMORY);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && chunks > 1)
    for (long c = 0; c < chunks; c++) {
        const long i0 = c * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
        tile_pass(kern, type, form, w, row_bytes, nb, &a, rows, i0, i1, out, n, 0, NULL);
        if (part)
            amax_scan(out, n, rows, i0, i1, part + thread_id() * rows);
    }
    if (part) {
        amax_reduce(part, threads, rows, row_max, row_arg);
        free(part);
    }
    return act_done(&a, 0);
}

/* Rows of a 32-element format repacked by eight, in place (the same bytes, rearranged): what the VNNI and AVX2
   forms read without unpacking, at any row count (r8_rows). Group g's block b, 8 * bytes at w + (g * nb + b) * 8
   * bytes: the 8 rows' fp16 scales (row j's at 2j), then
     Q8_0: 8 chunks of 32 bytes, chunk q's lane j (bytes 4j .. 4j + 3) row j's values 4q .. 4q + 3;
     Q4_0 / Q5_0: 4 chunks of 32 bytes, chunk c's lane j row j's bytes qs[4c .. 4c + 3] (their low nibbles values
       4c .. 4c + 3, their high ones 16 + 4c ..); Q5_0 then 32 bytes of fifth bits, byte 4j + e's bit q row j's
       qh bit 4q + e (the fifth bit of value 4q + e).
   n: a multiple of 8. Returns the repacked type (T_Q8_0_R8 ...), or E_TYPE (another format), E_SHAPE, E_FORM
   (neither form on this CPU: nothing to read it) or E_MEMORY (nothing changed then). One serial pass (about 20
   ms for a 178 MB head). */
int gguf_repack8(int type, uint8_t *w, long n, long k) {
    if (type != T_Q4_0 && type != T_Q5_0 && type != T_Q8_0)
        return E_TYPE;
    if (k <= 0 || k % 32 != 0 || n < 0 || n % 8 != 0)
        return E_SHAPE;
    if (gguf_form_best() == FORM_PORTABLE)
        return E_FORM;
    const int bytes = gguf_block_bytes(type);
    const long nb = k / 32, gb = nb * 8 * bytes; /* a group's bytes: 8 rows of nb blocks */
    uint8_t *t = malloc((size_t)gb);
    if (t == NULL)
        return E_MEMORY;
    for (long g = 0; g < n / 8; g++) {
        uint8_t *src = w + g * gb;
        memcpy(t, src, (size_t)gb);
        for (long b = 0; b < nb; b++) {
            uint8_t *o = src + b * 8 * bytes;
            for (int j = 0; j < 8; j++) {
                const uint8_t *blk = t + (j * nb + b) * bytes;
                memcpy(o + 2 * j, blk, 2);
                if (type == T_Q8_0) {
                    for (int q = 0; q < 8; q++)
                        memcpy(o + 16 + 32 * q + 4 * j, blk + 2 + 4 * q, 4);
                    continue;
                }
                const uint8_t *qs = blk + (type == T_Q5_0 ? 6 : 2);
                for (int c = 0; c < 4; c++)
                    memcpy(o + 16 + 32 * c + 4 * j, qs + 4 * c, 4);
                if (type == T_Q5_0) {
                    const uint32_t qh = rd32(blk + 2);
                    for (int e = 0; e < 4; e++) {
                        uint8_t hb = 0;
                        for (int q = 0; q < 8; q++)
                            hb |= (uint8_t)(((qh >> (4 * q + e)) & 1u) << q);
                        o[144 + 4 * j + e] = hb;
                    }
                }
            }
        }
    }
    free(t);
    return type + 100;
}

/* One row of nb blocks dequantized to float (what gguf's dequantize gives, up to its float rounding). */
static void dequantize_row(int type, const uint8_t *w, long nb, float *out) {
    const int bytes = gguf_block_bytes(type);
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + b * bytes;
        if (type == T_Q8_0) {
            const float d = half(rd16(p));
            for (int i = 0; i < 32; i++)
                out[32 * b + i] = d * (float)(int8_t)p[2 + i];
        } else if (type == T_Q4_0 || type == T_Q5_0) {
            const float d = half(rd16(p));
            const uint32_t qh = type == T_Q5_0 ? rd32(p + 2) : 0;
            const uint8_t *qs = p + (type == T_Q5_0 ? 6 : 2);
            const int off = type == T_Q5_0 ? 16 : 8;
            for (int i = 0; i < 16; i++) {
                out[32 * b + i] = d * (float)(((qs[i] & 15) | (int)(((qh >> i) & 1) << 4)) - off);
                out[32 * b + i + 16] = d * (float)(((qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) - off);
            }
        } else if (type == T_Q6_K) {
            /* Each half: for l = 0..31, outputs l, l+32, l+64, l+96 (scales sc[l/16 + 0, 2, 4, 6]); written
               as four straight lines so the compiler vectorizes them (the many-row path dequantizes
               whole weights per call). */
            const float d = half(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
                const uint8_t *L = p + 64 * h, *H = p + 128 + 32 * h;
                const int8_t *S = (const int8_t *)(p + 192 + 8 * h);
                float *o = out + 256 * b + 128 * h;
                for (int g = 0; g < 2; g++) {
                    const float s0 = d * (float)S[g], s1 = d * (float)S[g + 2], s2 = d * (float)S[g + 4],
                                s3 = d * (float)S[g + 6];
                    for (int l = 16 * g; l < 16 * g + 16; l++) {
                        const int a = L[l], c = L[l + 32], e = H[l];
                        o[l] = s0 * (float)(((a & 15) | ((e & 3) << 4)) - 32);
                        o[l + 32] = s1 * (float)(((c & 15) | (((e >> 2) & 3) << 4)) - 32);
                        o[l + 64] = s2 * (float)(((a >> 4) | (((e >> 4) & 3) << 4)) - 32);
                        o[l + 96] = s3 * (float)(((c >> 4) | ((e >> 6) << 4)) - 32);
                    }
                }
            }
        } else {
            int sc[8], mn[8];
            k4_scales(p + 4, sc, mn);
            const float d = half(rd16(p)), dmin = half(rd16(p + 2));
            const uint8_t *qh = p + 16, *qs = p + (type == T_Q5_K ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
                for (int l = 0; l < 32; l++) {
                    const uint8_t byte = qs[32 * (j / 2) + l];
                    int q = j & 1 ? byte >> 4 : byte & 15;
                    if (type == T_Q5_K)
                        q |= ((qh[l] >> j) & 1) << 4;
                    out[256 * b + 32 * j + l] = dj * (float)q - mj;
                }
            }
        }
    }
}

/* Row `id` of a weight of nb blocks a row (rb bytes), dequantized: as dequantize_row, and for a weight
   repacked by eight (T_*_R8) the same values read from its group. */
static void read_row(int type, const uint8_t *w, long rb, long id, long nb, float *out) {
    const int base = r8_base(type);
    if (base < 0) {
        dequantize_row(type, w + id * rb, nb, out);
        return;
    }
    const int j = (int)(id % 8), gbb = 8 * gguf_block_bytes(base);
    const int off = base == T_Q4_0 ? 8 : 16;
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = w + ((id / 8) * nb + b) * gbb;
        const float d = half(rd16(p + 2 * j));
        float *o = out + 32 * b;
        if (base == T_Q8_0) {
            for (int q = 0; q < 8; q++) {
                const int8_t *v = (const int8_t *)(p + 16 + 32 * q + 4 * j);
                for (int e = 0; e < 4; e++)
                    o[4 * q + e] = d * (float)v[e];
            }
            continue;
        }
        const uint8_t *c0 = p + 16 + 4 * j, *hb = p + 144 + 4 * j;
        for (int c = 0; c < 4; c++)
            for (int e = 0; e < 4; e++) { /* values 4c + e (low nibble) and 16 + 4c + e (high) */
                const int byte = c0[32 * c + e];
                int lo = byte & 15, hi = byte >> 4;
                if (base == T_Q5_0) {
                    lo |= ((hb[e] >> c) & 1) << 4;
                    hi |= ((hb[e] >> (c + 4)) & 1) << 4;
                }
                o[4 * c + e] = d * (float)(lo - off);
                o[16 + 4 * c + e] = d * (float)(hi - off);
            }
    }
}

/* out [nids, k] = rows ids of w [n, k] (blocks of `type`), dequantized. Returns 0, E_TYPE, E_SHAPE,
   or E_INDEX (an id outside 0..n-1; nothing written then). */
int gguf_get_rows(int type, const uint8_t *w, long n, long k, const long *ids, long nids, float *out) {
    const int block = gguf_block_elems(type);
    if (block == 0)
        return E_TYPE;
    if (k <= 0 || k % block != 0 || n < 0 || nids < 0)
        return E_SHAPE;
    for (long i = 0; i < nids; i++)
        if (ids[i] < 0 || ids[i] >= n)
            return E_INDEX;
    if (r8_base(type) >= 0 && n % 8)
        return E_SHAPE;
    const long nb = k / block, row_bytes = nb * gguf_block_bytes(type);
    for (long i = 0; i < nids; i++)
        read_row(type, w, row_bytes, ids[i], nb, out + i * k);
    return 0;
}

/* out [n, k] = every row of w [n, k] (blocks of `type`) dequantized, as bfloat16 (bf16 != 0: uint16
   bit patterns, rounded to nearest even) or float32; OpenMP over rows. What a many-row call
   multiplies with a dense GEMM: one transient weight, made per call (gguf_linear.py). Returns 0,
   E_TYPE, E_SHAPE or E_MEMORY. */
int gguf_dequantize(int type, const uint8_t *w, long n, long k, int threads, int bf16, void *out) {
    const int block = gguf_block_elems(type);
    if (block == 0)
        return E_TYPE;
    if (k <= 0 || k % block != 0 || n < 0 || (r8_base(type) >= 0 && n % 8))
        return E_SHAPE;
    const long nb = k / block, row_bytes = nb * gguf_block_bytes(type);
    threads = threads > 0 ? threads : 1;
    int failed = 0;
#if GQ_X86
    const int base = r8_base(type);
    if (base >= 0) { /* 8 rows a group at once (r8_dequant8); the AVX2 code runs wherever a repacked type exists */
        const long gbytes = 8 * row_bytes;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
        {
            float *buf = bf16 ? malloc((size_t)8 * k * sizeof(float)) : NULL;
            if (bf16 && buf == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (long g = 0; g < n / 8; g++) {
                if (bf16 && buf == NULL)
                    continue;
                if (!bf16) {
                    r8_dequant8_avx2(base, w + g * gbytes, nb, (float *)out + 8 * g * k, k);
                    continue;
                }
                r8_dequant8_avx2(base, w + g * gbytes, nb, buf, k);
                uint16_t *o = (uint16_t *)out + 8 * g * k;
                for (long j = 0; j < 8 * k; j++) {
                    uint32_t u;
                    memcpy(&u, buf + j, 4);
                    o[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                }
            }
            free(buf);
        }
        return failed ? E_MEMORY : 0;
    }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        float *buf = bf16 ? malloc((size_t)k * sizeof(float)) : NULL;
        if (bf16 && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) {
            if (bf16 && buf == NULL)
                continue;
            if (!bf16) {
                read_row(type, w, row_bytes, i, nb, (float *)out + i * k);
                continue;
            }
            read_row(type, w, row_bytes, i, nb, buf);
            uint16_t *o = (uint16_t *)out + i * k;
            for (long j = 0; j < k; j++) {
                uint32_t u;
                memcpy(&u, buf + j, 4);
                o[j] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            }
        }
        free(buf);
    }
    return failed ? E_MEMORY : 0;
}

#else /* GQ_SECTION: one SIMD form, GQ_FORM */

#if GQ_FORM == 2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define F(name) name##_vnni
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define F(name) name##_avx2
#endif

#define GQ_INLINE static inline __attribute__((always_inline))

/* u8 x s8, each 4 neighbours summed into the 8 int32 lanes (lane t: bytes 4t..4t+3). */
GQ_INLINE __m256i F(dot)(__m256i u, __m256i s) {
#if GQ_FORM == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* As dot, each int32 lane times its sub-block's scale (`scale`: scale_of's multipliers). */
GQ_INLINE __m256i F(dot_scaled)(__m256i u, __m256i s, __m256i scale) {
#if GQ_FORM == 2
    /* Each lane's 4 products sum to at most 4 * 63 * 127 < 2^15: the int32 lanes are int16 values
       (their high halves the sign), so one vpmaddwd by (scale, 0) pairs scales them. */
    return _mm256_madd_epi16(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), scale);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
#endif
}

/* k4_scales' 8 scales (bytes 0-7) and 8 mins (8-15) of a Q4_K / Q5_K block's 12 scale bytes (s), in registers: the
   words t0, t1, t2 of s give t0 & 0x3f.., (t2 & 0x0f..) | ((t0 >> 6) & 0x03..) << 4, t1 & 0x3f.., ((t2 >> 4) & 0x0f..)
   | ((t1 >> 6) & 0x03..) << 4 (ggml's utmp, four lanes at once). Reads 16 bytes: s + 12 .. 15 are the block's own. */
GQ_INLINE __m128i F(k4_scales_vec)(const uint8_t *s) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)s);
    const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i b = _mm_shuffle_epi32(raw, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i low = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i high = _mm_and_si128(_mm_slli_epi32(_mm_srli_epi32(b, 6), 4),
                                       _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}

/* dot_scaled's multipliers for 32 values j of a K-quant block, from `t`: 16 int16 scales, the low 128 bits'
   scale j for the first 16 values, the high 128 bits' scale j for the other 16. One vpshufb: building them
   from two integers took five instructions a time, and with the scales' scalar decoding that was most of a
   Q4_K block's. One row, one thread, the default model's 18 layers (Xeon VM, each the same bits as before):
   Q4_K attn_output [640, 1024] 0.92 -> 0.67 ms, Q6_K ffn_down [640, 2048] 1.87 -> 1.25 ms.
   VNNI: (scale, 0) per int32 lane; AVX2: (scale, scale), the pairs vpmaddubsw summed. */
GQ_INLINE __m256i F(scale_of)(__m256i t, int j) {
    const char a = (char)(2 * j), b = (char)(2 * j + 1);
#if GQ_FORM == 2
    const char c = (char)0x80, d = (char)0x80;
#else
    const char c = a, d = b;
#endif
    return _mm256_shuffle_epi8(t, _mm256_setr_epi8(a, b, c, d, a, b, c, d, a, b, c, d, a, b, c, d,
                                                   a, b, c, d, a, b, c, d, a, b, c, d, a, b, c, d));
}

GQ_INLINE float F(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles as 32 values: low nibbles first, then high. */
GQ_INLINE __m256i F(nibbles16)(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_setr_m128i(t, _mm_srli_epi16(t, 4)), _mm256_set1_epi8(15));
}

/* The 32 bits of `bits` as 32 bytes: 16 where set, 0 where not (Q5_0's fifth bits). */
GQ_INLINE __m256i F(bits16)(uint32_t bits) {
#if GQ_FORM == 2
    return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16));
#else
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
#endif
}

/* A 32-element block's values (p: the block) as the unsigned bytes the VNNI form reads: Q4_0 q, Q5_0 q
   (its fifth bits or-ed in), Q8_0 q + 128; the offsets come back through the activations' c. */
GQ_INLINE __m256i F(values32)(const int type, const uint8_t *p) {
    if (type == T_Q4_0)
        return F(nibbles16)(p + 2);
    if (type == T_Q5_0)
        return _mm256_or_si256(F(nibbles16)(p + 6), F(bits16)(rd32(p + 2)));
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), _mm256_set1_epi8((char)0x80));
}

/* The 32-element formats: WR weight rows against NR activation rows, one float accumulator per pair
   (a block's int32 lanes converted and multiplied-added by the block's d * dx: no horizontal sum until
   the end). The weights' offset enters the integer dot through the activations' c (exact). */
GQ_INLINE void F(rows32)(const int type, const uint8_t *w, long rb, long nb, const Act *a, int r0, const int NR,
                         const int WR, float *res) {
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34;
    const int sign = type == T_Q8_0 && GQ_FORM != FORM_VNNI; /* AVX2 Q8_0: |w| times x with w's sign */
    __m256 acc[4][4];
    const int8_t *xq = a->q + (long)r0 * a->k;
    const float *xd = a->d + (long)r0 * a->nb;
    const int32_t *xc = a->c + (long)r0 * a->nb;
    for (int i = 0; i < WR; i++)
        for (int r = 0; r < NR; r++)
            acc[i][r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m256i u[4], raw[4];
        float dw[4];
        for (int i = 0; i < WR; i++) {
            const uint8_t *p = w + i * rb + b * bytes;
            /* Software prefetch four tiles ahead: one core's stream from L3 / memory is latency-bound
               without it (LM head, one row: 13.4 -> 7.6 ms, scripts/gguf_kernel_bench.py). */
            _mm_prefetch((const char *)p + 4 * WR * rb, _MM_HINT_T0);
            dw[i] = _cvtsh_ss(rd16(p));
            if (sign) {
                raw[i] = _mm256_loadu_si256((const __m256i *)(p + 2));
                u[i] = _mm256_sign_epi8(raw[i], raw[i]);
            } else
                u[i] = F(values32)(type, p);
        }
        for (int r = 0; r < NR; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * a->k + 32 * b));
            const __m256i c = sign ? _mm256_setzero_si256()
                                   : _mm256_zextsi128_si256(_mm_cvtsi32_si128(xc[r * a->nb + b]));
            const float dx = xd[r * a->nb + b];
            for (int i = 0; i < WR; i++) {
                __m256i isum;
#if GQ_FORM == 2
                isum = _mm256_dpbusd_epi32(c, u[i], sign ? _mm256_sign_epi8(x, raw[i]) : x);
#else
                isum = _mm256_add_epi32(F(dot)(u[i], sign ? _mm256_sign_epi8(x, raw[i]) : x), c);
#endif
                acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * dx), _mm256_cvtepi32_ps(isum), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < WR; i++)
        for (int r = 0; r < NR; r++)
            res[i * NR + r] = F(hsum)(acc[i][r]);
}

/* The K-quants: WR weight rows (tile_rows gives 1) against NR activation rows, as
   rows32 for the 32-element formats: independent accumulator chains per weight row and a software
   prefetch four tiles ahead (each block spans 3-4 cache lines). */
GQ_INLINE void F(rowsk)(const int type, const uint8_t *w, long rb, long nb, const Act *a, int r0, const int NR,
                        const int WR, float *res) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    __m256 acc[4][8];
    __m256 offv[4][8];
    const int8_t *xq[8];
    const float *xd[8];
    const int16_t *xs[8];
    for (int r = 0; r < NR; r++) {
        for (int i = 0; i < WR; i++) {
            acc[i][r] = _mm256_setzero_ps();
            offv[i][r] = _mm256_setzero_ps();
        }
        xq[r] = a->q + (long)(r0 + r) * a->k;
        xd[r] = a->d + (long)(r0 + r) * a->nb;
        xs[r] = a->s + (long)(r0 + r) * (a->k / 16);
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (long b = 0; b < nb; b++) {
        for (int i = 0; i < WR; i++) {
            const uint8_t *p = w + i * rb + b * bytes;
            const char *ahead = (const char *)p + 4 * WR * rb;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            if (bytes > 192)
                _mm_prefetch(ahead + 192, _MM_HINT_T0);
            __m256i u[8];
            __m256i scales; /* scale_of's table */
            __m256i om; /* 16 int16 multipliers of the 16 bsums: the offsets' integer part is madd(om, bsums) */
            float dw, dmin = 0.0f;
            if (type == T_Q6_K) {
                dw = _cvtsh_ss(rd16(p + 208));
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                    const __m256i three = _mm256_set1_epi8(3);
                    u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low),
                                                   _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
                    u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
                    u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
                    u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
                }
                /* int8 scales, one per 16 values: 32 values j take scale 2j (first 16), 2j + 1 (the rest). */
                const __m128i sc = _mm_loadu_si128((const __m128i *)(p + 192));
                scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14,
                                                                                 1, 3, 5, 7, 9, 11, 13, 15)));
                om = _mm256_cvtepi8_epi16(sc);
            } else {
                dw = _cvtsh_ss(rd16(p));
                dmin = _cvtsh_ss(rd16(p + 2));
                const uint8_t *qs = p + (type == T_Q5_K ? 48 : 16);
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    u[2 * c] = _mm256_and_si256(v, low);
                    u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (type == T_Q5_K) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
                    const __m256i one = _mm256_set1_epi8(1);
                    for (int j = 0; j < 8; j++)
                        u[j] = _mm256_or_si256(u[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
                }
                /* The 8 six-bit scales (bytes 0-7) and mins (8-15) of the 12 scale bytes, as k4_scales reads them. */
                const __m128i sm = F(k4_scales_vec)(p + 4);
                scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
                om = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13,
                                                                             14, 14, 15, 15)));
            }
            /* Q6_K: 32 * dw * sum(sc * bsums); Q4_K / Q5_K: dmin * sum(m * bsums). */
            const float od = type == T_Q6_K ? 32.0f * dw : dmin;
            for (int r = 0; r < NR; r++) {
                const int8_t *x = xq[r] + 256 * b;
                const int16_t *s = xs[r] + 16 * b;
                __m256i isum = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++)
                    isum = _mm256_add_epi32(isum, F(dot_scaled)(u[j], _mm256_loadu_si256((const __m256i *)(x + 32 * j)),
                                                                F(scale_of)(scales, j)));
                const __m256i o = _mm256_madd_epi16(om, _mm256_loadu_si256((const __m256i *)s));
                offv[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(od * xd[r][b]), _mm256_cvtepi32_ps(o), offv[i][r]);
                acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[r][b]), _mm256_cvtepi32_ps(isum), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < WR; i++)
        for (int r = 0; r < NR; r++)
            res[i * NR + r] = F(hsum)(_mm256_sub_ps(acc[i][r], offv[i][r]));
}

#if GQ_FORM == 2
/* rows32 at 5..8 activation rows (VNNI form): two activation rows in one 512-bit register, row 2p in the
   low half and 2p + 1 in the high half, each half the very lanes rows32 computes for its row (the same
   integer dot, conversion, product dw * dx, multiply-add order and horizontal sum), so every row gets the
   bits of a one-row call (a speculative verify those of one-token steps), 8 rows in one pass over the
   weights instead of two (LM head, 8 rows: 17.4 -> 15.6 ms; a verify step of 5-8 rows, forward and head,
   7-14% less; at 2-4 rows the ymm tiles stayed ahead). NR odd: the last pair's high half repeats its low
   row. */
GQ_INLINE __m512i F(pair_i)(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

GQ_INLINE void F(rows32x2)(const int type, const uint8_t *w, long rb, long nb, const Act *a, int r0, const int NR,
                           const int WR, float *res) {
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34;
    const int NP = (NR + 1) / 2;
    __m512 acc[4][4];
    const int8_t *xq[8];
    const float *xd[8];
    const int32_t *xc[8];
    for (int r = 0; r < 2 * NP; r++) {
        const int rr = r0 + (r < NR ? r : NR - 1);
        xq[r] = a->q + (long)rr * a->k;
        xd[r] = a->d + (long)rr * a->nb;
        xc[r] = a->c + (long)rr * a->nb;
    }
    for (int i = 0; i < WR; i++)
        for (int p = 0; p < NP; p++)
            acc[i][p] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m512i u[4];
        float dw[4];
        for (int i = 0; i < WR; i++) {
            const uint8_t *p = w + i * rb + b * bytes;
            _mm_prefetch((const char *)p + 4 * WR * rb, _MM_HINT_T0);
            dw[i] = _cvtsh_ss(rd16(p));
            u[i] = _mm512_broadcast_i64x4(F(values32)(type, p));
        }
        for (int q = 0; q < NP; q++) {
            const int r = 2 * q;
            const __m512i x = F(pair_i)(_mm256_loadu_si256((const __m256i *)(xq[r] + 32 * b)),
                                        _mm256_loadu_si256((const __m256i *)(xq[r + 1] + 32 * b)));
            const __m512i c = F(pair_i)(_mm256_zextsi128_si256(_mm_cvtsi32_si128(xc[r][b])),
                                        _mm256_zextsi128_si256(_mm_cvtsi32_si128(xc[r + 1][b])));
            const __m512 dx = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_set1_ps(xd[r][b])), _mm256_castps_pd(_mm256_set1_ps(xd[r + 1][b])), 1));
            for (int i = 0; i < WR; i++)
                acc[i][q] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dw[i]), dx),
                                            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, u[i], x)), acc[i][q]);
        }
    }
    for (int i = 0; i < WR; i++)
        for (int q = 0; q < NP; q++) {
            res[i * NR + 2 * q] = F(hsum)(_mm512_castps512_ps256(acc[i][q]));
            if (2 * q + 1 < NR)
                res[i * NR + 2 * q + 1] = F(hsum)(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][q]), 1)));
        }
}

#define GQ_CASES32(TYPE, WR)                                                                       \
    switch (nr) {                                                                                  \
    case 1: F(rows32)(TYPE, w, rb, nb, a, r0, 1, WR, res); break;                                  \
    case 2: F(rows32)(TYPE, w, rb, nb, a, r0, 2, WR, res); break;                                  \
    case 3: F(rows32)(TYPE, w, rb, nb, a, r0, 3, WR, res); break;                                  \
    case 4: F(rows32)(TYPE, w, rb, nb, a, r0, 4, WR, res); break;                                  \
    case 5: F(rows32x2)(TYPE, w, rb, nb, a, r0, 5, WR, res); break;                                \
    case 6: F(rows32x2)(TYPE, w, rb, nb, a, r0, 6, WR, res); break;                                \
    case 7: F(rows32x2)(TYPE, w, rb, nb, a, r0, 7, WR, res); break;                                \
    default: F(rows32x2)(TYPE, w, rb, nb, a, r0, 8, WR, res); break;                               \
    }
#else
#define GQ_CASES32(TYPE, WR) GQ_CASES(rows32, TYPE, WR)
#endif

/* Each (type, form) as a row_kernel, its row counts constants in each case so the loops unroll. */
#define GQ_CASES(BODY, TYPE, WR)                                                                   \
    switch (nr) {                                                                                  \
    case 1: F(BODY)(TYPE, w, rb, nb, a, r0, 1, WR, res); break;                                    \
    case 2: F(BODY)(TYPE, w, rb, nb, a, r0, 2, WR, res); break;                                    \
    case 3: F(BODY)(TYPE, w, rb, nb, a, r0, 3, WR, res); break;                                    \
    default: F(BODY)(TYPE, w, rb, nb, a, r0, 4, WR, res); break;                                   \
    }
#define GQ_KERNEL32(NAME, TYPE)                                                                    \
    static void F(NAME)(const uint8_t *w, long rb, int wr, long nb, const Act *a, int r0, int nr, float *res) { \
        if (wr == 4)                                                                               \
            GQ_CASES32(TYPE, 4)                                                                    \
        else if (wr == 2)                                                                          \
            GQ_CASES32(TYPE, 2)                                                                    \
        else                                                                                       \
            GQ_CASES32(TYPE, 1)                                                                    \
    }
#define GQ_KERNEL(NAME, BODY, TYPE)                                                                \
    static void F(NAME)(const uint8_t *w, long rb, int wr, long nb, const Act *a, int r0, int nr, float *res) { \
        for (int t = 0; t < wr; t++, w += rb, res += nr)                                           \
            switch (nr) {                                                                          \
            case 1: F(BODY)(TYPE, w, rb, nb, a, r0, 1, 1, res); break;                             \
            case 2: F(BODY)(TYPE, w, rb, nb, a, r0, 2, 1, res); break;                             \
            case 3: F(BODY)(TYPE, w, rb, nb, a, r0, 3, 1, res); break;                             \
            case 4: F(BODY)(TYPE, w, rb, nb, a, r0, 4, 1, res); break;                             \
            case 5: F(BODY)(TYPE, w, rb, nb, a, r0, 5, 1, res); break;                             \
            case 6: F(BODY)(TYPE, w, rb, nb, a, r0, 6, 1, res); break;                             \
            case 7: F(BODY)(TYPE, w, rb, nb, a, r0, 7, 1, res); break;                             \
            default: F(BODY)(TYPE, w, rb, nb, a, r0, 8, 1, res); break;                            \
            }                                                                                      \
    }
GQ_KERNEL32(k_q4_0, T_Q4_0)
GQ_KERNEL32(k_q5_0, T_Q5_0)
GQ_KERNEL32(k_q8_0, T_Q8_0)
GQ_KERNEL(k_q4_k, rowsk, T_Q4_K)
GQ_KERNEL(k_q5_k, rowsk, T_Q5_K)
GQ_KERNEL(k_q6_k, rowsk, T_Q6_K)

#if GQ_FORM == 2
/* Many activation rows, 32-element formats (the LM head and the layers at a batch of decodes, prefill
   chunks): 8 weight rows' blocks unpacked once into u[8 * b + q] (lane j: weight row j's values
   4q .. 4q + 3 of block b, as the unsigned integers rows32 reads) and their scales dw[8 * b + j], then
   each activation row's 4 values broadcast against them: one vpdpbusd gives 8 weight rows' partial dots
   at once, and one float multiply-add per block serves 8 outputs (rows32 spends a conversion and a
   multiply-add per block for each one). Unpacking costs about what rows32 spends on one activation
   row. Its float sums run in another order than rows32's (block by block, not lane by lane), so an
   output can differ from the tiles' in the last bits (hence ILV_ROWS). */
GQ_INLINE void F(transpose8)(__m256i r[8]) {
    __m256i t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 0-3, then 4-7 */
        s[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
        s[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
        s[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        s[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int q = 0; q < 4; q++) {
        r[q] = _mm256_permute2x128_si256(s[q], s[4 + q], 0x20);
        r[q + 4] = _mm256_permute2x128_si256(s[q], s[4 + q], 0x31);
    }
}

/* wr <= 8 weight rows (w, w + rb, ..) unpacked as above; missing rows are zeros with scale 0. */
static void F(unpack8)(const int type, const uint8_t *w, long rb, int wr, long nb, __m256i *u, float *dw) {
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34;
    for (long b = 0; b < nb; b++) {
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            if (i >= wr) {
                v[i] = _mm256_setzero_si256();
                dw[8 * b + i] = 0.0f;
                continue;
            }
            const uint8_t *p = w + i * rb + b * bytes;
            _mm_prefetch((const char *)p + 8 * rb, _MM_HINT_T0); /* the next group's same block */
            dw[8 * b + i] = _cvtsh_ss(rd16(p));
            v[i] = F(values32)(type, p);
        }
        F(transpose8)(v);
        for (int q = 0; q < 8; q++)
            _mm256_store_si256(u + 8 * b + q, v[q]);
    }
}

/* NR activation rows from r0 against an unpacked group: out[r * ldo + j] for its wr weight rows. */
GQ_INLINE void F(ilv_rows)(const __m256i *u, const float *dw, long nb, const Act *a, int r0, const int NR,
                           float *out, long ldo, int wr) {
    __m256 acc[8];
    const int8_t *xq[8];
    const float *xd[8];
    const int32_t *xc[8];
    for (int r = 0; r < NR; r++) {
        acc[r] = _mm256_setzero_ps();
        xq[r] = a->q + (long)(r0 + r) * a->k;
        xd[r] = a->d + (long)(r0 + r) * a->nb;
        xc[r] = a->c + (long)(r0 + r) * a->nb;
    }
    for (long b = 0; b < nb; b++) {
        __m256i is[8];
        for (int r = 0; r < NR; r++)
            is[r] = _mm256_set1_epi32(xc[r][b]); /* the weights' offset times the block's sum, exact */
        for (int q = 0; q < 8; q++) {
            const __m256i wv = _mm256_load_si256(u + 8 * b + q);
            for (int r = 0; r < NR; r++) {
                int32_t x4;
                memcpy(&x4, xq[r] + 32 * b + 4 * q, 4);
                is[r] = _mm256_dpbusd_epi32(is[r], wv, _mm256_set1_epi32(x4));
            }
        }
        const __m256 sw = _mm256_load_ps(dw + 8 * b);
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(sw, _mm256_set1_ps(xd[r][b])), acc[r]);
    }
    for (int r = 0; r < NR; r++) {
        if (wr == 8) {
            _mm256_storeu_ps(out + (long)r * ldo, acc[r]);
        } else {
            float t[8];
            _mm256_storeu_ps(t, acc[r]);
            memcpy(out + (long)r * ldo, t, (size_t)wr * sizeof(float));
        }
    }
}

/* One group of wr <= 8 weight rows from w against activation rows 0 .. rows - 1: out[r * ldo + j]. u, dw:
   scratch for the unpacked group (32-byte aligned, nb * 8 vectors and floats). */
static void F(ilv_group)(int type, const uint8_t *w, long rb, int wr, const Act *a, int rows, float *out, long ldo,
                         __m256i *u, float *dw) {
    const long nb = a->nb;
    F(unpack8)(type, w, rb, wr, nb, u, dw);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        float *o = out + (long)r0 * ldo;
        switch (rows - r0 < 8 ? rows - r0 : 8) {
        case 1: F(ilv_rows)(u, dw, nb, a, r0, 1, o, ldo, wr); break;
        case 2: F(ilv_rows)(u, dw, nb, a, r0, 2, o, ldo, wr); break;
        case 3: F(ilv_rows)(u, dw, nb, a, r0, 3, o, ldo, wr); break;
        case 4: F(ilv_rows)(u, dw, nb, a, r0, 4, o, ldo, wr); break;
        case 5: F(ilv_rows)(u, dw, nb, a, r0, 5, o, ldo, wr); break;
        case 6: F(ilv_rows)(u, dw, nb, a, r0, 6, o, ldo, wr); break;
        case 7: F(ilv_rows)(u, dw, nb, a, r0, 7, o, ldo, wr); break;
        default: F(ilv_rows)(u, dw, nb, a, r0, 8, o, ldo, wr); break;
        }
    }
}

/* The K-quants interleaved: per 256-element block and 8 weight rows, the 256 values (u, as rowsk unpacks
   them: unsigned, 8 sub-blocks of 32) transposed as unpack8 does, each 16 values' integer scale and min
   (Q6_K: its scale both times; Q4_K / Q5_K: their 32-value sub-block's, twice) as int32 lanes, and the
   float factors d and dm (dmin, or 32 * d for Q6_K's offset): w = d * sc * q - dm * mn per 16 values. */
typedef struct {
    __m256i u[64], sc[16], mn[16];
    __m256 d, dm;
} F(KTile);

static void F(unpack8k)(const int type, const uint8_t *w, long rb, int wr, long nb, F(KTile) *t) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const __m256i low = _mm256_set1_epi8(15);
    for (long b = 0; b < nb; b++) {
        __m256i v[8][8]; /* [sub-block][weight row] */
        int sc[16][8], mn[16][8];
        float d[8], dm[8];
        for (int i = 0; i < 8; i++) {
            if (i >= wr) {
                for (int j = 0; j < 8; j++)
                    v[j][i] = _mm256_setzero_si256();
                for (int j = 0; j < 16; j++)
                    sc[j][i] = mn[j][i] = 0;
                d[i] = dm[i] = 0.0f;
                continue;
            }
            const uint8_t *p = w + i * rb + b * bytes;
            _mm_prefetch((const char *)p + 8 * rb, _MM_HINT_T0);
            if (type == T_Q6_K) {
                const int8_t *s8 = (const int8_t *)(p + 192);
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                    const __m256i three = _mm256_set1_epi8(3);
                    v[4 * h + 0][i] = _mm256_or_si256(_mm256_and_si256(l0, low),
                                                      _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
                    v[4 * h + 1][i] = _mm256_or_si256(
                        _mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
                    v[4 * h + 2][i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
                    v[4 * h + 3][i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
                }
                for (int j = 0; j < 16; j++)
                    sc[j][i] = mn[j][i] = s8[j];
                d[i] = _cvtsh_ss(rd16(p + 208));
                dm[i] = 32.0f * d[i];
            } else {
                int s6[8], m6[8];
                k4_scales(p + 4, s6, m6);
                const uint8_t *qs = p + (type == T_Q5_K ? 48 : 16);
                for (int c = 0; c < 4; c++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    v[2 * c][i] = _mm256_and_si256(x, low);
                    v[2 * c + 1][i] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                }
                if (type == T_Q5_K) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
                    const __m256i one = _mm256_set1_epi8(1);
                    for (int j = 0; j < 8; j++)
                        v[j][i] = _mm256_or_si256(v[j][i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
                }
                for (int j = 0; j < 16; j++) {
                    sc[j][i] = s6[j / 2];
                    mn[j][i] = m6[j / 2];
                }
                d[i] = _cvtsh_ss(rd16(p));
                dm[i] = _cvtsh_ss(rd16(p + 2));
            }
        }
        F(KTile) *o = t + b;
        for (int j = 0; j < 8; j++) {
            F(transpose8)(v[j]);
            for (int q = 0; q < 8; q++)
                o->u[8 * j + q] = v[j][q];
        }
        for (int j = 0; j < 16; j++) {
            o->sc[j] = _mm256_loadu_si256((const __m256i *)sc[j]);
            o->mn[j] = _mm256_loadu_si256((const __m256i *)mn[j]);
        }
        o->d = _mm256_loadu_ps(d);
        o->dm = _mm256_loadu_ps(dm);
    }
}

/* NR activation rows from r0 (rounded in blocks of 256) against an unpacked K-quant group. Integer sums
   stay in int32: a 16-value dot is at most 16 * 63 * 127, times a scale of at most 128, 16 of them. */
GQ_INLINE void F(ilvk_rows)(const F(KTile) *t, long nb, const Act *a, int r0, const int NR, float *out, long ldo,
                            int wr) {
    __m256 acc[4], off[4];
    for (int r = 0; r < NR; r++)
        acc[r] = off[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const F(KTile) *k = t + b;
        __m256i is[4], ms[4];
        for (int r = 0; r < NR; r++)
            is[r] = ms[r] = _mm256_setzero_si256();
        for (int h = 0; h < 16; h++) { /* 16 values: 4 steps of 4 */
            __m256i dp[4];
            for (int r = 0; r < NR; r++)
                dp[r] = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) {
                const __m256i wv = k->u[4 * h + q];
                for (int r = 0; r < NR; r++) {
                    int32_t x4;
                    memcpy(&x4, a->q + (long)(r0 + r) * a->k + 256 * b + 16 * h + 4 * q, 4);
                    dp[r] = _mm256_dpbusd_epi32(dp[r], wv, _mm256_set1_epi32(x4));
                }
            }
            for (int r = 0; r < NR; r++) {
                is[r] = _mm256_add_epi32(is[r], _mm256_mullo_epi32(dp[r], k->sc[h]));
                ms[r] = _mm256_add_epi32(ms[r], _mm256_mullo_epi32(k->mn[h],
                                         _mm256_set1_epi32(a->s[(long)(r0 + r) * (a->k / 16) + 16 * b + h])));
            }
        }
        for (int r = 0; r < NR; r++) {
            const __m256 dx = _mm256_set1_ps(a->d[(long)(r0 + r) * a->nb + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(k->d, dx), acc[r]);
            off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms[r]), _mm256_mul_ps(k->dm, dx), off[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        float res[8];
        _mm256_storeu_ps(res, _mm256_sub_ps(acc[r], off[r]));
        memcpy(out + (long)r * ldo, res, (size_t)wr * sizeof(float));
    }
}

static void F(ilvk_group)(int type, const uint8_t *w, long rb, int wr, const Act *a, int rows, float *out, long ldo,
                          F(KTile) *t) {
    const long nb = a->nb;
    F(unpack8k)(type, w, rb, wr, nb, t);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        float *o = out + (long)r0 * ldo;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: F(ilvk_rows)(t, nb, a, r0, 1, o, ldo, wr); break;
        case 2: F(ilvk_rows)(t, nb, a, r0, 2, o, ldo, wr); break;
        case 3: F(ilvk_rows)(t, nb, a, r0, 3, o, ldo, wr); break;
        default: F(ilvk_rows)(t, nb, a, r0, 4, o, ldo, wr); break;
        }
    }
}

/* gguf_matmul's many-row path (its checks done, activations rounded): out [rows, n]. E_MEMORY when a
   thread's scratch could not be had (some outputs then unwritten). */
/* Weight rows [i0, i1) (rb bytes each, from w) through the interleaved path, 8 at a time, against activation rows
   0..rows-1: out[r * ldo + i - i0]. u, dw: one group's unpacked tile (dw unused for the K-quants). matmul_ilv's
   groups and the fused step's matrix parts past 8 rows (cpu_forward.c mat_part) both go through here. */
static void F(ilv_range)(int type, const uint8_t *w, long rb, long i0, long i1, const Act *a, int rows, float *out,
                        long ldo, void *u, float *dw) {
    for (long i = i0; i < i1; i += 8) {
        const int wr = i1 - i >= 8 ? 8 : (int)(i1 - i);
        if (gguf_block_elems(type) == 256)
            F(ilvk_group)(type, w + i * rb, rb, wr, a, rows, out + (i - i0), ldo, u);
        else
            F(ilv_group)(type, w + i * rb, rb, wr, a, rows, out + (i - i0), ldo, u, dw);
    }
}

static int F(matmul_ilv)(int type, const Act *a, const uint8_t *w, long n, long row_bytes, int rows, int threads,
                         float *out) {
    const long nb = a->nb, groups = (n + 7) / 8;
    const int kq = gguf_block_elems(type) == 256;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        /* The unpacked group: 8 rows' vectors and scales (32-element formats), or their K-tiles. */
        void *u = aligned_alloc(32, kq ? (size_t)nb * sizeof(F(KTile)) : (size_t)nb * 8 * sizeof(__m256i));
        float *dw = aligned_alloc(32, (size_t)nb * 8 * sizeof(float));
        if (u == NULL || dw == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (long g = 0; g < groups; g++) {
            if (u == NULL || dw == NULL)
                continue;
            const long i0 = 8 * g;
            F(ilv_range)(type, w, row_bytes, i0, i0 + 8 < n ? i0 + 8 : n, a, rows, out + i0, n, u, dw);
        }
        free(u);
        free(dw);
    }
    return failed ? E_MEMORY : 0;
}

#endif

/* A Q4_0 / Q5_0 group's block (p) as the 8 chunks of unsigned values r8_rows multiplies: chunk q's lane j row j's
   values 4q .. 4q + 3 (a nibble; Q5_0's fifth bit, bit q of its byte in the bits' chunk, moved to bit 4). */
GQ_INLINE void F(r8_unpack)(const int base, const uint8_t *p, __m256i *wv) {
    const __m256i low = _mm256_set1_epi8(15), five = _mm256_set1_epi8(16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
        wv[c] = _mm256_and_si256(v, low);
        wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if (base == T_Q5_0) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 144));
        wv[0] = _mm256_or_si256(wv[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), five));
        wv[1] = _mm256_or_si256(wv[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), five));
        wv[2] = _mm256_or_si256(wv[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), five));
        wv[3] = _mm256_or_si256(wv[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), five));
        wv[4] = _mm256_or_si256(wv[4], _mm256_and_si256(h, five));
        wv[5] = _mm256_or_si256(wv[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), five));
        wv[6] = _mm256_or_si256(wv[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), five));
        wv[7] = _mm256_or_si256(wv[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), five));
    }
}

/* A repacked group's 8 rows dequantized (what read_row gives each): out[j * ldo + i], i < nb * 32. gguf_dequantize's
   path for the repacked types (a dense GEMM's transient weight), 8 rows at once from each block's chunks. */
static void F(r8_dequant8)(const int base, const uint8_t *g, long nb, float *out, long ldo) {
    const int gbb = 8 * gguf_block_bytes(base); /* a group's block: 8 rows' */
    const __m256i off = _mm256_set1_epi8(base == T_Q4_0 ? 8 : 16);
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = g + b * gbb;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        float d[8];
        _mm256_storeu_ps(d, d8);
        __m256i wv[8];
        if (base == T_Q8_0) {
            for (int q = 0; q < 8; q++)
                wv[q] = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * q));
        } else {
            F(r8_unpack)(base, p, wv);
            for (int q = 0; q < 8; q++)
                wv[q] = _mm256_sub_epi8(wv[q], off);
        }
        for (int q = 0; q < 8; q++) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, wv[q]);
            for (int j = 0; j < 8; j++) {
                const __m128 v = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(lanes[j])));
                _mm_storeu_ps(out + j * ldo + 32 * b + 4 * q, _mm_mul_ps(_mm_set1_ps(d[j]), v));
            }
        }
    }
}

/* Rows repacked by eight (gguf_repack8 gives the layout), `base` their format: NR activation rows from r0 against
   one group: out[r * ldo + j], j < 8. The arithmetic of matmul_ilv's (ilv_rows) with the unpacking done once at
   load (Q4_0 / Q5_0: a nibble's mask or shift, Q5_0's fifth bits a shift and a mask, per 32 values of 8 rows):
   per block and activation row 8 integer dots of 8 lanes (VNNI: vpdpbusd on unsigned values, Q8_0's + 128, the
   offset back through the activations' c; AVX2: vpmaddubsw + vpmaddwd, Q8_0 as |w| times x with w's sign), one
   conversion and one multiply-add for 8 outputs, whatever the row count. Both forms sum the same integers, so
   they give the same bits. */
GQ_INLINE void F(r8_rows)(const int base, const uint8_t *g, long nb, const Act *a, int r0, const int NR, float *out,
                          long ldo, const __m256i *un) {
    const int gbb = 8 * gguf_block_bytes(base); /* a group's block: 8 rows' */
    __m256 acc[8];
    const int8_t *xq[8];
    const float *xd[8];
    const int32_t *xc[8];
    for (int r = 0; r < NR; r++) {
        acc[r] = _mm256_setzero_ps();
        xq[r] = a->q + (long)(r0 + r) * a->k;
        xd[r] = a->d + (long)(r0 + r) * a->nb;
        xc[r] = a->c + (long)(r0 + r) * a->nb;
    }
    const int offset_in_c = GQ_FORM == 2 || base != T_Q8_0; /* AVX2 Q8_0: signed values, no offset */
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = g + b * gbb;
        const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256i wv[8], raw[8];
        if (un == NULL || base == T_Q8_0)
            for (int l = 0; l < gbb; l += 64)
                _mm_prefetch((const char *)p + R8_AHEAD + l, _MM_HINT_T1);
        if (un != NULL) { /* Q4_0 / Q5_0 unpacked already (r8_range, past 8 activation rows) */
            for (int q = 0; q < 8; q++)
                wv[q] = _mm256_load_si256(un + 8 * b + q);
        } else if (base == T_Q8_0) {
            for (int q = 0; q < 8; q++) {
                raw[q] = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * q));
#if GQ_FORM == 2
                wv[q] = _mm256_xor_si256(raw[q], _mm256_set1_epi8((char)0x80));
#else
                wv[q] = _mm256_sign_epi8(raw[q], raw[q]);
#endif
            }
        } else {
            F(r8_unpack)(base, p, wv);
        }
        __m256i is[8]; /* one integer chain per activation row, the rows interleaved (as ilv_rows) */
        for (int r = 0; r < NR; r++)
            is[r] = offset_in_c ? _mm256_set1_epi32(xc[r][b]) : _mm256_setzero_si256();
        for (int q = 0; q < 8; q++)
            for (int r = 0; r < NR; r++) {
                int32_t x4;
                memcpy(&x4, xq[r] + 32 * b + 4 * q, 4);
                const __m256i xv = _mm256_set1_epi32(x4);
#if GQ_FORM == 2
                is[r] = _mm256_dpbusd_epi32(is[r], wv[q], xv);
#else
                is[r] = _mm256_add_epi32(is[r], F(dot)(wv[q], base == T_Q8_0 ? _mm256_sign_epi8(xv, raw[q]) : xv));
#endif
            }
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(sw, _mm256_set1_ps(xd[r][b])), acc[r]);
    }
    for (int r = 0; r < NR; r++)
        _mm256_storeu_ps(out + (long)r * ldo, acc[r]);
}

/* Weight rows [i0, i1) (multiples of 8, or i1 = n) of a repacked weight against activation rows 0 .. rows - 1, 8 at a
   time: out[r * ldo + i - i0]. gguf_matmul's chunks and the fused step's matrix parts (cpu_forward.c mat_part). */
static void F(r8_range)(const int base, const uint8_t *w, long nb, long i0, long i1, const Act *a, int rows, float *out,
                        long ldo) {
    const long gbb = 8 * gguf_block_bytes(base);
    /* Past 8 activation rows a Q4_0 / Q5_0 group's values are unpacked once for all their tiles (Q8_0's need none). */
    __m256i *un = rows > 8 && base != T_Q8_0 ? aligned_alloc(32, (size_t)nb * 8 * sizeof(__m256i)) : NULL;
    for (long i = i0; i < i1; i += 8) {
        const uint8_t *gw = w + (i / 8) * nb * gbb;
        if (un != NULL)
            for (long b = 0; b < nb; b++)
                F(r8_unpack)(base, gw + b * gbb, un + 8 * b);
        for (int r0 = 0; r0 < rows; r0 += 8) {
            float *o = out + (long)r0 * ldo + (i - i0);
#define R8_CASE(N)                                                                                                     \
    case N:                                                                                                            \
        if (base == T_Q8_0)                                                                                            \
            F(r8_rows)(T_Q8_0, gw, nb, a, r0, N, o, ldo, NULL);                                                        \
        else if (base == T_Q5_0)                                                                                       \
            F(r8_rows)(T_Q5_0, gw, nb, a, r0, N, o, ldo, un);                                                          \
        else                                                                                                           \
            F(r8_rows)(T_Q4_0, gw, nb, a, r0, N, o, ldo, un);                                                          \
        break;
            switch (rows - r0 < 8 ? rows - r0 : 8) {
                R8_CASE(1) R8_CASE(2) R8_CASE(3) R8_CASE(4) R8_CASE(5) R8_CASE(6) R8_CASE(7) default: R8_CASE(8)
            }
#undef R8_CASE
        }
    }
    free(un);
}
#undef GQ_CASES
#undef GQ_CASES32
#undef GQ_KERNEL32
#undef GQ_KERNEL
#undef GQ_INLINE
#undef F
#pragma GCC pop_options

#endif /* GQ_SECTION */
