/* The CPU's multiply-add ceilings: every OpenMP thread runs one instruction on sixteen
 * independent vector accumulators held in registers (no loads, no stores, no dependency an
 * instruction waits on), so the figure is what the cores' vector units can issue and nothing
 * else. bench/panel_matmul.py reports the panel kernel's rate as a fraction of it.
 *
 * Each returns the multiply-adds per second over all threads; `iters` steps per thread. */
#include <omp.h>
#include <stdint.h>
#include <time.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

static double seconds_since(const struct timespec* t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

typedef float v16f __attribute__((vector_size(64)));

/* `steps` (each `macs` multiply-adds) of `body` on every OpenMP thread, as multiply-adds a
 * second over all of them. body returns a sum of its accumulators, kept per thread and added up
 * after the region so that its loops have a use. */
static double ceiling(int64_t steps, double macs, float (*body)(int64_t)) {
    struct timespec t0;
    float sums[256] = {0};
    int nth = 1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel
    {
#pragma omp single
        nth = omp_get_num_threads();
        sums[omp_get_thread_num() % 256] = body(steps);
    }
    const double dt = seconds_since(&t0);
    volatile float sink = 0.0f;
    for (int i = 0; i < 256; i++) sink += sums[i];
    return (double)nth * (double)steps * macs / dt;
}

/* 16 fp32 fused multiply-adds a step, 16 lanes each. */
static float fma_steps(int64_t steps) {
    v16f acc[16];
    const v16f b = (v16f){} + 1.0000001f, c = (v16f){} + 1e-7f;
    for (int i = 0; i < 16; i++) acc[i] = (v16f){} + (float)i;
    for (int64_t it = 0; it < steps; it++)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = acc[i] * b + c; /* one FMA (contracted) */
    float s = 0.0f;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) s += acc[i][j];
    return s;
}

double tandem_fma_ceiling(int64_t iters) { return ceiling(iters, 16.0 * 16.0, fma_steps); }

#ifdef __AVX512BF16__
/* 16 bf16 dot products a step: 16 lanes of two multiply-adds each, into fp32. */
static float bf16_steps(int64_t steps) {
    __m512 acc[16];
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* (1, 1) */
    const __m512bh c = (__m512bh)_mm512_set1_epi32(0x33d633d6); /* (1e-7, 1e-7) */
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < steps; it++)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], b, c);
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += _mm512_reduce_add_ps(acc[i]);
    return s;
}
#endif

/* The bf16 dot-product instruction (the panel kernel's bf16 kind); 0 where the CPU lacks it. */
double tandem_bf16_ceiling(int64_t iters) {
#ifdef __AVX512BF16__
    return ceiling(iters, 16.0 * 32.0, bf16_steps);
#else
    (void)iters;
    return 0.0;
#endif
}
