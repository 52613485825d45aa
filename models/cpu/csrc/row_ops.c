/* A decoder layer's per-token operations on a CPU, one call each: RMSNorm, rotary position
 * embedding, the MLP's SiLU-gated product and the residual add. The arithmetic is the
 * reference's (fp32, rounded to the model's dtype where the reference rounds); compiled with
 * -ffp-contract=off so products and sums round as PyTorch's separate ops do, bit for bit.
 * dtype: 0 fp32, 1 bf16. Rows are computed alike whatever the row count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. Branch-free, so loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t nan = (u >> 16) | 0x40u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float load(int dtype, const void* p, int64_t i) {
    return dtype ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(int dtype, void* p, int64_t i, float v) {
    if (dtype)
        ((uint16_t*)p)[i] = f32_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

/* ROWS runs a row body over t rows with the dtype a constant inside each parallel loop (OpenMP
 * outlines a loop before inlining, so a dtype tested outside would stay a variable and the
 * element loops would not vectorise). Rows run in parallel only where `work` holds. */
#define INLINE static inline __attribute__((always_inline))
#define ROWS(work, ROW)                                            \
    do {                                                           \
        if (work) {                                                \
            if (dtype) {                                           \
                _Pragma("omp parallel for schedule(static)")       \
                for (int64_t r = 0; r < t; r++) ROW(1, r);         \
            } else {                                               \
                _Pragma("omp parallel for schedule(static)")       \
                for (int64_t r = 0; r < t; r++) ROW(0, r);         \
            }                                                      \
        } else if (dtype) {                                        \
            for (int64_t r = 0; r < t; r++) ROW(1, r);             \
        } else {                                                   \
            for (int64_t r = 0; r < t; r++) ROW(0, r);             \
        }                                                          \
    } while (0)

/* y[t] = RMSNorm(x[t]) * w over h features, for t rows (strides in elements). fp32:
 * x * rsqrt(mean(x^2) + eps) * w, as torch's rms_norm; bf16: w * bf16(x * rsqrt(...)), as the
 * reference implementation (the normalised row rounded to bf16 before the weight). */
INLINE void rms_norm_row(int dtype, const void* x, int64_t xs, const void* w, void* y,
                         int64_t ys, int64_t h, float eps, int64_t r) {
    const int64_t xo = r * xs, yo = r * ys;
    float ss = 0.0f;
    for (int64_t i = 0; i < h; i++) {
        const float v = load(dtype, x, xo + i);
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) {
        const float n = load(dtype, x, xo + i) * inv;
        const float wi = load(dtype, w, i);
        store(dtype, y, yo + i, dtype ? wi * bf16_to_f32(f32_to_bf16(n)) : n * wi);
    }
}

int tandem_rms_norm(int dtype, const void* x, int64_t xs, const void* w, void* y, int64_t ys,
                    int64_t t, int64_t h, float eps) {
    if (dtype < 0 || dtype > 1) return -1;
#define NORM(D, R) rms_norm_row(D, x, xs, w, y, ys, h, eps, R)
    ROWS(t > 32, NORM);
    return 0;
}

/* Rotate heads heads of d values per row (x: row stride xs, heads d apart; y: contiguous
 * [t, heads, d]) by cosines c and signed sines s, each [t, d] fp32 (models/layers.py,
 * rotary_tables: (cos, cos) and (-sin, sin)): y = x * c + swap(x) * s, swap exchanging the two
 * halves of a head. */
INLINE void rope_row(int dtype, const void* x, int64_t xs, const float* c, const float* s,
                     void* y, int64_t heads, int64_t d, int64_t r) {
    const int64_t half = d / 2;
    const float* cr = c + r * d;
    const float* sr = s + r * d;
    for (int64_t hd = 0; hd < heads; hd++) {
        const int64_t xo = r * xs + hd * d, yo = (r * heads + hd) * d;
        for (int64_t i = 0; i < d; i++) {
            const int64_t j = i < half ? i + half : i - half;
            const float a = load(dtype, x, xo + i) * cr[i];
            const float b = load(dtype, x, xo + j) * sr[i];
            store(dtype, y, yo + i, a + b);
        }
    }
}

int tandem_rope(int dtype, const void* x, int64_t xs, const float* c, const float* s, void* y,
                int64_t t, int64_t heads, int64_t d) {
    if (dtype < 0 || dtype > 1 || d % 2) return -1;
#define ROPE(D, R) rope_row(D, x, xs, c, s, y, heads, d, R)
    ROWS(t > 32, ROPE);
    return 0;
}

/* e^x, x clamped to [-87, 88]. */
static inline float exp_clamped(float x) {
    return exp_in_range(x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x);
}

#ifdef __AVX512F__
/* The SiLU over 16 lanes by hand: the vectoriser if-converts the clamp into a second division
 * by 1 + e^88, whose subnormal result costs a microcode assist per vector. The operations are
 * exp_in_range's and silu_mul_row's in the same order, so the lanes have the scalar loop's bits. */
static inline __m512 exp_clamped16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                      _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f =
        _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                      _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, f), f), f),
                      _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 load16(int dtype, const void* p, int64_t i) {
    if (!dtype) return _mm512_loadu_ps((const float*)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 on 16 lanes, as 32-bit lanes holding the 16-bit results. */
static inline __m512i to_bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(is_nan, rounded, nan);
}

static inline void store16(int dtype, void* p, int64_t i, __m512 v) {
    if (dtype)
        _mm256_storeu_si256((__m256i*)((uint16_t*)p + i), _mm512_cvtepi32_epi16(to_bf16_16(v)));
    else
        _mm512_storeu_ps((float*)p + i, v);
}
#endif

/* y[t] = silu(g) * u for each of t rows of gu = [g | u] (inter values each; strides in
 * elements): silu(g) in fp32, rounded to the dtype, times u, rounded again, as the reference's
 * two ops round. The modules (models/cpu/row_ops.py) and layer_program.c both call it. */
INLINE void silu_mul_row(int dtype, const void* gu, int64_t gs, void* y, int64_t ys,
                         int64_t inter, int64_t r) {
    const int64_t go = r * gs, yo = r * ys;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (; i + 16 <= inter; i += 16) {
        const __m512 g = load16(dtype, gu, go + i);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
        const __m512 e = exp_clamped16(neg);
        __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        if (dtype) a = _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16_16(a), 16));
        store16(dtype, y, yo + i, _mm512_mul_ps(a, load16(dtype, gu, go + inter + i)));
    }
#endif
#pragma GCC unroll 4 /* four vectors' polynomials in flight: it is latency-bound */
    for (; i < inter; i++) {
        const float g = load(dtype, gu, go + i);
        float a = g / (1.0f + exp_clamped(-g));
        if (dtype) a = bf16_to_f32(f32_to_bf16(a));
        store(dtype, y, yo + i, a * load(dtype, gu, go + inter + i));
    }
}

int tandem_silu_mul(int dtype, const void* gu, int64_t gs, void* y, int64_t ys, int64_t t,
                    int64_t inter) {
    if (dtype < 0 || dtype > 1) return -1;
#define SILU_MUL(D, R) silu_mul_row(D, gu, gs, y, ys, inter, R)
    ROWS(t * inter > 4096, SILU_MUL); /* the exp polynomial makes each element costly */
    return 0;
}

INLINE void add_row(int dtype, void* x, int64_t xs, const void* h, int64_t hs, int64_t n,
                    int64_t r) {
    for (int64_t i = 0; i < n; i++)
        store(dtype, x, r * xs + i, load(dtype, x, r * xs + i) + load(dtype, h, r * hs + i));
}

/* x[t] += h[t] over n values a row (rounded to the dtype, as PyTorch's add rounds). */
int tandem_add(int dtype, void* x, int64_t xs, const void* h, int64_t hs, int64_t t, int64_t n) {
    if (dtype < 0 || dtype > 1) return -1;
#define ADD(D, R) add_row(D, x, xs, h, hs, n, R)
    ROWS(t * n > 65536, ADD);
    return 0;
}
