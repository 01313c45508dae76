/* out = x @ w.T (+ bias) in float32, each output summed in an order fixed by its row alone.

   The weights are held in panels of PANEL outputs (pivotspec/decoding/rowwise.py packs them), in one of three
   kinds: float32 (`linear`; [panels][k_len][PANEL], the last panel zero-padded), int8 with one float32 scale
   per output (`linear_int8`; the same layout; each int8 weight converted to float32, exactly, as it is read,
   the sum times the scale at the end), or bfloat16 (`linear_bf16`; [panels][k_len / 2][PANEL][2], k_len
   padded to even: the weights of inputs 2i and 2i + 1 side by side, as AVX512-BF16's dot product reads them).
   Every float32 or int8 output element is one chain of fused multiply-adds over k = 0, 1, ..., k_len - 1
   (written as intrinsics where the CPU has FMA, so that they are fused everywhere or nowhere; plain multiply
   and add elsewhere), then scaled (int8) and the bias added. A bfloat16 output rounds the row's inputs to
   bfloat16 (nearest even, subnormals to zero) and is one chain over the pairs of inputs, adding input 2i + 1's
   product and then input 2i's, each add rounded: what VDPBF16PS computes, which runs it where the CPU has
   AVX512-BF16 and the same two fused multiply-adds elsewhere (the products of two bfloat16 are exact in
   float32; the two part only where the instruction flushes a subnormal sum to zero). How many rows share the
   call, which tile an element falls in and which thread computes it change nothing, so a row decoded beside
   others, a token verified beside later ones and a prompt computed in one forward all get the bits the lone
   decode step gets.

   Speed: panels are dealt to threads in groups of LONE_PANELS. A lone row streams its group's panels once
   (four panels' accumulators in registers, so that the chains of dependent multiply-adds overlap): the decode
   step runs near the read bandwidth. More rows go in tiles of TILE_ROWS rows x one panel, the panel staying
   in cache while every row passes over it. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu_unaligned __attribute__((vector_size(4 * LANES), aligned(2), may_alias));

/* the kinds of weights (Linear.q below): the instruction or its emulation for bfloat16 (`linear_bf16` takes the
   instruction where it is compiled in; the emulation is callable alone so that tests can hold one to the other) */
enum { F32 = 0, I8 = 1, BF16 = 2, BF16_EMULATED = 3 };
#if defined(__AVX512BF16__) && LANES == 16
#define NATIVE_BF16 1
#else
#define NATIVE_BF16 0
#endif

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

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* x rounded to bfloat16 as VCVTNEPS2BF16 rounds it: to nearest even, a subnormal to zero, a NaN kept quiet */
static inline uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u & 0x80000000u) >> 16);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* rows of x (xs apart, k_len wide) as bfloat16 pairs [rows][pairs], the odd tail's partner zero */
static void to_pairs(const float *x, int64_t rows, int64_t xs, int64_t k_len, int64_t pairs, uint16_t *out,
                     int native) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        uint16_t *o = out + r * 2 * pairs;
        int64_t k = 0;
#if NATIVE_BF16
        if (native)
            for (; k + 16 <= k_len; k += 16)
                _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
#else
        (void)native;
#endif
        for (; k < k_len; k++) o[k] = bf16_of(xr[k]);
        if (k_len & 1) o[k_len] = 0;
    }
}

/* R rows of x (xs apart; float32, or bfloat16 pairs for the bfloat16 kinds) times P panels from w (of kind Q)
   into out (os apart), storing the first `valid` outputs; R, P and Q are constants where it is inlined, so the
   accumulators stay in registers. `steps`: k_len, or the pairs for bfloat16. */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t xs, const void *w, int64_t steps,
                                                       const float *scales, const float *bias, float *out,
                                                       int64_t os, int64_t valid, const int R, const int P,
                                                       const int Q) {
    vf acc[TILE_ROWS][LONE_PANELS * VECTORS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) acc[r][j] = (vf){0};
    for (int64_t k = 0; k < steps; k++) {
        vf wv[LONE_PANELS * VECTORS], odd[LONE_PANELS * VECTORS];
        for (int p = 0; p < P; p++)
            for (int v = 0; v < VECTORS; v++) {
                int64_t at = (p * steps + k) * PANEL + v * LANES;
                if (Q == F32) wv[p * VECTORS + v] = load((const float *)w + at);
                else if (Q == I8) wv[p * VECTORS + v] = load_int8((const int8_t *)w + at);
                else {  /* LANES outputs' pairs: input 2k's weight in the low half, 2k + 1's in the high */
                    vu u = *(const vu_unaligned *)((const uint16_t *)w + 2 * at);
                    if (Q == BF16 && NATIVE_BF16) {
                        wv[p * VECTORS + v] = (vf)u;  /* the pairs as the instruction reads them */
                    } else {  /* each half as a float32, once for every row */
                        wv[p * VECTORS + v] = (vf)(u << 16);
                        odd[p * VECTORS + v] = (vf)(u & 0xffff0000u);
                    }
                }
            }
        for (int r = 0; r < R; r++) {
            if (Q == F32 || Q == I8) {
                vf xk = splat(((const float *)x)[r * xs + k]);
                for (int j = 0; j < P * VECTORS; j++) acc[r][j] = multiply_add(acc[r][j], xk, wv[j]);
                continue;
            }
            uint32_t pair = ((const uint32_t *)x)[r * xs + k];
#if NATIVE_BF16
            if (Q == BF16) {
                __m512i xp = _mm512_set1_epi32((int)pair);
                for (int j = 0; j < P * VECTORS; j++)
                    acc[r][j] = (vf)_mm512_dpbf16_ps((__m512)acc[r][j], (__m512bh)xp, (__m512bh)wv[j]);
                continue;
            }
#endif
            vf x_odd = splat(from_bits(pair & 0xffff0000u)), x_even = splat(from_bits(pair << 16));
            for (int j = 0; j < P * VECTORS; j++) {
                acc[r][j] = multiply_add(acc[r][j], x_odd, odd[j]);
                acc[r][j] = multiply_add(acc[r][j], x_even, wv[j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P * VECTORS; j++) {
            float s[LANES];
            memcpy(s, &acc[r][j], sizeof s);
            for (int l = 0; l < LANES; l++) {
                int64_t n = j * LANES + l;
                if (n >= valid) continue;
                float value = Q == I8 ? s[l] * scales[n] : s[l];
                out[r * os + n] = bias ? value + bias[n] : value;
            }
        }
}

#define TILE(R, P, Q) \
    case ((R) * 16 + (P)) * 4 + (Q): tile(x, xs, w, steps, scales, bias, out, os, valid, R, P, Q); break
#define TILES(Q) \
    TILE(1, 1, Q); TILE(1, 2, Q); TILE(1, 3, Q); TILE(1, 4, Q); \
    TILE(2, 1, Q); TILE(3, 1, Q); TILE(4, 1, Q); TILE(5, 1, Q); TILE(6, 1, Q)
static void any_tile(const void *x, int64_t xs, const void *w, int64_t steps, const float *scales,
                     const float *bias, float *out, int64_t os, int64_t valid, int rows, int panels, int q) {
    switch ((rows * 16 + panels) * 4 + q) {
    TILES(F32); TILES(I8); TILES(BF16); TILES(BF16_EMULATED);
    }
}

static int run(const float *x, int64_t rows, int64_t xs, const void *w, int64_t n, int64_t k_len,
               const float *scales, const float *bias, float *out, int64_t os, int threads, int q) {
    int64_t panels = (n + PANEL - 1) / PANEL, groups = (panels + LONE_PANELS - 1) / LONE_PANELS;
    const char *bytes = (const char *)w;
    int pairs_in = q == BF16 || q == BF16_EMULATED;
    int64_t steps = pairs_in ? (k_len + 1) / 2 : k_len;
    int64_t size = q == I8 ? 1 : pairs_in ? 4 : (int64_t)sizeof(float), panel_bytes = steps * PANEL * size;
    const void *in = x;
    uint16_t *halves = NULL;
    if (pairs_in) {  /* each row's inputs rounded to bfloat16 once, for every panel */
        halves = malloc((size_t)(rows * 2 * steps) * sizeof *halves);
        if (!halves) return 1;
        to_pairs(x, rows, xs, k_len, steps, halves, q == BF16);
        in = halves;
        xs = steps;
    }
    #pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = g * LONE_PANELS, end = first + LONE_PANELS < panels ? first + LONE_PANELS : panels;
        if (rows == 1) {
            int64_t o = first * PANEL;
            any_tile(in, xs, bytes + first * panel_bytes, steps, scales ? scales + o : NULL,
                     bias ? bias + o : NULL, out + o, os, n - o, 1, (int)(end - first), q);
            continue;
        }
        for (int64_t p = first; p < end; p++) {
            int64_t o = p * PANEL;
            for (int64_t r = 0; r < rows; r += TILE_ROWS) {
                int height = rows - r >= TILE_ROWS ? TILE_ROWS : (int)(rows - r);
                const void *rows_in = pairs_in ? (const void *)((const uint32_t *)in + r * xs)
                                               : (const void *)((const float *)in + r * xs);
                any_tile(rows_in, xs, bytes + p * panel_bytes, steps, scales ? scales + o : NULL,
                         bias ? bias + o : NULL, out + r * os + o, os, n - o, height, 1, q);
            }
        }
    }
    free(halves);
    return 0;
}

/* x [rows, k_len] (rows xs apart, each contiguous), w packed as above for n outputs, bias [n] or NULL,
   out [rows, n] (rows os apart), on `threads` threads of the OpenMP runtime PyTorch runs on. */
int linear(const float *x, int64_t rows, int64_t xs, const float *w, int64_t n, int64_t k_len, const float *bias,
           float *out, int64_t os, int threads) {
    return run(x, rows, xs, w, n, k_len, NULL, bias, out, os, threads, F32);
}

/* The same over int8 panels, output n of each row scaled by scales[n] before its bias. */
int linear_int8(const float *x, int64_t rows, int64_t xs, const int8_t *w, int64_t n, int64_t k_len,
                const float *scales, const float *bias, float *out, int64_t os, int threads) {
    return run(x, rows, xs, w, n, k_len, scales, bias, out, os, threads, I8);
}

/* The same over bfloat16 panels ([panels][(k_len + 1) / 2][PANEL][2]), the inputs rounded to bfloat16; with
   `emulated`, by two fused multiply-adds a pair even where AVX512-BF16 is compiled in (the tests' reference). */
int linear_bf16(const float *x, int64_t rows, int64_t xs, const uint16_t *w, int64_t n, int64_t k_len,
                const float *bias, float *out, int64_t os, int threads, int emulated) {
    return run(x, rows, xs, w, n, k_len, NULL, bias, out, os, threads, emulated ? BF16_EMULATED : BF16);
}

/* whether linear_bf16 runs AVX512-BF16's instructions here (1) or their emulation (0) */
int native_bf16(void) { return NATIVE_BF16; }

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

/* 0, or 1 where the bfloat16 inputs' buffer could not be allocated (the callers raise MemoryError) */
static int apply(const Linear *l, const float *x, int64_t rows, float *out, int threads) {
    return run(x, rows, l->width, l->w, l->outputs, l->width, l->scales, l->bias, out, l->outputs, threads, (int)l->q);
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
    if (apply(&L->qkv, normed, rows, qkv, threads)) return 1;
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
    if (apply(&L->out, attended, rows, delta, threads)) return 1;
    add(x, delta, rows * d);
    norm(x, rows, d, L->norm_post, L->eps_post, normed);
    if (apply(&L->gate_up, normed, rows, hidden, threads)) return 1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i++) {
            float g = hidden[r * 2 * inter + i];
            act[r * inter + i] = g / (1.0f + expf(-g)) * hidden[r * 2 * inter + inter + i];
        }
    if (apply(&L->down, act, rows, delta, threads)) return 1;
    add(x, delta, rows * d);
    return 0;
}
