/* out = x @ w.T (+ bias) in float32, each output summed in an order fixed by its row alone.

   The weights are held in panels of PANEL outputs ([panels][k_len][PANEL], the last panel zero-padded;
   pivotspec/decoding/rowwise.py packs them). Every output element is one chain of fused multiply-adds over
   k = 0, 1, ..., k_len - 1 (written as intrinsics where the CPU has FMA, so that they are fused everywhere or
   nowhere; plain multiply and add elsewhere), then the bias is added. How many rows share the call, which tile
   an element falls in and which thread computes it change nothing, so a row decoded beside others, a token
   verified beside later ones and a prompt computed in one forward all get the bits the lone decode step gets.

   Speed: panels are dealt to threads in groups of LONE_PANELS. A lone row streams its group's panels once
   (four panels' accumulators in registers, so that the chains of dependent multiply-adds overlap): the decode
   step runs near the read bandwidth. More rows go in tiles of TILE_ROWS rows x one panel, the panel staying
   in cache while every row passes over it. */

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define PANEL 16                    /* outputs per panel: must match rowwise.py */
#define VECTORS (PANEL / LANES)     /* machine vectors per panel row */
#define TILE_ROWS 6
#define LONE_PANELS 4

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

/* R rows of x (xs apart) times P panels from w into out (os apart), storing the first `valid` outputs; R and P
   are constants where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const float *w, int64_t k_len,
                                                       const float *bias, float *out, int64_t os, int64_t valid,
                                                       const int R, const int P) {
    vf acc[TILE_ROWS][LONE_PANELS * VECTORS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) acc[r][j] = (vf){0};
    for (int64_t k = 0; k < k_len; k++) {
        vf wv[LONE_PANELS * VECTORS];
        for (int p = 0; p < P; p++)
            for (int v = 0; v < VECTORS; v++) wv[p * VECTORS + v] = load(w + (p * k_len + k) * PANEL + v * LANES);
        for (int r = 0; r < R; r++) {
            vf xk = (vf){0} + x[r * xs + k];
            for (int j = 0; j < P * VECTORS; j++) acc[r][j] = multiply_add(acc[r][j], xk, wv[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) {
            float s[LANES];
            memcpy(s, &acc[r][j], sizeof s);
            for (int l = 0; l < LANES; l++) {
                int64_t n = j * LANES + l;
                if (n < valid) out[r * os + n] = bias ? s[l] + bias[n] : s[l];
            }
        }
}

#define TILE(R, P) case (R) * 16 + (P): tile(x, xs, w, k_len, bias, out, os, valid, R, P); break
static void any_tile(const float *x, int64_t xs, const float *w, int64_t k_len, const float *bias, float *out,
                     int64_t os, int64_t valid, int rows, int panels) {
    switch (rows * 16 + panels) {
    TILE(1, 1); TILE(1, 2); TILE(1, 3); TILE(1, 4);
    TILE(2, 1); TILE(3, 1); TILE(4, 1); TILE(5, 1); TILE(6, 1);
    }
}

/* x [rows, k_len] (rows xs apart, each contiguous), w packed as above for n outputs, bias [n] or NULL,
   out [rows, n] (rows os apart), on `threads` threads of the OpenMP runtime PyTorch runs on. */
int linear(const float *x, int64_t rows, int64_t xs, const float *w, int64_t n, int64_t k_len, const float *bias,
           float *out, int64_t os, int threads) {
    int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + LONE_PANELS - 1) / LONE_PANELS;
    #pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = g * LONE_PANELS, end = first + LONE_PANELS < panels ? first + LONE_PANELS : panels;
        if (rows == 1) {
            int64_t o = first * PANEL;
            any_tile(x, xs, w + first * k_len * PANEL, k_len, bias ? bias + o : NULL, out + o, os, n - o, 1,
                     (int)(end - first));
            continue;
        }
        for (int64_t p = first; p < end; p++) {
            int64_t o = p * PANEL;
            for (int64_t r = 0; r < rows; r += TILE_ROWS) {
                int height = rows - r >= TILE_ROWS ? TILE_ROWS : (int)(rows - r);
                any_tile(x + r * xs, xs, w + p * k_len * PANEL, k_len, bias ? bias + o : NULL, out + r * os + o,
                         os, n - o, height, 1);
            }
        }
    }
    return 0;
}
