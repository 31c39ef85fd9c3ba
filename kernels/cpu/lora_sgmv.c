/* The batched LoRA update of one layer for every adapter group of a step, in one call:
 * for each segment g (its rows listed in rows[starts[g] .. starts[g+1]]),
 *     y[row] += (x[row] A_g^T) B_g^T,    A_g [rank_g, in], B_g [out, rank_g].
 *
 * Why: the torch path costs four small ops per group per layer (gather, shrink, expand,
 * scatter-add), ~120 layers a step; at decode sizes their dispatch overhead, not their
 * arithmetic (rank 16 is ~3% of the base matmuls' FLOPs), is what a step pays. Here
 * each row does its shrink into a register-sized buffer and its expand straight into y;
 * A and B (a few tens of KB per adapter layer) stay in cache across a segment's rows.
 *
 * float32 or bf16 activations and weights (the base model's dtype), float32 sums; in
 * bf16 the shrink result is rounded to bf16 as a bf16 matmul's output would be.
 * GCC vector extensions (vec8.h): AVX2/FMA, AVX-512 or SSE code from the build's -march. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec8.h"

#define LORA_MAX_RANK 2048

static inline v8f load8_bf16(const uint16_t *p) {
    v8f v;
    for (int i = 0; i < 8; i++) v[i] = bf16_to_f32(p[i]);
    return v;
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    const int64_t n8 = n & ~(int64_t)7;
    v8f acc = {0};
    for (int64_t i = 0; i < n8; i += 8) acc += load8(a + i) * load8(b + i);
    float s = hsum(acc);
    for (int64_t i = n8; i < n; i++) s += a[i] * b[i];
    return s;
}

/* bf16 weights against a float32 vector (the row widened once). */
static float dot_bf16(const uint16_t *a, const float *b, int64_t n) {
    const int64_t n8 = n & ~(int64_t)7;
    v8f acc = {0};
    for (int64_t i = 0; i < n8; i += 8) acc += load8_bf16(a + i) * load8(b + i);
    float s = hsum(acc);
    for (int64_t i = n8; i < n; i++) s += bf16_to_f32(a[i]) * b[i];
    return s;
}

static void row_f32(const float *x, float *y, const float *a, const float *b, int rank,
                    int64_t in, int64_t out) {
    float t[LORA_MAX_RANK];
    for (int k = 0; k < rank; k++) t[k] = dot_f32(a + k * in, x, in);
    for (int64_t o = 0; o < out; o++) y[o] += dot_f32(b + o * rank, t, rank);
}

static void row_bf16(const uint16_t *x, uint16_t *y, const uint16_t *a, const uint16_t *b,
                     int rank, int64_t in, int64_t out, float *xf) {
    float t[LORA_MAX_RANK];
    for (int64_t i = 0; i < in; i++) xf[i] = bf16_to_f32(x[i]);
    for (int k = 0; k < rank; k++) t[k] = round_bf16(dot_bf16(a + k * in, xf, in));
    for (int64_t o = 0; o < out; o++)
        y[o] = f32_to_bf16(bf16_to_f32(y[o]) + round_bf16(dot_bf16(b + o * rank, t, rank)));
}

/* x [*, in] and y [*, out] with row strides (elements, unit column stride); a[g], b[g]
 * the segment's weights (NULL: that adapter has no update for this layer). Returns 0, or
 * -1 for a rank or width this kernel does not take (the caller runs torch then). */
int lora_sgmv(int is_bf16, const void *x, int64_t x_stride, void *y, int64_t y_stride,
              const int64_t *rows, const int64_t *starts, int num_segments,
              const void *const *a, const void *const *b, const int32_t *ranks, int64_t in,
              int64_t out, int num_threads) {
    if (in > 65536) return -1;
    for (int g = 0; g < num_segments; g++)
        if (ranks[g] < 0 || ranks[g] > LORA_MAX_RANK) return -1;
    const int64_t total = starts[num_segments] - starts[0];
    int64_t work = 0;
    for (int g = 0; g < num_segments; g++)
        work += (starts[g + 1] - starts[g]) * ranks[g] * (in + out);
    #pragma omp parallel num_threads(num_threads) if (work >= 65536)
    {
        float xf[is_bf16 ? in : 1];
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < total; i++) {
            const int64_t pos = starts[0] + i;
            int g = 0;
            while (starts[g + 1] <= pos) g++;
            if (a[g] == NULL || ranks[g] == 0) continue;
            const int64_t row = rows[pos];
            if (is_bf16)
                row_bf16((const uint16_t *)x + row * x_stride, (uint16_t *)y + row * y_stride,
                         (const uint16_t *)a[g], (const uint16_t *)b[g], ranks[g], in, out, xf);
            else
                row_f32((const float *)x + row * x_stride, (float *)y + row * y_stride,
                        (const float *)a[g], (const float *)b[g], ranks[g], in, out);
        }
    }
    return 0;
}
