/* A decode step's decoder layers on a CPU in one call: the kernels the modules of
 * models/llama.py call for each layer, in the same order on the same buffers, so every value
 * has the bits the module path gives it, without Python between the calls.
 *
 * The kernels come in as function pointers (each library has its own flags). The residual
 * stream x [t, hidden] is updated in place; n, qkv, qk, att, o, gu, act are scratch rows.
 * Given Step.sides, the MLP's matmuls also prefetch the next layer's KV slabs (linear_side);
 * prefetches change no value.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*norm_fn)(int, const void*, int64_t, const void*, void*, int64_t, int64_t, int64_t,
                       float);
typedef int (*rope_fn)(int, const void*, int64_t, const float*, const float*, void*, int64_t,
                       int64_t, int64_t);
typedef int (*silu_mul_fn)(int, const void*, int64_t, void*, int64_t, int64_t, int64_t);
typedef int (*add_fn)(int, void*, int64_t, const void*, int64_t, int64_t, int64_t);
typedef int (*linear_fn)(int, const void*, int64_t, const void*, const float*, void*, int64_t,
                         int64_t, int64_t, int64_t);
typedef int (*linear_side_fn)(int, const void*, int64_t, const void*, const float*, void*,
                              int64_t, int64_t, int64_t, int64_t, const char* const*, int64_t,
                              int64_t);
typedef int (*write_fn)(const void*, int64_t, const void*, int64_t, void*, int64_t, int64_t,
                        const int64_t*, const int64_t*, int64_t, int, int, int, int);
typedef int (*attend_fn)(const void*, int64_t, const void*, int64_t, const int32_t*, int64_t,
                         const int32_t*, const int32_t*, const int32_t*, const int32_t*,
                         const uint8_t*, int, void*, int64_t, int, int, int, int, int, int, float,
                         int);

/* One packed weight (models/cpu/linear.py, PanelWeight): its kind, data and int8 scales. */
typedef struct {
    int64_t kind;
    const void* data;
    const float* scale;
} Weight;

typedef struct {
    const void* input_norm;
    const void* post_norm;
    Weight qkv, o, gate_up, down;
} Layer;

/* The model: its kernels and shapes. dtype 0 fp32, 1 bf16 (the activations'). */
typedef struct {
    norm_fn norm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    add_fn add;
    linear_fn linear;
    write_fn write;
    attend_fn attend;
    int64_t dtype, hidden, inter, hq, hkv, d;
    float eps, scale;
    linear_side_fn linear_side; /* the matmul that also fetches the next layer's KV */
} Model;

/* One step: its rows, buffers and attention metadata (one native group over every row). */
typedef struct {
    int64_t t;
    void *x, *n, *qkv, *qk, *att, *o, *gu, *act;
    const float *cos, *sin; /* [t, d] */
    const int64_t *slot_blocks, *slot_offsets;
    char* pool;            /* layer 0 of the KV pool, [NB, 2, Hkv, BS, D] a layer */
    int64_t layer_bytes;   /* from one layer's first slab to the next's */
    int64_t block_stride;  /* from one block's slab to the next's in a layer, in elements */
    int64_t nb, bs;
    const int32_t *tables, *q_start, *q_len, *cached, *tree_base;
    const uint8_t* tree_mask;
    int64_t nbmax, tree_width, b, window;
    const char** sides; /* room for b * nbmax pointers: the next layer's KV slabs */
} Step;

/* The most of the next layer's KV fetched during one MLP: more than the cache keeps until
 * attention reads it, or than memory brings in while the MLP computes, only displaces. */
#define FETCH_BYTES ((int64_t)8 << 20)

/* The slabs (K and V of every head of one block) of layer `layer` that the step's attention
 * reads there, into s->sides; returns how many. */
static int64_t next_slabs(const Step* s, int64_t layer, int64_t esize) {
    const char* kv = s->pool + layer * s->layer_bytes;
    int64_t q = 0;
    for (int64_t r = 0; r < s->b; r++) {
        const int64_t ctx = (int64_t)s->cached[r] + s->q_len[r];
        int64_t nblk = (ctx + s->bs - 1) / s->bs;
        if (nblk > s->nbmax) nblk = s->nbmax;
        for (int64_t j = 0; j < nblk; j++)
            s->sides[q++] = kv + (int64_t)s->tables[r * s->nbmax + j] * s->block_stride * esize;
    }
    return q;
}

/* Runs layers [0, nlayers) over the step. Returns 0, or the first kernel's nonzero code with
 * the layer in the upper bits (layer * 256 + (code & 255)), having stopped there. */
int tandem_layer_program(const Model* m, const Layer* layers, int64_t nlayers, const Step* s) {
    const int dt = (int)m->dtype;
    const int64_t t = s->t, h = m->hidden, in = m->inter, d = m->d;
    const int64_t q_end = m->hq * d, k_end = q_end + m->hkv * d, nqkv = k_end + m->hkv * d;
    const int64_t esize = dt ? 2 : 4;
    const int64_t heads = m->hq + m->hkv;
    for (int64_t i = 0; i < nlayers; i++) {
        const Layer* L = layers + i;
        char* kv = s->pool + i * s->layer_bytes;
        int rc = m->norm(dt, s->x, h, L->input_norm, s->n, h, t, h, m->eps);
        if (!rc) rc = m->linear((int)L->qkv.kind, s->n, h, L->qkv.data, L->qkv.scale, s->qkv, nqkv,
                                t, nqkv, h);
        if (!rc) rc = m->rope(dt, s->qkv, nqkv, s->cos, s->sin, s->qk, t, heads, d);
        if (!rc) /* keys: the rotated rows after the queries; values: qkv's last columns */
            rc = m->write((const char*)s->qk + q_end * esize, heads * d,
                          (const char*)s->qkv + k_end * esize, nqkv, kv, s->nb,
                          s->block_stride, s->slot_blocks, s->slot_offsets, t, (int)m->hkv, (int)d, (int)s->bs, (int)esize);
        if (!rc)
            rc = m->attend(s->qk, heads * d, kv, s->block_stride, s->tables, s->nbmax,
                           s->q_start, s->q_len, s->cached, s->tree_base, s->tree_mask, (int)s->tree_width, s->att,
                           q_end, (int)s->b, (int)m->hq, (int)m->hkv, (int)d, (int)s->bs,
                           (int)s->window, m->scale, dt);
        if (!rc) rc = m->linear((int)L->o.kind, s->att, q_end, L->o.data, L->o.scale, s->o, h, t,
                                h, q_end);
        if (!rc) rc = m->add(dt, s->x, h, s->o, h, t, h);
        if (!rc) rc = m->norm(dt, s->x, h, L->post_norm, s->n, h, t, h, m->eps);
        /* The MLP computes while the next layer's KV comes into cache (its attention would
         * otherwise wait on memory): two thirds of the slabs over gate_up, the rest over down,
         * as their multiply-adds split. */
        const int fetch = s->sides && i + 1 < nlayers;
        const int64_t slab = 2 * m->hkv * s->bs * d * esize;
        int64_t ns = fetch ? next_slabs(s, i + 1, esize) : 0;
        if (ns > FETCH_BYTES / slab) ns = FETCH_BYTES / slab;
        const int64_t split = ns * 2 / 3;
        if (!rc)
            rc = m->linear_side((int)L->gate_up.kind, s->n, h, L->gate_up.data,
                                L->gate_up.scale, s->gu, 2 * in, t, 2 * in, h,
                                (const char* const*)s->sides, split, slab);
        if (!rc) rc = m->silu_mul(dt, s->gu, 2 * in, s->act, in, t, in);
        if (!rc)
            rc = m->linear_side((int)L->down.kind, s->act, in, L->down.data, L->down.scale, s->o,
                                h, t, h, in, (const char* const*)s->sides + split, ns - split,
                                slab);
        if (!rc) rc = m->add(dt, s->x, h, s->o, h, t, h);
        if (rc) return (int)(i * 256 + (rc & 255));
    }
    return 0;
}

#define OFF(T, f) (int64_t) offsetof(T, f)

/* The structs' sizes, then every field's offset in declaration order (Model's, then Step's):
 * models/cpu/program.py mirrors them with ctypes and checks it against this. Returns how many
 * values it wrote (at most n). */
int64_t tandem_layer_program_layout(int64_t* out, int64_t n) {
    const int64_t v[] = {
        sizeof(Weight), sizeof(Layer), sizeof(Model), sizeof(Step),
        OFF(Model, norm), OFF(Model, rope), OFF(Model, silu_mul), OFF(Model, add),
        OFF(Model, linear), OFF(Model, write), OFF(Model, attend), OFF(Model, dtype),
        OFF(Model, hidden), OFF(Model, inter), OFF(Model, hq), OFF(Model, hkv), OFF(Model, d),
        OFF(Model, eps), OFF(Model, scale), OFF(Model, linear_side),
        OFF(Step, t), OFF(Step, x), OFF(Step, n), OFF(Step, qkv), OFF(Step, qk), OFF(Step, att),
        OFF(Step, o), OFF(Step, gu), OFF(Step, act), OFF(Step, cos), OFF(Step, sin),
        OFF(Step, slot_blocks), OFF(Step, slot_offsets), OFF(Step, pool),
        OFF(Step, layer_bytes), OFF(Step, block_stride), OFF(Step, nb), OFF(Step, bs),
        OFF(Step, tables), OFF(Step, q_start), OFF(Step, q_len), OFF(Step, cached),
        OFF(Step, tree_base), OFF(Step, tree_mask), OFF(Step, nbmax), OFF(Step, tree_width),
        OFF(Step, b), OFF(Step, window), OFF(Step, sides),
    };
    const int64_t count = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < count && i < n; i++) out[i] = v[i];
    return count;
}
