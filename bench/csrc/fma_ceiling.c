/* The CPU's fp32 multiply-add ceiling: every OpenMP thread runs fused multiply-adds on sixteen
 * independent vector accumulators held in registers (no loads, no stores, no dependency a
 * multiply-add waits on), so the figure is what the cores' vector units can issue and nothing
 * else. bench/panel_matmul.py reports the panel kernel's rate as a fraction of it.
 *
 * Returns the multiply-adds per second over all threads; `iters` K steps per thread. */
#include <omp.h>
#include <stdint.h>
#include <time.h>

typedef float v16f __attribute__((vector_size(64)));

double tandem_fma_ceiling(int64_t iters) {
    struct timespec t0, t1;
    float sums[256] = {0}; /* one per thread, read after the region: the loops have a use */
    int nth = 1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel
    {
#pragma omp single
        nth = omp_get_num_threads();
        v16f acc[16];
        const v16f b = (v16f){} + 1.0000001f, c = (v16f){} + 1e-7f;
        for (int i = 0; i < 16; i++) acc[i] = (v16f){} + (float)i;
        for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = acc[i] * b + c; /* one FMA (contracted) */
        float s = 0.0f;
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) s += acc[i][j];
        sums[omp_get_thread_num() % 256] = s;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    volatile float sink = 0.0f;
    for (int i = 0; i < 256; i++) sink += sums[i];
    return (double)nth * (double)iters * 16.0 * 16.0 / dt;
}
