/* y = x W^T on a CPU over weights packed once into column panels: every row computed alike for
 * any number of rows, from one row (a batch-1 decode) to a prompt chunk.
 *
 * Why by hand: greedy speculation stays exact only if a row's bits do not depend on how many
 * rows share the call, which no maintained CPU GEMM promises (oneDNN blocks its reduction by row
 * count; models/cpu/onednn.py works around it at a cost). Each output element is one lane of one
 * accumulator, fed by fused multiply-adds over the input features in order 0, 1, ..., K-1
 * (bf16: pairs 0-1, 2-3, ... by the CPU's bf16 dot-product instruction), whatever tile of rows
 * and panels the element falls in. No horizontal sums, no reassociation (this file is compiled
 * without -ffast-math / -fassociative-math).
 *
 * Layout. W [N, K] is packed in panels of NR = 16 output columns (N padded with zero columns
 * to a multiple of 16): panel p holds columns 16p .. 16p + 15 as [K][16] (fp32, int8) or
 * [K / 2][16][2] (bf16, the pairs the dot-product instruction takes). A K step loads one
 * vector per panel and broadcasts one input feature per row, so the weights stream once per
 * call whatever M is, and a tile of MR rows x NPG panels reuses each load MR times.
 *
 * Kinds: 0 fp32 x, W, y; 1 bf16 x, W, y (fp32 accumulation, rounded to nearest even at the
 * end; needs AVX512-BF16); 2 int8 W with one fp32 scale per output column, fp32 x and y
 * (the int8 values are converted to fp32 in registers, so the weights stream at one byte a
 * value); 3 the same int8 W multiplied in integers, bf16 x and y (needs AVX512-VNNI and
 * -BF16): see "int8 by digits" below.
 *
 * int8 by digits (kind 3). Kind 2 spends three instructions on every 16 weights (widen,
 * convert, multiply-add) and converts each weight again for every tile of rows, so a batch
 * costs it more than fp32 weights do; in a bf16 model it also widens every input and narrows
 * every output. The CPU's int8 dot-product instruction multiplies 64 weight bytes by 4 input
 * bytes in one. Each bf16 input row is written exactly enough as an integer,
 * q = round(x * (127 * 256 / max|x|)) (in double, ties to even), which counts steps of
 * step = max|x| / (127 * 256): 16 bits relative to the row's largest value, twice a bf16
 * significand; q is split into two signed base-256 digits
 * (q = 256 d0 + d1, each in [-128, 127]). Each digit row times the weights is an exact int32
 * sum; the two sums are combined exactly in int64 and scaled once, in double, by step and the
 * column's scale: y = bf16((sum_k q_k w_k) * step * scale). This is the weight-only int8
 * product with x rounded to q, not an 8-bit activation. Integer sums have no order, so row
 * invariance holds trivially. The instruction takes an unsigned byte times a signed one: W is
 * stored as w + 128 and each digit row's sum of digits times 128 is taken back off. K is padded
 * to a multiple of 4 (digits 0 there). fp32 models keep kind 2: at their precision (24-bit
 * digits, three rows) the instruction saves nothing on this kind of CPU.
 *
 * Work is split over the panels, a contiguous run per OpenMP thread of the runtime torch
 * itself uses (the library links the libgomp torch loaded); every element is computed by one
 * thread, so the split does not change its bits either. A prompt's rows go in blocks of MB: a
 * block's inputs stay in L2 beside a group's weights while its tiles run, where a whole prompt
 * chunk would come from L3 again for every group. fp32 from a few rows on also goes in blocks
 * of KB input features (K steps), each tile's partial sums waiting in y between them, so that
 * a group's weights for a block sit in L1 while its tiles run (see tandem_panel_linear_side).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NR 16  /* output columns per panel: one 16-float vector */
/* Tile shapes. A tile of MR rows x NPG panels makes MR x NPG multiply-adds per MR + NPG loads;
 * its accumulators and weight vectors share the 32 vector registers. fp32 and int8 weights take
 * 8 x 3, so a decode step's 8, 16 or 32 rows are whole tiles; bf16 keeps 6 x 4: at a few rows
 * its step is bound by the weight stream, and four panels keep more of it in flight. */
#define MR 6    /* rows per tile: bf16 and int8 by digits (digit rows) */
#define NPG 4   /* panels per tile (and per unit of work): bf16 and int8 by digits */
#define MR32 8  /* the same for the fp32-arithmetic kinds, fp32 and int8 weights */
#define NPG32 3
#define MB 192 /* rows per block (a multiple of MR and of MR32) */
#define FETCH_TILES 8 /* fp32: the most tiles of a block that fetch the next group ahead */
#define KB 128 /* fp32 from KB_MIN_ROWS rows on: K steps per block */
#define KB_MIN_ROWS 4

typedef float v16f __attribute__((vector_size(64)));
typedef int8_t v16b __attribute__((vector_size(16)));

/* a in every lane. By the broadcast instruction where there is one: the portable 0 + a is a
 * vector add the compiler must keep (it turns -0 into +0), one more instruction on the
 * multiply-add ports for every row of every K step. The two give the same sums: a product
 * with -0 or +0 added to an accumulator that starts at +0 never leaves it -0. */
static inline v16f splat(float a) {
#ifdef __AVX512F__
    const __m512 r = _mm512_set1_ps(a);
    v16f v;
    memcpy(&v, &r, sizeof v);
    return v;
#else
    return (v16f){} + a;
#endif
}

static inline v16f load_f32(const float* p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16f load_i8(const int8_t* p) {
#ifdef __AVX512F__
    __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    v16f v;
    memcpy(&v, &r, sizeof v);
    return v;
#else
    v16b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v16f);
#endif
}

/* Columns n0 .. of a panel's result into row y (the last panel may be partly padding). */
static inline void store_f32(float* y, int64_t n0, int64_t n, v16f v) {
    if (n0 + NR <= n) {
        memcpy(y + n0, &v, sizeof v);
    } else {
        float t[NR];
        memcpy(t, &v, sizeof t);
        for (int64_t c = 0; n0 + c < n; c++) y[n0 + c] = t[c];
    }
}

/* bench.panel_matmul's baseline build compiles every fetch of weights ahead out */
#ifdef TANDEM_NO_FETCH_AHEAD
#define FETCHES 0
#else
#define FETCHES 1
#endif

/* The next group of panels' weights, brought into L2 a few lines at each K step of the tiles
 * after a group's first: that tile streams the group from memory, the ones after it compute
 * from cache and would leave the memory idle, and the next group's first tile would then wait
 * on it. base: where this tile's share starts (NULL: nothing to fetch); lines: 64-byte lines a
 * K step; left: bytes of the group from base on. Prefetches change no value. */
typedef struct {
    const char* base;
    int64_t lines, left;
    /* Side data to bring into cache over the call (tandem_panel_linear_side): lines from..
     * from + count of regions sides[] of per lines each, slines a K step. */
    const char* const* sides;
    int64_t per, from, count, slines;
} Ahead;

static inline __attribute__((always_inline)) void fetch_ahead(Ahead a, int64_t step) {
    if (!FETCHES) return;
    if (a.base)
        for (int64_t l = 0; l < a.lines; l++) {
            const int64_t at = (step * a.lines + l) * 64;
            if (at < a.left) __builtin_prefetch(a.base + at, 0, 2); /* into L2 */
        }
    for (int64_t l = 0; l < a.slines; l++) {
        const int64_t at = step * a.slines + l;
        if (at >= a.count) break;
        const int64_t line = a.from + at;
        __builtin_prefetch(a.sides[line / a.per] + line % a.per * 64, 0, 2);
    }
}

/* One tile of fp32 rows x[0 .. mr) times panels w[0 .. np) (each K * NR values apart) of fp32
 * weights, or of int8 weights times their columns' scale. mr, np, i8 and fetch are constants
 * at every call site, so the accumulators live in registers, the weight type costs no branch,
 * and a tile with nothing to fetch ahead (fetch 0) has no trace of it in its K loop: the
 * fetch's bookkeeping alone, kept live across the loop, slows it by a few percent. */
static inline __attribute__((always_inline)) void tile_fp32_acc(int mr, int np, int i8, int fetch,
                                                               const float* x, int64_t xs,
                                                               const void* w, const float* scale,
                                                               int64_t k_, float* y, int64_t ys,
                                                               int64_t n0, int64_t n,
                                                               Ahead ahead) {
    v16f acc[MR32][NPG32];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) acc[i][j] = (v16f){};
    for (int64_t k = 0; k < k_; k++) {
        if (fetch) fetch_ahead(ahead, k);
        v16f wv[NPG32];
        for (int j = 0; j < np; j++) {
            const int64_t at = ((int64_t)j * k_ + k) * NR;
            wv[j] = i8 ? load_i8((const int8_t*)w + at) : load_f32((const float*)w + at);
        }
        for (int i = 0; i < mr; i++) {
            const v16f b = splat(x[i * xs + k]);
            for (int j = 0; j < np; j++) acc[i][j] = acc[i][j] + b * wv[j]; /* one FMA */
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) {
            v16f r = acc[i][j];
            if (i8) r = r * load_f32(scale + n0 + j * NR); /* padded to whole panels */
            store_f32(y + i * ys, n0 + j * NR, n, r);
        }
}

/* One tile of K-blocked fp32 (see tandem_panel_linear_side): K steps k0 .. k1 of rows x
 * [0 .. mr) times panels w[0 .. np), from zero (k0 = 0) or on from the partial sums in y,
 * which it leaves there: each output still sums its K products in order from zero. With
 * fetch, K step k0 + l also asks for line l of each of npf slices pf[] (of lines lines) into
 * L2. mr, np and fetch are constants at every call site. */
static inline __attribute__((always_inline)) void tile_kb(int mr, int np, int fetch,
                                                         const float* x, int64_t xs,
                                                         const float* w, int64_t k_, int64_t k0,
                                                         int64_t k1, float* y, int64_t ys,
                                                         int64_t n0, int64_t n,
                                                         const char* const* pf, int npf,
                                                         int64_t lines) {
    v16f acc[MR32][NPG32];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) {
            const int64_t c0 = n0 + j * NR;
            if (k0 == 0) {
                acc[i][j] = (v16f){};
            } else if (c0 + NR <= n) {
                acc[i][j] = load_f32(y + i * ys + c0);
            } else { /* the last panel's padding columns were never stored */
                float t[NR] = {0};
                for (int64_t c = 0; c0 + c < n; c++) t[c] = y[i * ys + c0 + c];
                memcpy(&acc[i][j], t, sizeof t);
            }
        }
    for (int64_t k = k0; k < k1; k++) {
        if (fetch && k - k0 < lines)
            for (int q = 0; q < npf; q++) __builtin_prefetch(pf[q] + (k - k0) * 64, 0, 2);
        v16f wv[NPG32];
        for (int j = 0; j < np; j++) wv[j] = load_f32(w + ((int64_t)j * k_ + k) * NR);
        for (int i = 0; i < mr; i++) {
            const v16f b = splat(x[i * xs + k]);
            for (int j = 0; j < np; j++) acc[i][j] = acc[i][j] + b * wv[j]; /* one FMA */
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) store_f32(y + i * ys, n0 + j * NR, n, acc[i][j]);
}

#if defined(__AVX512BF16__)
#define HAVE_BF16 1
static inline __attribute__((always_inline)) void tile_bf16(int mr, int np, int fetch,
                                                           const uint16_t* x,
                                                           int64_t xs, const uint16_t* w,
                                                           int64_t k_, uint16_t* y, int64_t ys,
                                                           int64_t n0, int64_t n, Ahead ahead) {
    __m512 acc[MR][NPG];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_; k += 2) {
        if (fetch) fetch_ahead(ahead, k / 2);
        __m512bh wv[NPG];
        for (int j = 0; j < np; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + ((int64_t)j * k_ + k) * NR);
        for (int i = 0; i < mr; i++) {
            uint32_t pair;
            memcpy(&pair, x + i * xs + k, sizeof pair);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < np; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], b, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) {
            const int64_t c0 = n0 + j * NR;
            const __m256bh h = _mm512_cvtneps_pbh(acc[i][j]);
            if (c0 + NR <= n) {
                memcpy(y + i * ys + c0, &h, sizeof h);
            } else {
                uint16_t t[NR];
                memcpy(t, &h, sizeof t);
                for (int64_t c = 0; c0 + c < n; c++) y[i * ys + c0 + c] = t[c];
            }
        }
}
#else
#define HAVE_BF16 0
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512DQ__) && HAVE_BF16
#define HAVE_DIGITS 1
#define ND 2 /* digits per bf16 row (digit_rows writes two) */

static inline float bf16_at(const uint16_t* p) {
    const uint32_t u = (uint32_t)*p << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Sixteen bf16 values as fp32 (exact). */
static inline __m512 bf16x16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* q = round(v * inv) (ties to even, in double), clamped to [-top, top], as two digits: the
 * low one ((q + 128) mod 256) - 128 and the high one (q - low) / 256, exact. */
static inline void digits16(__m512 v, __m512d inv, __m512d top, __m512i* hi, __m512i* lo) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m512d neg = _mm512_sub_pd(_mm512_setzero_pd(), top);
    a = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(a, inv), mode), neg), top);
    b = _mm512_min_pd(_mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(b, inv), mode), neg), top);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtpd_epi32(a)),
                                         _mm512_cvtpd_epi32(b), 1);
    const __m512i c128 = _mm512_set1_epi32(128);
    *lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, c128), _mm512_set1_epi32(255)),
                           c128);
    *hi = _mm512_srai_epi32(_mm512_sub_epi32(q, *lo), 8);
}

/* Row r of x (bf16) as ND digit rows of kp bytes at q + r * ND * kp, the most significant
 * first, zero past k; dsum[r * ND + d] the sum of digit row d; step[r] what q counts (NaN for
 * a row holding a NaN or an infinity, so that row's outputs are NaN as they would be in
 * floating point). Sixteen values at a time: a call's rows are written before its threads
 * start, by one thread. */
static void digit_rows(const uint16_t* x, int64_t xs, int64_t r, int64_t k, int64_t kp,
                       int8_t* q, int32_t* dsum, double* step) {
    const uint16_t* xr = x + r * xs;
    const int64_t k16 = k / 16 * 16;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0; /* lanes that saw a NaN or an infinity */
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int64_t i = 0; i < k16; i += 16) {
        const __m512 a = _mm512_abs_ps(bf16x16(xr + i));
        bad |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a, inf, _CMP_EQ_OQ);
        vmax = _mm512_max_ps(vmax, a);
    }
    float amax = _mm512_reduce_max_ps(vmax);
    for (int64_t i = k16; i < k; i++) {
        const float a = fabsf(bf16_at(xr + i));
        amax = a > amax || a != a ? a : amax; /* a NaN wins */
    }
    int8_t* rows = q + r * ND * kp;
    memset(rows, 0, (size_t)(ND * kp));
    for (int d = 0; d < ND; d++) dsum[r * ND + d] = 0;
    if (bad || !isfinite(amax)) {
        step[r] = NAN;
        return;
    }
    const double top = 127.0 * 256.0; /* |q| <= top: the top digit stays in [-127, 127] */
    step[r] = (double)amax / top;
    if (amax == 0.0f) return;
    const double inv = top / (double)amax;
    const __m512d vinv = _mm512_set1_pd(inv), vtop = _mm512_set1_pd(top);
    __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
    for (int64_t i = 0; i < k16; i += 16) {
        __m512i hi, lo;
        digits16(bf16x16(xr + i), vinv, vtop, &hi, &lo);
        _mm512_mask_cvtepi32_storeu_epi8(rows + i, 0xFFFF, hi);
        _mm512_mask_cvtepi32_storeu_epi8(rows + kp + i, 0xFFFF, lo);
        sum_hi = _mm512_add_epi32(sum_hi, hi);
        sum_lo = _mm512_add_epi32(sum_lo, lo);
    }
    dsum[r * ND] = _mm512_reduce_add_epi32(sum_hi);
    dsum[r * ND + 1] = _mm512_reduce_add_epi32(sum_lo);
    for (int64_t i = k16; i < k; i++) {
        const double t = nearbyint((double)bf16_at(xr + i) * inv);
        int64_t qv = (int64_t)(t > top ? top : t < -top ? -top : t);
        for (int d = ND - 1; d >= 0; d--) { /* least significant first */
            const int64_t dig = ((qv + 128) & 255) - 128;
            rows[d * kp + i] = (int8_t)dig;
            dsum[r * ND + d] += (int32_t)dig;
            qv = (qv - dig) / 256;
        }
    }
}

/* acc + the int8 dot products of w's unsigned and b's signed bytes, four to a lane. In
 * assembly because GCC copies the accumulator around the intrinsic (two register moves for
 * every dot product, which tripled the tile loop's instructions). */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i w, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b));
    return acc;
}

/* One tile of mr digit rows (mr / ND rows of x) times panels w[0 .. np) (each kp * NR bytes
 * apart, [kp / 4][16][4] of w + 128), combined and scaled into bf16 rows of y. */
static inline __attribute__((always_inline)) void tile_digits(
    int mr, int np, const int8_t* q, int64_t kp, const int32_t* dsum, const double* step,
    const uint8_t* w, const float* scale, uint16_t* y, int64_t ys, int64_t n0, int64_t n) {
    __m512i acc[MR][NPG];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < kp; k += 4) {
        __m512i wv[NPG];
        for (int j = 0; j < np; j++) {
            /* This loop spends twice the instructions of the bf16 one on each line of weights,
             * so fewer lines are in flight: ask for the line 2 KB ahead into L2 (past the end
             * of the weight a prefetch does nothing; it never faults). */
            _mm_prefetch((const char*)(w + ((int64_t)j * kp + k) * NR) + 2048, _MM_HINT_T1);
            wv[j] = _mm512_loadu_si512(w + ((int64_t)j * kp + k) * NR);
        }
        for (int i = 0; i < mr; i++) {
            int32_t four;
            memcpy(&four, q + i * kp + k, sizeof four);
            const __m512i b = _mm512_set1_epi32(four);
            for (int j = 0; j < np; j++) acc[i][j] = dpbusd(acc[i][j], wv[j], b);
        }
    }
    for (int r = 0; r < mr / ND; r++)
        for (int j = 0; j < np; j++) {
            /* sum_k q_k w_k = sum over digits of 256^(ND-1-d) (digit row d's sum, less 128
             * times its digits' sum), exact in int64: lanes 0-7 in lo, 8-15 in hi */
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int d = 0; d < ND; d++) {
                const __m512i c = _mm512_sub_epi32(
                    acc[r * ND + d][j], _mm512_set1_epi32(128 * dsum[r * ND + d]));
                lo = _mm512_add_epi64(_mm512_slli_epi64(lo, 8),
                                      _mm512_cvtepi32_epi64(_mm512_castsi512_si256(c)));
                hi = _mm512_add_epi64(_mm512_slli_epi64(hi, 8),
                                      _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(c, 1)));
            }
            const int64_t c0 = n0 + j * NR;
            const __m512 sc = _mm512_loadu_ps(scale + c0); /* padded to whole panels */
            const __m256 sc_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sc), 1));
            const __m512d st = _mm512_set1_pd(step[r]);
            const __m512d dl = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(lo), st),
                                             _mm512_cvtps_pd(_mm512_castps512_ps256(sc)));
            const __m512d dh = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(hi), st),
                                             _mm512_cvtps_pd(sc_hi));
            const __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(dl)),
                                                _mm512_cvtpd_ps(dh), 1);
            const __m256bh h = _mm512_cvtneps_pbh(f);
            uint16_t t[NR];
            memcpy(t, &h, sizeof t);
            uint16_t* yr = y + r * ys;
            for (int64_t c = 0; c < NR && c0 + c < n; c++) yr[c0 + c] = t[c];
        }
}
#else
#define HAVE_DIGITS 0
#endif

/* Every (rows, panels) shape a tile can have, each with constant bounds: up to 6 rows and 4
 * or 1 panels (BY_SHAPE), up to 8 rows and 3 or 1 panels (BY_SHAPE32). */
#define BY_ROWS_6(TILE, NP)             \
    switch (mr) {                       \
        case 6: TILE(6, NP); break;     \
        case 5: TILE(5, NP); break;     \
        case 4: TILE(4, NP); break;     \
        case 3: TILE(3, NP); break;     \
        case 2: TILE(2, NP); break;     \
        default: TILE(1, NP); break;    \
    }
#define BY_ROWS_8(TILE, NP)             \
    switch (mr) {                       \
        case 8: TILE(8, NP); break;     \
        case 7: TILE(7, NP); break;     \
        default: BY_ROWS_6(TILE, NP)    \
    }
#define BY_SHAPE(TILE)                  \
    if (np == NPG) {                    \
        BY_ROWS_6(TILE, NPG)            \
    } else {                            \
        BY_ROWS_6(TILE, 1)              \
    }
#define BY_SHAPE32(TILE)                \
    if (np == NPG32) {                  \
        BY_ROWS_8(TILE, NPG32)          \
    } else {                            \
        BY_ROWS_8(TILE, 1)              \
    }

/* y [n, 16] row i = fp32 row x[rows[i]] (row stride xs) times the one fp32 panel
 * panels[i] of W, each lane by the fused multiply-adds of tile_fp32_acc in the same order from
 * the same zero, so its bits are those tandem_panel_linear gives that row and column. For the
 * LM head's bf16 screen (models/cpu/greedy_head.py): the few panels per row that could hold the
 * row's argmax, computed exactly without the panels other rows need. */
void tandem_panel_pairs(const float* x, int64_t xs, const float* w, int64_t k,
                        const int64_t* rows, const int64_t* panels, int64_t n, float* y) {
    for (int64_t i = 0; i < n; i++) {
        const float* xr = x + rows[i] * xs;
        const float* wp = w + panels[i] * k * NR;
        v16f acc = (v16f){};
        for (int64_t j = 0; j < k; j++) acc = acc + splat(xr[j]) * load_f32(wp + j * NR);
        memcpy(y + i * NR, &acc, sizeof acc);
    }
}

/* The 16-column panels of bf16 rows s [m, v] (row stride ss) that hold a value >= their row's
 * bound low[r]: their rows and panels, by row then panel, into rows and panels (room for cap
 * pairs); returns how many there are (more than cap: the first cap are written). For the LM
 * head's screen (models/cpu/greedy_head.py): a pass over the screened logits that keeps only the
 * panels to compute exactly. */
int64_t tandem_bf16_panels_at_least(const uint16_t* s, int64_t ss, int64_t m, int64_t v,
                                    const float* low, int64_t* rows, int64_t* panels,
                                    int64_t cap) {
    int64_t q = 0;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t* sr = s + r * ss;
        const float t = low[r];
        for (int64_t c = 0; c < v; c += NR) {
            int hit = 0;
#ifdef __AVX512F__
            if (c + NR <= v) {
                const __m256i h = _mm256_loadu_si256((const __m256i*)(sr + c));
                const __m512 f =
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                hit = _mm512_cmp_ps_mask(f, _mm512_set1_ps(t), _CMP_GE_OQ) != 0;
            } else
#endif
                for (int64_t j = c; j < v && j < c + NR && !hit; j++) {
                    const uint32_t u = (uint32_t)sr[j] << 16;
                    float f;
                    memcpy(&f, &u, sizeof f);
                    hit = f >= t;
                }
            if (hit) {
                if (q < cap) rows[q] = r, panels[q] = c / NR;
                q++;
            }
        }
    }
    return q;
}

/* Whether bf16 (kind 1) is compiled in: the CPU has the bf16 dot-product instruction. */
int tandem_panel_bf16(void) { return HAVE_BF16; }

/* Whether the tiles run in 16-float registers. Elsewhere (AVX2: 16 registers of 8 floats) a
 * tile's 24 accumulators spill, and oneDNN's matmul is 1.8-17x faster (bench.panel_fallback). */
int tandem_panel_vector(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Whether int8 by digits (kind 3) is compiled in: the CPU has the int8 and the bf16
 * dot-product instructions. */
int tandem_panel_digits(void) { return HAVE_DIGITS; }

#if HAVE_DIGITS
/* Kind 3 (see "int8 by digits"): the rows' digits first, then tiles as the other kinds run
 * them, of MR / ND rows (MR digit rows) at a time. */
static int digits_linear(const uint16_t* x, int64_t xs, const uint8_t* w, const float* scale,
                         uint16_t* y, int64_t ys, int64_t m, int64_t n, int64_t k) {
    const int64_t kp = (k + 3) / 4 * 4, panels = (n + NR - 1) / NR;
    if (m == 0 || n == 0) return 0;
    int8_t* q = malloc((size_t)(m * ND * kp));
    int32_t* dsum = malloc(sizeof(int32_t) * (size_t)(m * ND));
    double* step = malloc(sizeof(double) * (size_t)m);
    if (!q || !dsum || !step) {
        free(q), free(dsum), free(step);
        return -3;
    }
#pragma omp parallel for schedule(static) if (m > 8)
    for (int64_t r = 0; r < m; r++) digit_rows(x, xs, r, k, kp, q, dsum, step);
    const int64_t per_tile = MR / ND;
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = panels * tid / nth, last = panels * (tid + 1) / nth;
        for (int64_t p0 = first; p0 < last; p0 += NPG) {
            const int64_t pc = last - p0 < NPG ? last - p0 : NPG;
            for (int64_t m0 = 0; m0 < m; m0 += per_tile) {
                const int rows = m - m0 < per_tile ? (int)(m - m0) : (int)per_tile;
                const int8_t* qr = q + m0 * ND * kp;
                const int32_t* sr = dsum + m0 * ND;
                for (int64_t p = p0; p < p0 + pc;) {
                    const int np = pc == NPG ? NPG : 1;
                    const uint8_t* wp = w + p * kp * NR;
#define TILE_D(a, b) \
    tile_digits(a, b, qr, kp, sr, step + m0, wp, scale, y + m0 * ys, ys, p * NR, n)
                    switch (rows * 8 + np) {
                        case 3 * 8 + 4: TILE_D(6, 4); break;
                        case 2 * 8 + 4: TILE_D(4, 4); break;
                        case 1 * 8 + 4: TILE_D(2, 4); break;
                        case 3 * 8 + 1: TILE_D(6, 1); break;
                        case 2 * 8 + 1: TILE_D(4, 1); break;
                        default: TILE_D(2, 1); break;
                    }
                    p += np;
                }
            }
        }
    }
    free(q), free(dsum), free(step);
    return 0;
}
#endif

/* y [M, N] (row stride ys) = x [M, K] (row stride xs) times the packed W (see above); kind as
 * above, scale [N rounded up to 16] for int8. Returns 0, or -1 for a kind this build lacks,
 * -2 for a K the kind cannot take (bf16: odd; digits: over 65,536), -3 out of memory. */
int tandem_panel_linear_side(int kind, const void* x, int64_t xs, const void* w,
                             const float* scale, void* y, int64_t ys, int64_t m, int64_t n,
                             int64_t k, const char* const* sides, int64_t nsides,
                             int64_t side_bytes);

int tandem_panel_linear(int kind, const void* x, int64_t xs, const void* w, const float* scale,
                        void* y, int64_t ys, int64_t m, int64_t n, int64_t k) {
    return tandem_panel_linear_side(kind, x, xs, w, scale, y, ys, m, n, k, NULL, 0, 0);
}

/* tandem_panel_linear, also bringing nsides regions of side_bytes each (sides[i]) into cache
 * over the call, a few lines at each K step of every tile: memory the caller reads next (the
 * next layer's KV blocks, layer_program.c) streams while the matmul computes.
 * Prefetches change no value. Kind 3 takes none. */
int tandem_panel_linear_side(int kind, const void* x, int64_t xs, const void* w,
                             const float* scale, void* y, int64_t ys, int64_t m, int64_t n,
                             int64_t k, const char* const* sides, int64_t nsides,
                             int64_t side_bytes) {
    if (kind == 1 && !HAVE_BF16) return -1;
    if (kind < 0 || kind > 3) return -1;
    if (kind == 1 && k % 2) return -2;
    if (kind == 3) {
#if HAVE_DIGITS
        if (k > 65536) return -2; /* a digit row's int32 sum could overflow */
        return digits_linear(x, xs, w, scale, y, ys, m, n, k);
#else
        return -1;
#endif
    }
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t wbytes = kind == 0 ? 4 : kind == 1 ? 2 : 1;
    const int64_t tile_rows = kind == 1 ? MR : MR32, group = kind == 1 ? NPG : NPG32;
#pragma omp parallel
    {
        /* each thread a contiguous run of panels, as even as whole panels allow (a layer's
         * few dozen panels split in groups would leave one thread a group more) */
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = panels * tid / nth, last = panels * (tid + 1) / nth;
        const int64_t tiles = (m + tile_rows - 1) / tile_rows;
        const int64_t steps = kind == 1 ? k / 2 : k; /* K steps of a tile */
        /* this thread's share of the side lines, spread evenly over its (group, tile) units */
        const int64_t per = (side_bytes + 63) / 64, total = nsides * per;
        const int64_t s0 = total * tid / nth, s1 = total * (tid + 1) / nth;
        const int64_t units = (last - first + group - 1) / group * tiles;
        if (kind == 0 && m >= KB_MIN_ROWS && nsides == 0) {
            /* fp32 from KB_MIN_ROWS rows on, K-blocked within each block of MB rows: a
             * group's tiles take its first KB K steps, then the next KB, ... (tile_kb). A
             * block's weights (a group's panels x KB x 64 bytes) stay in L1 over its tiles,
             * and the tiles after the first bring the next block's (the group's next, or the
             * next group's first) into L2, a line a K step of each panel they take: the tiles
             * read their weights from L1, which leaves the core's line fill buffers to the
             * fetch. (With side data to fetch, the path below takes the call.) */
            for (int64_t mb = 0; mb < m; mb += MB) {
            const int64_t mend = mb + MB < m ? mb + MB : m;
            const int64_t btiles = (mend - mb + tile_rows - 1) / tile_rows; /* this block's */
            for (int64_t p0 = first; p0 < last; p0 += group) {
                const int64_t pc = last - p0 < group ? last - p0 : group;
                for (int64_t k0 = 0; k0 < k; k0 += KB) {
                    const int64_t k1 = k0 + KB < k ? k0 + KB : k;
                    int64_t fp0 = p0, fk0 = k1; /* the next block */
                    if (fk0 >= k) fp0 = p0 + pc, fk0 = 0;
                    const int64_t fnp = last - fp0 < group ? last - fp0 : group;
                    const int64_t lines = (fk0 + KB < k ? fk0 + KB : k) - fk0;
                    /* the tiles that fetch: those after the first (a lone tile itself) */
                    const int64_t t0 = btiles > 1;
                    for (int64_t m0 = mb; m0 < mend; m0 += tile_rows) {
                        const int mr = mend - m0 < tile_rows ? (int)(mend - m0) : (int)tile_rows;
                        const int64_t t = (m0 - mb) / tile_rows;
                        const char* pf[NPG32];
                        int npf = 0;
                        if (FETCHES && t >= t0) /* panels t - t0, t - t0 + (tiles - t0), ... */
                            for (int64_t j = t - t0; j < fnp; j += btiles - t0)
                                pf[npf++] = (const char*)w + ((fp0 + j) * k + fk0) * NR * 4;
                        for (int64_t p = p0; p < p0 + pc;) {
                            const int np = pc == group ? (int)group : 1;
                            const float* wp = (const float*)w + p * k * NR;
                            const float* xr = (const float*)x + m0 * xs;
                            float* yr = (float*)y + m0 * ys;
                            const int64_t mine = p == p0 ? lines : 0; /* the unit's first call */
#define TILE_KB(a, b) \
    tile_kb(a, b, 1, xr, xs, wp, k, k0, k1, yr, ys, p * NR, n, pf, npf, mine)
#define TILE_KB_NF(a, b) \
    tile_kb(a, b, 0, xr, xs, wp, k, k0, k1, yr, ys, p * NR, n, pf, 0, 0)
                            if (npf > 0) {
                                BY_SHAPE32(TILE_KB)
                            } else {
                                BY_SHAPE32(TILE_KB_NF)
                            }
                            p += np;
                        }
                    }
                }
            }
            }
        } else
        for (int64_t mb = 0; mb < m; mb += MB) {
            const int64_t mend = mb + MB < m ? mb + MB : m;
            const int64_t btiles = (mend - mb + tile_rows - 1) / tile_rows; /* this block's */
            /* Whether the next group's weights are fetched ahead: bf16 always; fp32 for
             * blocks of up to FETCH_TILES tiles (a decode step's rows), past which the tiles
             * compute long enough from cache for the hardware's prefetch to keep up; int8
             * weights (a quarter of fp32's bytes) never. */
            const int ahead_ok = kind == 1 || (kind == 0 && btiles <= FETCH_TILES);
            for (int64_t p0 = first; p0 < last; p0 += group) {
                const int64_t pc = last - p0 < group ? last - p0 : group;
                /* the next group's weights, fetched over the block's tiles after its first,
                 * from three tiles on (a second tile of a few rows has too little arithmetic
                 * to hide the fetch behind) */
                const int64_t next_pc = last - p0 - pc < group ? last - p0 - pc : group;
                const int64_t next_bytes = next_pc * k * NR * wbytes;
                const int64_t share =
                    btiles > 2 && ahead_ok ? (next_bytes + btiles - 2) / (btiles - 1) : 0;
                const int64_t lines =
                    share && steps ? (share + steps * 64 - 1) / (steps * 64) : 0;
                for (int64_t m0 = mb; m0 < mend; m0 += tile_rows) { /* the group's weights stay in cache */
                    const int mr = mend - m0 < tile_rows ? (int)(mend - m0) : (int)tile_rows;
                    const int64_t t = (m0 - mb) / tile_rows, from = (t - 1) * steps * lines * 64;
                    const int64_t u = (p0 - first) / group * tiles + m0 / tile_rows; /* this unit */
                    const int64_t u0 = units ? s0 + (s1 - s0) * u / units : 0;
                    const int64_t u1 = units ? s0 + (s1 - s0) * (u + 1) / units : 0;
                    Ahead ahead = {t > 0 && lines > 0 && next_bytes > from
                                       ? (const char*)w + (p0 + pc) * k * NR * wbytes + from
                                       : NULL,
                                   lines,
                                   next_bytes - from,
                                   sides,
                                   per,
                                   u0,
                                   u1 - u0,
                                   steps ? (u1 - u0 + steps - 1) / steps : 0};
                    for (int64_t p = p0; p < p0 + pc;) {
                        const int np = pc == group ? (int)group : 1;
                        const int fetch = ahead.base != NULL || ahead.count > 0;
                        const char* wp = (const char*)w + p * k * NR * wbytes;
                        const int64_t n0 = p * NR;
                        if (kind == 0) {
                            const float* xr = (const float*)x + m0 * xs;
                            float* yr = (float*)y + m0 * ys;
#define TILE_F32(a, b) tile_fp32_acc(a, b, 0, 1, xr, xs, wp, NULL, k, yr, ys, n0, n, ahead)
#define TILE_F32_NF(a, b) tile_fp32_acc(a, b, 0, 0, xr, xs, wp, NULL, k, yr, ys, n0, n, ahead)
                            if (fetch) {
                                BY_SHAPE32(TILE_F32)
                            } else {
                                BY_SHAPE32(TILE_F32_NF)
                            }
                        } else if (kind == 2) {
                            const float* xr = (const float*)x + m0 * xs;
                            float* yr = (float*)y + m0 * ys;
#define TILE_I8(a, b) tile_fp32_acc(a, b, 1, 1, xr, xs, wp, scale, k, yr, ys, n0, n, ahead)
#define TILE_I8_NF(a, b) tile_fp32_acc(a, b, 1, 0, xr, xs, wp, scale, k, yr, ys, n0, n, ahead)
                            if (fetch) {
                                BY_SHAPE32(TILE_I8)
                            } else {
                                BY_SHAPE32(TILE_I8_NF)
                            }
                        }
#if HAVE_BF16
                        else {
                            const uint16_t* xr = (const uint16_t*)x + m0 * xs;
                            uint16_t* yr = (uint16_t*)y + m0 * ys;
#define TILE_BF16(a, b) tile_bf16(a, b, 1, xr, xs, (const uint16_t*)wp, k, yr, ys, n0, n, ahead)
#define TILE_BF16_NF(a, b) \
    tile_bf16(a, b, 0, xr, xs, (const uint16_t*)wp, k, yr, ys, n0, n, ahead)
                            if (fetch) {
                                BY_SHAPE(TILE_BF16)
                            } else {
                                BY_SHAPE(TILE_BF16_NF)
                            }
                        }
#endif
                        ahead.count = 0; /* the unit's side lines went with its first tile */
                        p += np;
                    }
                }
            }
        }
    }
    return 0;
}
