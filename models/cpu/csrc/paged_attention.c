/* Attention over the paged KV pool, read in place, on a CPU: decodes, chain and tree
 * verifications and prompt chunks (no maintained CPU kernel reads a paged cache for this torch).
 *
 * One layer of the pool is [NB, 2, Hkv, BS, D] (models/kv_layout.py): each block one
 * contiguous slab, the blocks block_stride elements apart. The keys of head
 * h of block b are the BS x D values at b * block_stride + h * BS * D, its values Hkv * BS * D
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
 * Work is split over (sequence, KV head, chunk of new tokens) triples across the OpenMP threads
 * of the runtime torch itself uses (the library links the libgomp torch loaded), handed out one
 * at a time (a thread the system preempts holds back no fixed share), each accumulating in
 * fp32.
 * Head dims are multiples of 16 (a vector of floats); 64 and 128 are compiled as constants
 * (their loops unroll and the row accumulators stay in registers), others take the same code
 * with the head dim read at run time. Compiled without -fassociative-math: every sum is in the
 * order written here.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_ACC 16384 /* floats of accumulator per call of attend_pair: rows * head_dim */
/* (models/cpu/paged.py checks these limits before it calls) */
#define MAX_ROWS (MAX_ACC / 16) /* query rows per call of attend_pair */
#define MAX_BS 256
#define MAX_D 512

/* e^x for x <= 0 (0 below -87). */
static inline float exp_nonpos(float x) { return x < -87.0f ? 0.0f : exp_in_range(x); }

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

/* Sixteen floats, and the ways of combining them that every score shares. */
typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float* p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The dot product of q and a key, both d = 16 * nv floats (nv of q's vectors given), as lanes:
 * lane j sums q_e k_e over e = j, j + 16, ... in that order (one multiply-add each). */
static inline v16f dot_lanes(const v16f* qv, const float* key, int nv) {
    v16f p = qv[0] * load16(key);
    for (int v = 1; v < nv; v++) p = p + qv[v] * load16(key + 16 * v);
    return p;
}

/* The sum of a dot_lanes vector's lanes, by halves: lanes j and j + 8, then j and j + 4, j and
 * j + 2, j and j + 1. hsum16 combines sixteen such vectors by the same pairings, so a key's
 * score has the same bits whichever of the two computes it. */
static inline float hsum1(v16f p) {
    float t[16];
    memcpy(t, &p, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

/* hsum16's four levels: each adds lanes j and j + w (w = 8, 4, 2, 1) of two vectors, packing
 * the pair's sums side by side. */
static inline v16f halves8(v16f a, v16f b) { /* key 2k in lanes 0-7, 2k + 1 in 8-15 */
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
}

static inline v16f halves4(v16f a, v16f b) { /* four keys, four lanes each */
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
}

static inline v16f halves2(v16f a, v16f b) { /* eight keys, two lanes each */
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                   29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
}

static inline v16f halves1(v16f a, v16f b) { /* sixteen keys, one lane each */
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                   31);
}

/* The scores of sixteen keys from key (each d floats apart) for nr rows of queries qv[r]
 * (nv vectors each): lane i of row r's result is hsum1(dot_lanes(qv[r], key i)), by the
 * pairings of hsum1 done sixteen keys at a time. The tree is walked depth first, so a row holds
 * a few partial vectors at a time, and each key is loaded once for all the rows. nr and nv are
 * constants at every call. */
static inline __attribute__((always_inline)) void scores16(int nr, int nv,
                                                           const v16f (*qv)[MAX_D / 16],
                                                           const float* key, int d, v16f* out) {
    v16f e[4][2];
    for (int a = 0; a < 2; a++) {
        v16f dd[4][2];
        for (int b = 0; b < 2; b++) {
            v16f c[4][2];
            for (int k = 0; k < 2; k++) {
                const float* k0 = key + (int64_t)(((a * 2 + b) * 2 + k) * 2) * d;
                for (int r = 0; r < nr; r++)
                    c[r][k] = halves8(dot_lanes(qv[r], k0, nv), dot_lanes(qv[r], k0 + d, nv));
            }
            for (int r = 0; r < nr; r++) dd[r][b] = halves4(c[r][0], c[r][1]);
        }
        for (int r = 0; r < nr; r++) e[r][a] = halves2(dd[r][0], dd[r][1]);
    }
    for (int r = 0; r < nr; r++) out[r] = halves1(e[r][0], e[r][1]);
}

/* Lane i of the result: the lane sum of p[i] (hsum1's pairings), for sixteen keys at once. */
static inline v16f hsum16(const v16f* p) {
    v16f c[8], d[4], e[2];
    for (int k = 0; k < 8; k++) c[k] = halves8(p[2 * k], p[2 * k + 1]);
    for (int k = 0; k < 4; k++) d[k] = halves4(c[2 * k], c[2 * k + 1]);
    for (int k = 0; k < 2; k++) e[k] = halves2(d[2 * k], d[2 * k + 1]);
    return halves1(e[0], e[1]);
}

/* Whether a row at position pos sees every key of the block of ntok keys from slot j0: none
 * past its position, none before its window, no tree slot among them. */
static inline int sees_block(int pos, int window, int32_t tree_base, int j0, int ntok) {
    const int lo = window > 0 ? pos - window + 1 : 0;
    return j0 >= lo && j0 + ntok - 1 <= pos && (tree_base < 0 || j0 + ntok - 1 < tree_base);
}

/* The values pass over one block for nr rows that see all of its ntok keys: each row's
 * weighted sum in key order from its accumulator (acc + r * d), with its weights from
 * w + r * kpad + cnt[r], the same multiply-adds in the same order as the row-by-row loop; the
 * rows' chains interleaved, so each value vector is loaded once for all of them and the
 * multiply-adds of one row do not wait on each other. nr and nv are constants at every call. */
static inline __attribute__((always_inline)) void values_rows(int nr, int nv, const float* blk,
                                                              int ntok, float* acc, int d,
                                                              const float* w, int kpad,
                                                              int32_t* cnt) {
    v16f av[4][MAX_D / 16];
    const float* wr[4];
    for (int r = 0; r < nr; r++) {
        wr[r] = w + (int64_t)r * kpad + cnt[r];
        for (int v = 0; v < nv; v++) av[r][v] = load16(acc + r * d + 16 * v);
    }
    for (int i = 0; i < ntok; i++) {
        const float* row = blk + (int64_t)i * d;
        for (int v = 0; v < nv; v++) {
            const v16f x = load16(row + 16 * v);
            for (int r = 0; r < nr; r++) av[r][v] = av[r][v] + wr[r][i] * x;
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int v = 0; v < nv; v++) memcpy(acc + r * d + 16 * v, &av[r][v], sizeof av[r][v]);
        cnt[r] += ntok;
    }
}

/* The scores pass over one block for nr rows that see all of its ntok keys: each row's scores
 * of the keys in slot order onto its packed scores (sc + r * kpad from cnt[r]), sixteen keys at
 * a time by scores16, the block's last partial sixteen one at a time by hsum1: the bits the
 * row-by-row loop gives. nr and nv are constants at every call. */
static inline __attribute__((always_inline)) void scores_rows(int nr, int nv, const float* blk,
                                                              int ntok, const float* qs, int d,
                                                              float* sc, int kpad,
                                                              int32_t* cnt) {
    v16f qv[4][MAX_D / 16];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) qv[r][v] = load16(qs + r * d + 16 * v);
    int i = 0;
    for (; i + 16 <= ntok; i += 16) {
        v16f s16[4];
        scores16(nr, nv, (const v16f(*)[MAX_D / 16])qv, blk + (int64_t)i * d, d, s16);
        for (int r = 0; r < nr; r++) {
            memcpy(sc + (int64_t)r * kpad + cnt[r], &s16[r], sizeof s16[r]);
            cnt[r] += 16;
        }
    }
    for (; i < ntok; i++)
        for (int r = 0; r < nr; r++)
            sc[(int64_t)r * kpad + cnt[r]++] = hsum1(dot_lanes(qv[r], blk + (int64_t)i * d, nv));
}

/* One (sequence, KV head) pair: its g * n query rows over the sequence's blocks.
 *
 * Two passes over the blocks. The first computes every row's scores of the keys it sees, in
 * slot order, packed (``sc``: row r's from r * kmax), the second the weighted sum of their
 * values in the same order. Between them, each row's weights are e^(score - max) over its
 * packed scores and their sum: the row's arithmetic is a function of the sequence of keys it
 * sees alone, not of where they sit in blocks (a draft tree's nodes sit at other slots than the
 * chain they become) nor of the other rows.
 *
 * Scores: sixteen filled slots of a block at a time (hsum16), the row keeping those it sees;
 * the filled slots of a block's last partial sixteen each by itself (hsum1), with the same
 * bits. A block the row sees nothing of (past its position, before its window) is skipped.
 * The head dim is a multiple of 16 (tandem_paged_attention refuses others). Weighted values:
 * the row's accumulator stays in registers across a block's keys. Sums over the keys are
 * vectors of sixteen partial sums in key order, then hsum1: a fixed order, whatever the block
 * layout. Rows that all see every key of a block (a decode's g rows, a prompt's rows past the
 * block) take it together, each key and value loaded once for them (scores_rows, values_rows),
 * with the arithmetic each would do alone. */
static inline __attribute__((always_inline)) int attend_pair(
    const void* q, int64_t q_stride, const void* kv, int64_t block_stride, const int32_t* table,
    int32_t row0,
    int32_t n, int32_t c0, int32_t tree_base, const uint8_t* tree_mask, int tree_width, void* out,
    int64_t out_stride, int h, int g, int hkv, int d_, int bs, int window, float scale, int bf16,
    int fixed_d) {
    const int d = fixed_d ? fixed_d : d_; /* a constant where the caller names one: unrolled */
    const int nv = d / 16;
    const int rows = g * n;
    float qs[MAX_ACC] __attribute__((aligned(64))), acc[MAX_ACC] __attribute__((aligned(64)));
    float buf[MAX_BS * MAX_D / 8] __attribute__((aligned(64)));
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
    const int kpad = (kmax + 15) / 16 * 16; /* room for whole vectors of scores */
    float* sc = (float*)malloc(sizeof(float) * (size_t)rows * (size_t)kpad);
    if (!sc) return -3;
    const int64_t chunk = (int64_t)bs * d;
    const int64_t elt = bf16 ? 2 : 4; /* bytes per element */
    for (int pass = 0; pass < 2; pass++) {
        for (int r = 0; r < rows; r++) cnt[r] = 0;
        for (int j = first; j * bs < ctx; j++) {
            /* pass 0 reads the block's keys, pass 1 its values */
            const int64_t base =
                (int64_t)table[j] * block_stride + ((int64_t)pass * hkv + h) * chunk;
            const int ntok = ctx - j * bs < bs ? ctx - j * bs : bs;
            /* The next block's chunk, and in pass 0 this block's values (which pass 1 then
             * reads from cache), asked for while this one computes: the first two lines of
             * each, which start the hardware's stream over the chunk. Asking for every line
             * streams no faster and costs an instruction a line. */
            if ((j + 1) * bs < ctx) {
                const int64_t next =
                    (int64_t)table[j + 1] * block_stride + ((int64_t)pass * hkv + h) * chunk;
                const char* nx = (const char*)kv + next * elt;
                __builtin_prefetch(nx);
                __builtin_prefetch(nx + 64);
            }
            if (pass == 0) {
                const char* vx = (const char*)kv + (base + (int64_t)hkv * chunk) * elt;
                __builtin_prefetch(vx, 0, 2);
                __builtin_prefetch(vx + 64, 0, 2);
            }
            const float* blk;
            if (bf16) {
                const uint16_t* b16 = (const uint16_t*)kv + base;
                for (int64_t e = 0; e < (int64_t)ntok * d; e++) buf[e] = bf16_to_f32(b16[e]);
                blk = buf;
            } else {
                blk = (const float*)kv + base;
            }
            /* rows in groups: a group whose rows all see every key of the block sums its
             * values together (values_rows); the others, and every score, row by row */
            const int rb = !fixed_d ? 1 : pass == 1 ? (nv <= 4 ? 4 : 2) : (nv <= 4 ? 3 : 2);
            for (int r0 = 0; r0 < rows; r0 += rb) {
                const int nr = rows - r0 < rb ? rows - r0 : rb;
                int whole = nr > 1;
                for (int r = r0; r < r0 + nr && whole; r++)
                    whole = sees_block(c0 + r / g, window, tree_base, j * bs, ntok);
                if (whole && pass == 0) {
                    const float* qr = qs + r0 * d;
                    float* o = sc + (int64_t)r0 * kpad;
                    switch (nr) {
                        case 4: scores_rows(4, nv, blk, ntok, qr, d, o, kpad, cnt + r0); break;
                        case 3: scores_rows(3, nv, blk, ntok, qr, d, o, kpad, cnt + r0); break;
                        default: scores_rows(2, nv, blk, ntok, qr, d, o, kpad, cnt + r0); break;
                    }
                    continue;
                }
                if (whole) {
                    float* a = acc + r0 * d;
                    const float* w = sc + (int64_t)r0 * kpad;
                    switch (nr) {
                        case 4: values_rows(4, nv, blk, ntok, a, d, w, kpad, cnt + r0); break;
                        case 3: values_rows(3, nv, blk, ntok, a, d, w, kpad, cnt + r0); break;
                        default: values_rows(2, nv, blk, ntok, a, d, w, kpad, cnt + r0); break;
                    }
                    continue;
                }
                for (int r = r0; r < r0 + nr; r++) {
                    const int pos = c0 + r / g;
                    const int lo = window > 0 ? pos - window + 1 : 0;
                    const uint8_t* seen =
                        tree_base >= 0 ? tree_mask + (int64_t)(row0 + r / g) * tree_width : 0;
                    /* a block wholly past the row's position or before its window: no key of it
                     * is seen (a prompt's rows skip the blocks after their own) */
                    if (j * bs > pos || j * bs + ntok - 1 < lo) continue;
                    float* mine = sc + (int64_t)r * kpad;
                    int c = cnt[r];
                    /* every key of the block visible (no tree slots in it, nothing past the
                     * row's position or before its window): no test per key */
                    const int all = sees_block(pos, window, tree_base, j * bs, ntok);
                    if (pass == 0) {
                        v16f qv[MAX_D / 16];
                        for (int v = 0; v < nv; v++) qv[v] = load16(qs + r * d + 16 * v);
                        int i = 0;
                        for (; i + 16 <= ntok; i += 16) { /* sixteen keys at a time */
                            v16f part[16];
                            for (int u = 0; u < 16; u++)
                                part[u] = dot_lanes(qv, blk + (int64_t)(i + u) * d, nv);
                            const v16f s16 = hsum16(part);
                            if (all) {
                                memcpy(mine + c, &s16, sizeof s16);
                                c += 16;
                            } else { /* the seen ones, in slot order (the rest is not kept) */
                                float t[16];
                                memcpy(t, &s16, sizeof t);
                                for (int u = 0; u < 16; u++)
                                    if (sees(j * bs + i + u, pos, lo, tree_base, seen))
                                        mine[c++] = t[u];
                            }
                        }
                        for (; i < ntok; i++) { /* the last block's filled slots, one at a time */
                            if (!all && !sees(j * bs + i, pos, lo, tree_base, seen)) continue;
                            mine[c++] = hsum1(dot_lanes(qv, blk + (int64_t)i * d, nv));
                        }
                    } else {
                        v16f av[MAX_D / 16];
                        for (int v = 0; v < nv; v++) av[v] = load16(acc + r * d + 16 * v);
                        for (int i = 0; i < ntok; i++) {
                            if (!all && !sees(j * bs + i, pos, lo, tree_base, seen)) continue;
                            const float w = mine[c++];
                            const float* row = blk + (int64_t)i * d;
                            for (int v = 0; v < nv; v++) av[v] = av[v] + w * load16(row + 16 * v);
                        }
                        for (int v = 0; v < nv; v++) memcpy(acc + r * d + 16 * v, &av[v], 64);
                    }
                    cnt[r] = c;
                }
            }
        }
        if (pass == 1) break;
        for (int r = 0; r < rows; r++) { /* the weights, in place of the scores */
            float* mine = sc + (int64_t)r * kpad;
            const int c = cnt[r];
            for (int k = c; k < (c + 15) / 16 * 16; k++) mine[k] = -INFINITY; /* weight 0 */
            const int cv = (c + 15) / 16;
            float m = -INFINITY;
            /* the largest score, by sixteen lanes then across them: the same value in any
             * order (NaN scores lose every comparison; +0 or -0 both give e^0 below) */
            float lane[16];
#ifdef __AVX512F__
            __m512 lv = _mm512_set1_ps(-INFINITY);
            for (int u = 0; u < cv; u++) /* max_ps(a, b) is a > b ? a : b */
                lv = _mm512_max_ps(_mm512_loadu_ps(mine + 16 * u), lv);
            _mm512_storeu_ps(lane, lv);
#else
            for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
            for (int u = 0; u < cv; u++)
                for (int l = 0; l < 16; l++)
                    lane[l] = mine[16 * u + l] > lane[l] ? mine[16 * u + l] : lane[l];
#endif
            for (int l = 0; l < 16; l++) m = lane[l] > m ? lane[l] : m;
            v16f sum = {};
            for (int u = 0; u < cv; u++) {
                float* at = mine + 16 * u;
                for (int e = 0; e < 16; e++) at[e] = exp_nonpos(at[e] - m);
                sum = sum + load16(at);
            }
            total[r] = hsum1(sum);
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

/* q, out: [T, Hq, D] rows at the given strides (elements); kv: one layer [NB, 2, Hkv, BS, D]
 * with its blocks block_stride elements apart;
 * tables [b, nbmax]; q_start, q_len, cached [b]; tree_base [b] (-1: no tree); tree_mask
 * [T, tree_width]. window 0: none. dtype 0: float32, 1: bfloat16. Returns 0, or a negative
 * number when a shape is beyond the limits (nothing written). */
int tandem_paged_attention(const void* q, int64_t q_stride, const void* kv,
                           int64_t block_stride, const int32_t* tables, int64_t nbmax,
                           const int32_t* q_start,
                           const int32_t* q_len, const int32_t* cached, const int32_t* tree_base,
                           const uint8_t* tree_mask, int tree_width, void* out,
                           int64_t out_stride, int b, int hq, int hkv, int d, int bs, int window,
                           float scale, int dtype) {
    const int g = hq / hkv;
    if (g * hkv != hq || bs > MAX_BS || d > MAX_D || d % 16 ||
        (int64_t)bs * d > MAX_BS * MAX_D / 8)
        return -1;
    /* A sequence's new tokens are taken in chunks of at most `per` tokens (their rows and
     * accumulators fit one call of attend_pair): a chunk from token t0 is attend_pair's rows
     * from q_start + t0 with cached + t0 keys before them, each row seeing what it saw in
     * the whole, so a row's bits do not depend on the chunking. Work items are (sequence,
     * KV head, chunk) triples. */
    const int32_t per_acc = MAX_ACC / (g * d), per_rows = MAX_ROWS / g;
    const int32_t per = per_acc < per_rows ? per_acc : per_rows;
    if (per < 1) return -2;
    int64_t* first_item = malloc(sizeof(int64_t) * (size_t)(b + 1)); /* [b + 1] */
    if (!first_item) return -3;
    first_item[0] = 0;
    for (int s = 0; s < b; s++) {
        const int64_t chunks = q_len[s] > 0 ? (q_len[s] + per - 1) / per : 0;
        first_item[s + 1] = first_item[s] + chunks * hkv;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t it = 0; it < first_item[b]; it++) {
        int s = 0;
        while (first_item[s + 1] <= it) s++;
        const int64_t local = it - first_item[s];
        const int h = (int)(local % hkv);
        const int32_t t0 = (int32_t)(local / hkv) * per;
        const int32_t n = q_len[s] - t0 < per ? q_len[s] - t0 : per;
#define PAIR(B16, FD)                                                                         \
    attend_pair(q, q_stride, kv, block_stride, tables + s * nbmax, q_start[s] + t0, n,        \
                cached[s] + t0, tree_base[s], tree_mask, tree_width, out, out_stride, h, g, hkv, \
                d, bs, window, scale, B16, FD)
        if (dtype == 1)
            failed |= (d == 64 ? PAIR(1, 64) : d == 128 ? PAIR(1, 128) : PAIR(1, 0)) != 0;
        else
            failed |= (d == 64 ? PAIR(0, 64) : d == 128 ? PAIR(0, 128) : PAIR(0, 0)) != 0;
    }
    free(first_item);
    if (failed) return -3; /* out of memory */
    return 0;
}

/* Write a step's new keys and values into one layer of the pool ([nb, 2, Hkv, BS, D], blocks
 * block_stride elements apart): row r
 * of k and of v (each [T, Hkv, D] with row stride ks / vs, heads D apart) goes to slot
 * offsets[r] of block blocks[r], for every KV head; esize bytes a value. Returns -1 at the
 * first slot outside the pool. One call where PyTorch takes a stack, an index and a scatter. */
int tandem_kv_write(const void* k, int64_t ks, const void* v, int64_t vs, void* kv, int64_t nb,
                    int64_t block_stride, const int64_t* blocks, const int64_t* offsets,
                    int64_t t, int hkv, int d, int bs, int esize) {
    const size_t row = (size_t)d * (size_t)esize;
    for (int64_t r = 0; r < t; r++) {
        const int64_t b = blocks[r], o = offsets[r];
        if (o < 0 || o >= bs || b < 0 || b >= nb) return -1; /* nothing past it is written */
        for (int h = 0; h < hkv; h++) {
            const int64_t at = b * block_stride + ((int64_t)h * bs + o) * d; /* K, in elements */
            char* kd = (char*)kv + at * esize;
            char* vd = (char*)kv + (at + (int64_t)hkv * bs * d) * esize;
            memcpy(kd, (const char*)k + (r * ks + (int64_t)h * d) * esize, row);
            memcpy(vd, (const char*)v + (r * vs + (int64_t)h * d) * esize, row);
        }
    }
    return 0;
}
