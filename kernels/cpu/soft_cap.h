/* Attention logit soft-capping (Gemma 2): s -> cap * tanh(s / cap), on n scores in place,
 * in a loop gcc vectorizes with libmvec's expf (-ffast-math builds), where a tanhf call a
 * score would cost as much as the score's dot product at head_dim 256.
 *
 * tanh(x) = 1 - 2 / (e^2x + 1): the absolute error stays ~1e-7 near 0 (a logit error of
 * ~cap * 1e-7, far below the softmax's float32 rounding) and x is clamped to +-9, where
 * tanh is 1 to float precision, so e^2x never overflows. */
#ifndef TLE_SOFT_CAP_H
#define TLE_SOFT_CAP_H
#include <math.h>

static inline void soft_cap_scores(float *s, int n, float cap) {
    const float inv = 1.f / cap;
    #pragma omp simd
    for (int t = 0; t < n; t++) {
        float x = s[t] * inv;
        x = x < -9.f ? -9.f : (x > 9.f ? 9.f : x);
        s[t] = cap * (1.f - 2.f / (expf(2.f * x) + 1.f));
    }
}

#endif
