/* Native CPU kernels for one stream's decode step (asyncpage/native.py builds and loads them).

   Why hand-written: at one decode row the work of these ops is microseconds, and what torch spends
   around it is not. One row's attention over its slice of the pool took ~110 us a layer as a
   dozen torch ops around scaled_dot_product_attention (2 ms of a ~20 ms step, measured by replacing
   it with a no-op); here it is one call. Plain C, auto-vectorized (-O3 -march=native): no torch
   headers, so it builds in about a second with the C compiler torch.compile already needs. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One decode row whose context is one contiguous slice of the pool (attention.contiguous_span).
   q [H, D]; k, v [KVH, D]: this token's, written to slot start + ctx - 1 of k_cache / v_cache
   (the pools' base pointers, [slots, KVH, D]); then attends to slots [start + first, start + ctx).
   out [H, D]. Query head h reads KV head h / (H / KVH) (grouped-query attention).
   Returns 0, or -1 if its scratch could not be allocated (nothing is written to out then). */
int attend_span_f32(const float *q, const float *k, const float *v, float *k_cache, float *v_cache,
                    long start, long ctx, long first, int heads, int kv_heads, int dim, float scale,
                    float *out) {
    const long row = (long)kv_heads * dim;
    const long len = ctx - first;
    const int group = heads / kv_heads;
    memcpy(k_cache + (start + ctx - 1) * row, k, (size_t)row * sizeof(float));
    memcpy(v_cache + (start + ctx - 1) * row, v, (size_t)row * sizeof(float));
    float *scores = malloc((size_t)len * sizeof(float));
    if (scores == NULL)
        return -1;
    const float *keys = k_cache + (start + first) * row;
    const float *values = v_cache + (start + first) * row;
    for (int h = 0; h < heads; h++) {
        const float *qh = q + (long)h * dim;
        const long off = (long)(h / group) * dim;
        float top = -INFINITY;
        for (long t = 0; t < len; t++) {
            const float *kr = keys + t * row + off;
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
        float *oh = out + (long)h * dim;
        for (int d = 0; d < dim; d++)
            oh[d] = 0.0f;
        for (long t = 0; t < len; t++) {
            const float *vr = values + t * row + off;
            const float p = scores[t] * inv;
#pragma omp simd
            for (int d = 0; d < dim; d++)
                oh[d] += p * vr[d];
        }
    }
    free(scores);
    return 0;
}
