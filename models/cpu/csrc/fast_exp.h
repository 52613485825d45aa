/* e^x for x already in [-87, 88], to about 2 ulp, branch-free so that loops over it vectorise
 * (no libm call): 2^n times a polynomial in the remainder x - n ln2. Shared by the attention
 * kernel (softmax weights) and the row ops (SiLU); each clamps its own range around it. */
#ifndef TANDEM_FAST_EXP_H
#define TANDEM_FAST_EXP_H
#include <math.h>
#include <stdint.h>

static inline float exp_in_range(float x) {
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693359375f + n * 2.12194440e-4f; /* x - n ln2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { float f; int32_t i; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}
#endif
