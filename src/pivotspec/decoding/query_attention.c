/* Attention of each query over exactly the keys it sees, in float32, in an order fixed by the query alone.

   What a query gets depends only on its own vector, its key count n and those n keys and values: not on how
   many queries, rows or padded columns share the call, nor on how the work is split over threads. So a row
   decoded in a batch, or a query verified beside later ones, gets the bits the lone decode step gets, with
   one call per layer instead of one PyTorch attention call per query (pivotspec/decoding/query_attention.py
   says why and how it is built). The arithmetic is written in GCC's vector extension, in the machine's vector
   width, with the softmax's sum kept in 16 lanes at any width, so that its order is the code's and not the
   optimizer's and the same on every CPU;
   compiled with -ffp-contract=off, so that no multiply and add are fused in one place and not in another. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16  /* keys per block: the softmax's sum is a LANES-lane sum over blocks, then a fixed tree */
#define WAYS 4
/* The machine's vectors: 16 floats with AVX-512, else 8 (16-float vectors on AVX2 spilled to memory and ran 4.6x
   slower). Every value is the same at either width: scores and outputs are per key and per column, and the
   softmax's sum keeps LANES lanes as PARTS vectors. */
#if defined(__AVX512F__)
#define VLANES 16
#else
#define VLANES 8
#endif
#define PARTS (LANES / VLANES)

typedef float vf __attribute__((vector_size(4 * VLANES)));
typedef int32_t vi __attribute__((vector_size(4 * VLANES)));
typedef float vf_unaligned __attribute__((vector_size(4 * VLANES), aligned(4), may_alias));

typedef struct {
    const float *q; int64_t q_row, q_head, q_query;              /* [rows, heads, width, dim] in elements */
    const void *k, *v; int bf16; int64_t k_row, k_head, k_key, v_row, v_head, v_key;
    const int64_t *counts;                                        /* [rows * width]: keys each query sees */
    int rows, heads, kv_heads, width, dim, total; float scale;
    float *out;                                                   /* [rows, width, heads, dim], contiguous */
} Work;

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf x) { *(vf_unaligned *)p = x; }
static inline vf splat(float x) { return (vf){0} + x; }

/* exp(x) lane by lane for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-6 polynomial); below -87 it
   gives exp(-87), about 1.6e-38, instead of 0. */
static inline vf exp_nonpositive(vf x) {
    vi low = x < -87.0f;
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    vi k = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  /* x / ln 2 rounded (x <= 0) */
    vf kf = __builtin_convertvector(k, vf);
    vf r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((k + 127) << 23);
}

static inline float lane_sum(const vf *parts) {  /* a fixed tree over the LANES lanes of PARTS vectors */
    float s[LANES];
    for (int p = 0; p < PARTS; p++) memcpy(s + p * VLANES, &parts[p], sizeof(vf));
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int l = 0; l < half; l++) s[l] += s[l + half];
    return s[0];
}

/* One element of a key or value row as float32 (bfloat16 is the high half of a float32). */
static inline float element(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* The first n rows of one key head, `stride` elements apart, as float32: keys transposed ([dim][stride_t]:
   lane l of a block holds key 16b + l, the columns past n zero), values as rows ([n][dim]). The keys go over
   in blocks of LANES keys, so that the block's rows stay in cache while each of its columns is written whole. */
static void to_float(const void *k, const void *v, int bf16, int64_t k_stride, int64_t v_stride, int64_t n,
                     int dim, int64_t stride_t, float *restrict keys, float *restrict values) {
    for (int64_t j0 = 0; j0 < stride_t; j0 += LANES)
        for (int t = 0; t < dim; t++)
            for (int64_t j = j0; j < j0 + LANES; j++)
                keys[t * stride_t + j] = j < n ? element(k, bf16, j * k_stride + t) : 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int t = 0; t < dim; t++) values[j * dim + t] = element(v, bf16, j * v_stride + t);
}

/* One query's attention over its first n keys (none: zeros) into out[dim]. Scores: 16 keys at a time, one per lane, each
   summed over the head's width in order. Weights: exp(score - max), the lanes past n zeroed, summed lane by
   lane over the blocks, then in a fixed tree. Output: the weighted values summed over the keys in order. */
static void attend_query(const float *restrict q, const float *restrict keys, int64_t stride_t,
                         const float *restrict values, int64_t n, int dim, float scale, float *restrict scores,
                         float *restrict out) {
    if (n == 0) {  /* a query that sees nothing (a batch row's padding): zeros */
        memset(out, 0, sizeof(float) * (size_t)dim);
        return;
    }
    int64_t units = (n + VLANES - 1) / VLANES, u = 0;  /* VLANES keys each */
    /* Four units (or four column chunks below) at a time: independent sums that the CPU overlaps; every lane
       is summed in the same order either way. */
    for (; u + WAYS <= units; u += WAYS) {
        vf acc[WAYS] = {{0}};
        for (int t = 0; t < dim; t++)
            for (int w = 0; w < WAYS; w++) acc[w] += q[t] * load(keys + t * stride_t + (u + w) * VLANES);
        for (int w = 0; w < WAYS; w++) store(scores + (u + w) * VLANES, acc[w] * scale);
    }
    for (; u < units; u++) {
        vf acc = {0};
        for (int t = 0; t < dim; t++) acc += q[t] * load(keys + t * stride_t + u * VLANES);
        store(scores + u * VLANES, acc * scale);
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) top = scores[j] > top ? scores[j] : top;
    vf best = splat(top);
    vf sums[PARTS] = {{0}};  /* lane l of part p: the keys LANES * block + p * VLANES + l, block by block */
    for (u = 0; u < units; u++) {
        vf e = exp_nonpositive(load(scores + u * VLANES) - best);
        if ((u + 1) * VLANES > n) {  /* the last unit: lanes past n weigh nothing */
            float tail[VLANES];
            memcpy(tail, &e, sizeof tail);
            for (int64_t l = n - u * VLANES; l < VLANES; l++) tail[l] = 0.0f;
            memcpy(&e, tail, sizeof e);
        }
        store(scores + u * VLANES, e);
        sums[u % PARTS] += e;
    }
    float total = lane_sum(sums);
    int c = 0;
    for (; c + WAYS * VLANES <= dim; c += WAYS * VLANES) {
        vf acc[WAYS] = {{0}};
        for (int64_t j = 0; j < n; j++)
            for (int w = 0; w < WAYS; w++) acc[w] += scores[j] * load(values + j * dim + c + w * VLANES);
        for (int w = 0; w < WAYS; w++) store(out + c + w * VLANES, acc[w] / total);
    }
    for (; c + VLANES <= dim; c += VLANES) {
        vf acc = {0};
        for (int64_t j = 0; j < n; j++) acc += scores[j] * load(values + j * dim + c);
        store(out + c, acc / total);
    }
    for (; c < dim; c++) {  /* a head width that is not a multiple of 16: the last columns one at a time */
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) acc += scores[j] * values[j * dim + c];
        out[c] = acc / total;
    }
}

/* One row's queries of the heads that share key head `group`; the row's keys and values are turned into
   float32 once for all of them. */
static void attend_group(const Work *w, int row, int group, float *keys, float *values, float *scores) {
    int dim = w->dim, per_group = w->heads / w->kv_heads;
    int64_t n_max = 0;
    for (int i = 0; i < w->width; i++) {
        int64_t n = w->counts[(int64_t)row * w->width + i];
        n_max = n > n_max ? n : n_max;
    }
    int64_t stride_t = (n_max + LANES - 1) / LANES * LANES;
    size_t size = w->bf16 ? 2 : 4;
    to_float((const char *)w->k + size * (size_t)(row * w->k_row + group * w->k_head),
             (const char *)w->v + size * (size_t)(row * w->v_row + group * w->v_head), w->bf16, w->k_key,
             w->v_key, n_max, dim, stride_t, keys, values);
    for (int query = 0; query < w->width; query++) {
        int64_t n = w->counts[(int64_t)row * w->width + query];
        for (int head = group * per_group; head < (group + 1) * per_group; head++)
            attend_query(w->q + row * w->q_row + head * w->q_head + query * w->q_query, keys, stride_t, values,
                         n, dim, w->scale, scores,
                         w->out + (((int64_t)row * w->width + query) * w->heads + head) * dim);
    }
}

/* Returns 0, or 1 when scratch memory could not be had (the caller raises MemoryError). The items (a row and
   a key head each) are shared over `threads` threads of OpenMP, the runtime PyTorch's CPU kernels run on,
   loaded once in the process: its threads, not more of them. */
int attend(const float *q, int64_t q_row, int64_t q_head, int64_t q_query,
           const void *k, const void *v, int bf16, int64_t k_row, int64_t k_head, int64_t k_key,
           int64_t v_row, int64_t v_head, int64_t v_key, const int64_t *counts,
           int rows, int heads, int kv_heads, int width, int dim, int total, float scale, float *out, int threads) {
    Work w = {q, q_row, q_head, q_query, k, v, bf16, k_row, k_head, k_key, v_row, v_head, v_key, counts,
              rows, heads, kv_heads, width, dim, total, scale, out};
    int64_t items = (int64_t)rows * kv_heads;
    size_t padded = ((size_t)total + LANES - 1) / LANES * LANES, size = (size_t)dim;
    int failed = 0;
    #pragma omp parallel num_threads(threads > 1 ? threads : 1) reduction(|:failed)
    {
        float *scratch = malloc(sizeof(float) * (2 * padded * size + padded));
        if (!scratch) {
            failed = 1;
        } else {
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++)
                attend_group(&w, (int)(item / kv_heads), (int)(item % kv_heads), scratch,
                             scratch + padded * size, scratch + 2 * padded * size);
            free(scratch);
        }
    }
    return failed;
}
