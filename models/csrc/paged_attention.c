/* Decode and chain-verification attention over the paged KV pool, read in place, on a CPU.
 *
 * Why by hand: no maintained CPU kernel reads a paged KV cache for the torch this project runs
 * on (IPEX's paged attention stops at torch 2.8; vLLM's and SGLang's CPU kernels are built
 * against their own torch pins). The gather path copies every context block into a dense
 * tensor per layer and SDPA reads it again, padded to the longest context of the group; this
 * kernel reads each (block, head) of K and V once, in place.
 *
 * One layer of the pool is [NB, 2, Hkv, BS, D] (models/attention.py): the keys of head h of
 * block b are the BS x D floats at ((b * 2 + 0) * Hkv + h) * BS * D, its values Hkv * BS * D
 * further. Queries and outputs are flat [T, Hq, D] rows (row stride given), sequence s owning
 * the q_len[s] rows from q_start[s]: its new tokens, at positions cached[s] + t. Query t
 * sees keys at positions p <= cached[s] + t (and p > cached[s] + t - window when window > 0).
 * Query heads h * G .. h * G + G - 1 share KV head h (grouped-query attention). A sequence
 * whose new tokens end a token tree (tree_base[s] >= 0) has them see, inside the tree's slots
 * tree_base[s] .. tree_base[s] + W - 1, only the slots its row of tree_mask marks (its
 * ancestors and itself): tree_mask is [T, W] bytes, one row per query token.
 *
 * A row's result depends on its query and the sequence of keys it sees alone (attend_pair),
 * so a token verified among k + 1 rows, or as a node of a draft tree, gets the bits it gets
 * decoded alone.
 *
 * Work is split over (sequence, KV head) pairs across the OpenMP threads of the runtime torch
 * itself uses (the library links the libgomp torch loaded), every pair accumulating in fp32.
 * Head dims 64 and 128 are compiled as constants (their loops unroll and the row accumulators
 * stay in registers); others take the same code with the head dim read at run time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ACC 16384 /* floats of accumulator per (sequence, head): rows * head_dim */
/* (models/cpu_paged.py checks these limits before it calls: MAX_ACCUMULATOR, MAX_ROWS,
 * MAX_BLOCK_SIZE, MAX_HEAD_DIM, MAX_BLOCK_FLOATS) */
#define MAX_ROWS (MAX_ACC / 16) /* query rows per (sequence, head) */
#define MAX_BS 256
#define MAX_D 512

/* e^x for x <= 0, to about 2 ulp (0 below -87), branch-free so that loops over it vectorise
 * (no libm call). */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f;
    const float xc = x < -87.0f ? -87.0f : x;
    float n = floorf(xc * log2e + 0.5f);
    float f = xc - n * 0.693359375f + n * 2.12194440e-4f; /* x - n ln2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * u.f;
}

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)v << 16;
    return u.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t i; } u;
    u.f = f;
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.i >> 16) | 0x40u); /* NaN */
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

/* Whether query row r (token t = r / g, at slot pos) sees the key at slot p. */
static inline int sees(int p, int pos, int lo, int32_t tree_base, const uint8_t* seen) {
    int ok = p <= pos && p >= lo;
    if (seen && p >= tree_base) ok = ok && seen[p - tree_base];
    return ok;
}

/* One (sequence, KV head) pair: its g * n query rows over the sequence's blocks.
 *
 * Two passes over the blocks. The first computes every row's scores of the keys it sees, in
 * slot order, packed (``sc``: row r's from r * kmax), the second the weighted sum of their
 * values in the same order. Between them, each row's weights are e^(score - max) over its
 * packed scores and their sum: the row's arithmetic is a function of the sequence of keys it
 * sees alone, not of where they sit in blocks (a draft tree's nodes sit at other slots than the
 * chain they become) nor of the other rows. */
static inline __attribute__((always_inline)) int attend_pair(
    const void* q, int64_t q_stride, const void* kv, const int32_t* table, int32_t row0,
    int32_t n, int32_t c0, int32_t tree_base, const uint8_t* tree_mask, int tree_width, void* out,
    int64_t out_stride, int h, int g, int hkv, int d_, int bs, int window, float scale, int bf16,
    int fixed_d) {
    const int d = fixed_d ? fixed_d : d_; /* a constant where the caller names one: unrolled */
    const int rows = g * n;
    float qs[MAX_ACC], acc[MAX_ACC];
    float buf[MAX_BS * MAX_D / 8];
    int32_t cnt[MAX_ROWS];
    float total[MAX_ROWS];
    for (int r = 0; r < rows; r++) {
        const int t = r / g, head = h * g + r % g;
        for (int e = 0; e < d; e++) {
            int64_t at = (int64_t)(row0 + t) * q_stride + (int64_t)head * d + e;
            float v = bf16 ? bf16_to_f32(((const uint16_t*)q)[at]) : ((const float*)q)[at];
            qs[r * d + e] = v * scale;
            acc[r * d + e] = 0.0f;
        }
        cnt[r] = 0;
    }
    const int ctx = c0 + n;
    int first = 0;
    if (window > 0 && c0 - window + 1 > 0) first = (c0 - window + 1) / bs;
    const int kmax = ctx - first * bs; /* keys any row may see */
    float* sc = (float*)malloc(sizeof(float) * (size_t)rows * (size_t)kmax);
    if (!sc) return -3;
    const int64_t chunk = (int64_t)bs * d;
    const int64_t elt = bf16 ? 2 : 4; /* bytes per element */
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < rows; r++) cnt[r] = 0;
        for (int j = first; j * bs < ctx; j++) {
            /* pass 0 reads the block's keys, pass 1 its values */
            const int64_t base = (((int64_t)table[j] * 2 + pass) * hkv + h) * chunk;
            const int ntok = ctx - j * bs < bs ? ctx - j * bs : bs;
            if ((j + 1) * bs < ctx) { /* the next block's, while this one computes */
                const int64_t next = ((int64_t)table[j + 1] * 2 + pass) * hkv + h;
                const char* nx = (const char*)kv + next * chunk * elt;
                for (int64_t at = 0; at < chunk * elt; at += 64) __builtin_prefetch(nx + at);
            }
            const float* blk;
            if (bf16) {
                const uint16_t* b16 = (const uint16_t*)kv + base;
                for (int64_t e = 0; e < (int64_t)ntok * d; e++) buf[e] = bf16_to_f32(b16[e]);
                blk = buf;
            } else {
                blk = (const float*)kv + base;
            }
            for (int r = 0; r < rows; r++) {
                const int pos = c0 + r / g;
                const int lo = window > 0 ? pos - window + 1 : 0;
                const uint8_t* seen =
                    tree_base >= 0 ? tree_mask + (int64_t)(row0 + r / g) * tree_width : 0;
                const float* restrict qr = qs + r * d;
                float* restrict ar = acc + r * d;
                float* mine = sc + (int64_t)r * kmax;
                /* every key of the block visible (no tree slots in it, nothing past the
                 * row's position or before its window): no test per key */
                const int all = j * bs >= lo && j * bs + ntok - 1 <= pos &&
                                (!seen || j * bs + ntok - 1 < tree_base);
                for (int i = 0; i < ntok; i++) {
                    if (!all && !sees(j * bs + i, pos, lo, tree_base, seen)) continue;
                    const float* restrict row = blk + (int64_t)i * d;
                    if (pass == 0) {
                        float dot = 0.0f;
                        for (int e = 0; e < d; e++) dot += qr[e] * row[e];
                        mine[cnt[r]++] = dot;
                    } else {
                        const float w = mine[cnt[r]++];
                        for (int e = 0; e < d; e++) ar[e] += w * row[e];
                    }
                }
            }
        }
        if (pass == 1) break;
        for (int r = 0; r < rows; r++) { /* the weights, in place of the scores */
            float* mine = sc + (int64_t)r * kmax;
            const int c = cnt[r];
            float m = -INFINITY;
            for (int k = 0; k < c; k++) m = mine[k] > m ? mine[k] : m;
            float sum = 0.0f;
            for (int k = 0; k < c; k++) {
                mine[k] = exp_nonpos(mine[k] - m);
                sum += mine[k];
            }
            total[r] = sum;
        }
    }
    free(sc);
    for (int r = 0; r < rows; r++) {
        const int t = r / g, head = h * g + r % g;
        const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        for (int e = 0; e < d; e++) {
            int64_t at = (int64_t)(row0 + t) * out_stride + (int64_t)head * d + e;
            float v = acc[r * d + e] * inv;
            if (bf16) ((uint16_t*)out)[at] = f32_to_bf16(v);
            else ((float*)out)[at] = v;
        }
    }
    return 0;
}

/* q, out: [T, Hq, D] rows at the given strides (elements); kv: one layer [NB, 2, Hkv, BS, D];
 * tables [b, nbmax]; q_start, q_len, cached [b]; tree_base [b] (-1: no tree); tree_mask
 * [T, tree_width]. window 0: none. dtype 0: float32, 1: bfloat16. Returns 0, or a negative
 * number when a shape is beyond the limits (nothing written). */
int tandem_paged_attention(const void* q, int64_t q_stride, const void* kv,
                           const int32_t* tables, int64_t nbmax, const int32_t* q_start,
                           const int32_t* q_len, const int32_t* cached, const int32_t* tree_base,
                           const uint8_t* tree_mask, int tree_width, void* out,
                           int64_t out_stride, int b, int hq, int hkv, int d, int bs, int window,
                           float scale, int dtype) {
    const int g = hq / hkv;
    if (g * hkv != hq || bs > MAX_BS || d > MAX_D || (int64_t)bs * d > MAX_BS * MAX_D / 8)
        return -1;
    for (int s = 0; s < b; s++)
        if ((int64_t)g * q_len[s] * d > MAX_ACC || g * q_len[s] > MAX_ROWS) return -2;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t it = 0; it < (int64_t)b * hkv; it++) {
        const int s = (int)(it / hkv), h = (int)(it % hkv);
        const int32_t n = q_len[s];
        if (n <= 0) continue;
#define PAIR(B16, FD)                                                                          \
    attend_pair(q, q_stride, kv, tables + s * nbmax, q_start[s], n, cached[s], tree_base[s],     \
                tree_mask, tree_width, out, out_stride, h, g, hkv, d, bs, window, scale, B16, FD)
        if (dtype == 1)
            failed |= (d == 64 ? PAIR(1, 64) : d == 128 ? PAIR(1, 128) : PAIR(1, 0)) != 0;
        else
            failed |= (d == 64 ? PAIR(0, 64) : d == 128 ? PAIR(0, 128) : PAIR(0, 0)) != 0;
    }
    if (failed) return -3; /* out of memory */
    return 0;
}

/* Write a step's new keys and values into one layer of the pool ([nb, 2, Hkv, BS, D]): row r
 * of k and of v (each [T, Hkv, D] with row stride ks / vs, heads D apart) goes to slot
 * offsets[r] of block blocks[r], for every KV head; esize bytes a value. Returns -1 at the
 * first slot outside the pool. Why by hand: in PyTorch this is an indexed assignment of the
 * two stacked (a stack, an index computation and a scatter), tens of microseconds a layer at
 * the few rows of a decode step for a few kilobytes of copy. */
int tandem_kv_write(const void* k, int64_t ks, const void* v, int64_t vs, void* kv, int64_t nb,
                    const int64_t* blocks, const int64_t* offsets, int64_t t, int hkv, int d,
                    int bs, int esize) {
    const size_t row = (size_t)d * (size_t)esize;
    for (int64_t r = 0; r < t; r++) {
        const int64_t b = blocks[r], o = offsets[r];
        if (o < 0 || o >= bs || b < 0 || b >= nb) return -1; /* nothing past it is written */
        for (int h = 0; h < hkv; h++) {
            char* kd = (char*)kv + ((((b * 2 + 0) * hkv + h) * bs + o) * (int64_t)row);
            char* vd = (char*)kv + ((((b * 2 + 1) * hkv + h) * bs + o) * (int64_t)row);
            memcpy(kd, (const char*)k + (r * ks + (int64_t)h * d) * esize, row);
            memcpy(vd, (const char*)v + (r * vs + (int64_t)h * d) * esize, row);
        }
    }
    return 0;
}
