/* out = x @ w.T (+ bias) in float32, each output an order fixed by its row alone.

   Every output element is one dot product of a row of x and a row of w: lane l of a vector accumulator sums
   the products k = l, l + LANES, l + 2 LANES, ... (fused multiply-adds where the CPU has them, written as
   intrinsics so that they are fused everywhere or nowhere), the lanes are then summed in a fixed tree, the
   tail of k past the last whole vector added in order, then the bias. How many rows share the call, which
   tile an element falls in and which thread computes it change nothing, so a row decoded beside others, a
   token verified beside later ones and a prompt computed in one forward all get the bits the lone decode
   step gets (pivotspec/decoding/rowwise.py says why the kernel exists).

   Speed: outputs are dealt to threads in blocks of BLOCK weight rows, which stay in cache while every row of
   x passes over them; inside a block, tiles of 3 rows x 4 outputs (one row: 8 outputs) keep their
   accumulators in registers. One row reads each weight once: the decode step runs near the read bandwidth. */

#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define BLOCK 48
#define TILE_ROWS 3
#define TILE_OUTPUTS 4
#define LONE_OUTPUTS 8

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef float vf_unaligned __attribute__((vector_size(4 * LANES), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }

static inline vf multiply_add(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline float lane_sum(vf x) {  /* a fixed tree over the lanes */
    float s[LANES];
    memcpy(s, &x, sizeof s);
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int l = 0; l < half; l++) s[l] += s[l + half];
    return s[0];
}

/* R rows of x (xs apart) times O rows of w (k_len apart) into out (os apart); R and O are constants where it
   is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const float *w, int64_t k_len,
                                                       const float *bias, float *out, int64_t os, int R, int O) {
    vf acc[TILE_ROWS][LONE_OUTPUTS];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) acc[r][o] = (vf){0};
    int64_t whole = k_len - k_len % LANES;
    for (int64_t k = 0; k < whole; k += LANES) {
        vf wv[LONE_OUTPUTS];
        for (int o = 0; o < O; o++) wv[o] = load(w + o * k_len + k);
        for (int r = 0; r < R; r++) {
            vf xv = load(x + r * xs + k);
            for (int o = 0; o < O; o++) acc[r][o] = multiply_add(acc[r][o], xv, wv[o]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) {
            float s = lane_sum(acc[r][o]);
            for (int64_t k = whole; k < k_len; k++) s = s + x[r * xs + k] * w[o * k_len + k];
            if (bias) s = s + bias[o];
            out[r * os + o] = s;
        }
}

#define TILE(R, O) case (R) * 16 + (O): tile(x, xs, w, k_len, bias, out, os, R, O); break
static void any_tile(const float *x, int64_t xs, const float *w, int64_t k_len, const float *bias, float *out,
                     int64_t os, int rows, int outputs) {
    switch (rows * 16 + outputs) {
    TILE(1, 1); TILE(1, 2); TILE(1, 3); TILE(1, 4); TILE(1, 5); TILE(1, 6); TILE(1, 7); TILE(1, 8);
    TILE(2, 1); TILE(2, 2); TILE(2, 3); TILE(2, 4);
    TILE(3, 1); TILE(3, 2); TILE(3, 3); TILE(3, 4);
    }
}

/* x [rows, k_len] (rows xs apart, each contiguous), w [n, k_len] contiguous, bias [n] or NULL,
   out [rows, n] (rows os apart), on `threads` threads of the OpenMP runtime PyTorch runs on. */
int linear(const float *x, int64_t rows, int64_t xs, const float *w, int64_t n, int64_t k_len, const float *bias,
           float *out, int64_t os, int threads) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t first = b * BLOCK, end = first + BLOCK < n ? first + BLOCK : n;
        for (int64_t r = 0; r < rows;) {
            int height = rows - r >= TILE_ROWS ? TILE_ROWS : (int)(rows - r);
            int width = height == 1 ? LONE_OUTPUTS : TILE_OUTPUTS;
            for (int64_t j = first; j < end; j += width) {
                int outputs = end - j < width ? (int)(end - j) : width;
                any_tile(x + r * xs, xs, w + j * k_len, k_len, bias ? bias + j : NULL, out + r * os + j, os,
                         height, outputs);
            }
            r += height;
        }
    }
    return 0;
}
