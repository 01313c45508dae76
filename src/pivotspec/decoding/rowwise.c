/* out = x @ w.T (+ bias) in float32, each output summed in an order fixed by its row alone.

   The weights are held in panels of PANEL outputs ([panels][k_len][PANEL], the last panel zero-padded;
   pivotspec/decoding/rowwise.py packs them), as float32 (`linear`) or as int8 with one float32 scale per output
   (`linear_int8`: each int8 weight converted to float32, exactly, as it is read; the sum times the scale at
   the end). Every output element is one chain of fused multiply-adds over k = 0, 1, ..., k_len - 1 (written as
   intrinsics where the CPU has FMA, so that they are fused everywhere or nowhere; plain multiply and add
   elsewhere), then scaled (int8) and the bias added. How many rows share the call, which tile
   an element falls in and which thread computes it change nothing, so a row decoded beside others, a token
   verified beside later ones and a prompt computed in one forward all get the bits the lone decode step gets.

   Speed: panels are dealt to threads in groups of LONE_PANELS. A lone row streams its group's panels once
   (four panels' accumulators in registers, so that the chains of dependent multiply-adds overlap): the decode
   step runs near the read bandwidth. More rows go in tiles of TILE_ROWS rows x one panel, the panel staying
   in cache while every row passes over it. */

#include <math.h>
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

typedef int8_t vb __attribute__((vector_size(LANES)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }

/* v in every lane, as a broadcast: written `(vf){0} + v`, the compiler kept the add (it must, for -0.0) and the
   6-row tile ran 1.4x slower at 48 rows on AVX2. The sums are the same: no accumulator is ever -0.0. */
static inline vf splat(float v) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(v);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(v);
#else
    return (vf){0} + v;
#endif
}

/* LANES int8 weights as float32 (exact: every int8 is a float32) */
static inline vf load_int8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
#endif
}

static inline vf multiply_add(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* R rows of x (xs apart) times P panels from w (float32, or int8 where Q) into out (os apart), storing the first
   `valid` outputs; R, P and Q are constants where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const void *w, int64_t k_len,
                                                       const float *scales, const float *bias, float *out,
                                                       int64_t os, int64_t valid, const int R, const int P,
                                                       const int Q) {
    vf acc[TILE_ROWS][LONE_PANELS * VECTORS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) acc[r][j] = (vf){0};
    for (int64_t k = 0; k < k_len; k++) {
        vf wv[LONE_PANELS * VECTORS];
        for (int p = 0; p < P; p++)
            for (int v = 0; v < VECTORS; v++) {
                int64_t at = (p * k_len + k) * PANEL + v * LANES;
                wv[p * VECTORS + v] = Q ? load_int8((const int8_t *)w + at) : load((const float *)w + at);
            }
        for (int r = 0; r < R; r++) {
            vf xk = splat(x[r * xs + k]);
            for (int j = 0; j < P * VECTORS; j++) acc[r][j] = multiply_add(acc[r][j], xk, wv[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) {
            float s[LANES];
            memcpy(s, &acc[r][j], sizeof s);
            for (int l = 0; l < LANES; l++) {
                int64_t n = j * LANES + l;
                if (n >= valid) continue;
                float value = Q ? s[l] * scales[n] : s[l];
                out[r * os + n] = bias ? value + bias[n] : value;
            }
        }
}

#define TILE(R, P, Q) \
    case ((R) * 16 + (P)) * 2 + (Q): tile(x, xs, w, k_len, scales, bias, out, os, valid, R, P, Q); break
static void any_tile(const float *x, int64_t xs, const void *w, int64_t k_len, const float *scales,
                     const float *bias, float *out, int64_t os, int64_t valid, int rows, int panels, int q) {
    switch ((rows * 16 + panels) * 2 + q) {
    TILE(1, 1, 0); TILE(1, 2, 0); TILE(1, 3, 0); TILE(1, 4, 0);
    TILE(2, 1, 0); TILE(3, 1, 0); TILE(4, 1, 0); TILE(5, 1, 0); TILE(6, 1, 0);
    TILE(1, 1, 1); TILE(1, 2, 1); TILE(1, 3, 1); TILE(1, 4, 1);
    TILE(2, 1, 1); TILE(3, 1, 1); TILE(4, 1, 1); TILE(5, 1, 1); TILE(6, 1, 1);
    }
}

static int run(const float *x, int64_t rows, int64_t xs, const void *w, int64_t n, int64_t k_len,
               const float *scales, const float *bias, float *out, int64_t os, int threads, int q) {
    int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + LONE_PANELS - 1) / LONE_PANELS;
    const char *bytes = (const char *)w;
    int64_t size = q ? 1 : (int64_t)sizeof(float), panel_bytes = k_len * PANEL * size;
    #pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = g * LONE_PANELS, end = first + LONE_PANELS < panels ? first + LONE_PANELS : panels;
        if (rows == 1) {
            int64_t o = first * PANEL;
            any_tile(x, xs, bytes + first * panel_bytes, k_len, scales ? scales + o : NULL, bias ? bias + o : NULL,
                     out + o, os, n - o, 1, (int)(end - first), q);
            continue;
        }
        for (int64_t p = first; p < end; p++) {
            int64_t o = p * PANEL;
            for (int64_t r = 0; r < rows; r += TILE_ROWS) {
                int height = rows - r >= TILE_ROWS ? TILE_ROWS : (int)(rows - r);
                any_tile(x + r * xs, xs, bytes + p * panel_bytes, k_len, scales ? scales + o : NULL,
                         bias ? bias + o : NULL, out + r * os + o, os, n - o, height, 1, q);
            }
        }
    }
    return 0;
}

/* x [rows, k_len] (rows xs apart, each contiguous), w packed as above for n outputs, bias [n] or NULL,
   out [rows, n] (rows os apart), on `threads` threads of the OpenMP runtime PyTorch runs on. */
int linear(const float *x, int64_t rows, int64_t xs, const float *w, int64_t n, int64_t k_len, const float *bias,
           float *out, int64_t os, int threads) {
    return run(x, rows, xs, w, n, k_len, NULL, bias, out, os, threads, 0);
}

/* The same over int8 panels, output n of each row scaled by scales[n] before its bias. */
int linear_int8(const float *x, int64_t rows, int64_t xs, const int8_t *w, int64_t n, int64_t k_len,
                const float *scales, const float *bias, float *out, int64_t os, int threads) {
    return run(x, rows, xs, w, n, k_len, scales, bias, out, os, threads, 1);
}

/* A Llama decoder layer's work around attention, each row alone (pivotspec/decoding/fused.py): `layer_front`
   is RMSNorm, the fused q/k/v linear and the rotary embedding of q's and k's heads; `layer_back` is the output
   projection and its residual, RMSNorm, the fused gate/up linear, SiLU(gate) * up, the down projection and its
   residual. One call each instead of about 35 PyTorch ops a layer, which cost more than the linears on the
   testbed target's decode step. Every value of a row depends on that row alone (sums in a fixed order, written
   out; -ffp-contract=off), so the promises of the linear above hold for the layer. */


typedef struct { const void *w; const float *scales, *bias; int64_t outputs, width, q; } Linear;
typedef struct {
    const float *norm_in, *norm_post; double eps_in, eps_post;
    Linear qkv, out, gate_up, down;
} Layer;

static void apply(const Linear *l, const float *x, int64_t rows, float *out, int threads) {
    run(x, rows, l->width, l->w, l->outputs, l->width, l->scales, l->bias, out, l->outputs, threads, (int)l->q);
}

/* y = w * (x / sqrt(mean(x^2) + eps)) row by row, as LlamaRMSNorm computes it in float32 */
int norm(const float *x, int64_t rows, int64_t d, const float *w, double eps, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float sum = 0.0f;
        for (int64_t i = 0; i < d; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)d + (float)eps);
        for (int64_t i = 0; i < d; i++) y[r * d + i] = w[i] * (xr[i] * inv);
    }
    return 0;
}

/* heads [rows][stride] starting at column 0, `heads` of them dim wide, turned by the row's cos and signed sin
   (rotate_half's minus folded into the sin's first half): x * cos + roll(x, dim / 2) * sin */
static void rotate(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const float *cos,
                   const float *signed_sin) {
    int64_t half = dim / 2;
    float copy[1024];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *p = x + r * stride + h * dim;
            const float *c = cos + r * dim, *s = signed_sin + r * dim;
            memcpy(copy, p, dim * sizeof(float));
            for (int64_t i = 0; i < dim; i++) p[i] = copy[i] * c[i] + copy[i < half ? i + half : i - half] * s[i];
        }
}

/* x [rows, d] -> qkv [rows, qkv outputs], its first `turned` heads rotated; normed [rows, d] is scratch */
int layer_front(const Layer *L, const float *x, int64_t rows, const float *cos, const float *signed_sin,
                int64_t turned, int64_t dim, float *normed, float *qkv, int threads) {
    if (dim > 1024) return 1;
    norm(x, rows, L->qkv.width, L->norm_in, L->eps_in, normed);
    apply(&L->qkv, normed, rows, qkv, threads);
    rotate(qkv, rows, L->qkv.outputs, turned, dim, cos, signed_sin);
    return 0;
}

static void add(float *x, const float *delta, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += delta[i];
}

/* x [rows, d] += the rest of the layer on attended [rows, heads * dim]; the others are scratch: normed and
   delta [rows, d], hidden [rows, 2 * inter], act [rows, inter] */
int layer_back(const Layer *L, float *x, int64_t rows, const float *attended, float *normed, float *delta,
               float *hidden, float *act, int threads) {
    int64_t d = L->out.outputs, inter = L->down.width;
    apply(&L->out, attended, rows, delta, threads);
    add(x, delta, rows * d);
    norm(x, rows, d, L->norm_post, L->eps_post, normed);
    apply(&L->gate_up, normed, rows, hidden, threads);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i++) {
            float g = hidden[r * 2 * inter + i];
            act[r * inter + i] = g / (1.0f + expf(-g)) * hidden[r * 2 * inter + inter + i];
        }
    apply(&L->down, act, rows, delta, threads);
    add(x, delta, rows * d);
    return 0;
}
