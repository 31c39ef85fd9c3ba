/* An 8-float vector (GCC vector extensions) and the loads and sums the row matmuls share
 * (linear_f32.c, linear_bf16.c): the same source is AVX2, AVX-512 or SSE code from the
 * build's -march, and the 8-wide type splits where registers are narrower. */
#ifndef TLE_VEC8_H
#define TLE_VEC8_H
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#endif
