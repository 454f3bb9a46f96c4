/* Native CPU kernels for the compiled decode step (asyncpage/native.py builds and loads them).

   Why hand-written: at a few decode rows the work of attention is microseconds, and what torch
   spends around it is not. One row's attention over its slice of the pool took ~110 us a layer as a
   dozen torch ops around scaled_dot_product_attention (2 ms of a ~20 ms step, measured by replacing
   it with a no-op); the gathering path for other block tables (a shared prefix's blocks, several
   rows) more. Here each is one call. Plain C, auto-vectorized (-O3 -march=native): no torch
   headers, so it builds in about a second with the C compiler torch.compile already needs. */

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
