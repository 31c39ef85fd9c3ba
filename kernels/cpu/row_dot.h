/* Four rows of W against one row of x, each a float32 dot product: the inner loop of the
 * kernels that stream W once per call at few rows (linear_f32.c, linear_bf16.c) and of
 * the fused MoE (moe.c), which runs them over each expert's rows.
 *
 * Four rows side by side: four independent loads and accumulators per step. With `ahead`
 * set (the first x row of a call, where W comes from memory), each 64-byte line
 * ROW_PREFETCH_AHEAD rows further on is asked for into L2 (prefetch.h says why).
 *
 * Each output is one fixed chain over k, whatever the other rows are, so a row's result
 * never depends on how many rows a caller passes. bf16 has two loops, chosen by the
 * build's target (the native build follows the detected CPU, or TLE_CPU_ISA's cap):
 * - AVX-512 BF16 (`vdpbf16ps`): 32 bf16 products a row per instruction, summed in pairs
 *   into float32 lanes; x is read as bf16.
 * - everywhere else: each bf16 widened to float32 with a 16-bit shift (exact) and
 *   multiplied with float32 FMA (GCC vector extensions: AVX2, AVX-512F or SSE code); x
 *   must be widened to float32 by the caller, once per call rather than once per W row.
 */
#ifndef TLE_ROW_DOT_H
#define TLE_ROW_DOT_H
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "prefetch.h"
#include "vec8.h"

#define DOT_ROWS 4

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ROW_DOT_DPBF16 1
typedef uint16_t bf16_dot_x;  /* what dot4_bf16 reads x as: bf16 itself */

static inline __m512bh load32_bf16(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* out[i] = sum over k of x * w[i], the first k32 elements by vdpbf16ps. */
static inline void dot4_bf16(const uint16_t *x, const uint16_t *const w[DOT_ROWS], int64_t k,
                             int ahead, float out[DOT_ROWS]) {
    const int64_t k32 = k & ~(int64_t)31, skip = ROW_PREFETCH_AHEAD * k;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < k32; i += 32) {
        if (ahead)
            for (int r = 0; r < DOT_ROWS; r++) prefetch_l2(w[r] + i + skip);
        const __m512bh xv = load32_bf16(x + i);
        a0 = _mm512_dpbf16_ps(a0, xv, load32_bf16(w[0] + i));
        a1 = _mm512_dpbf16_ps(a1, xv, load32_bf16(w[1] + i));
        a2 = _mm512_dpbf16_ps(a2, xv, load32_bf16(w[2] + i));
        a3 = _mm512_dpbf16_ps(a3, xv, load32_bf16(w[3] + i));
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
    for (int64_t i = k32; i < k; i++) {
        const float xi = bf16_to_f32(x[i]);
        for (int r = 0; r < DOT_ROWS; r++) out[r] += xi * bf16_to_f32(w[r][i]);
    }
}

#else
#define ROW_DOT_DPBF16 0
typedef float bf16_dot_x;  /* what dot4_bf16 reads x as: bf16 values widened to float32 */

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* 8 bf16 -> 8 float32: the bf16 bits are a float32's upper half. */
static inline v8f widen8(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* As above, with x already float32; `ahead` once per 64-byte line (32 bf16). */
static inline void dot4_bf16(const float *x, const uint16_t *const w[DOT_ROWS], int64_t k,
                             int ahead, float out[DOT_ROWS]) {
    const int64_t k8 = k & ~(int64_t)7, skip = ROW_PREFETCH_AHEAD * k;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < k8; i += 8) {
        if (ahead && (i & 31) == 0)
            for (int r = 0; r < DOT_ROWS; r++) prefetch_l2(w[r] + i + skip);
        const v8f xv = load8(x + i);
        a0 += xv * widen8(w[0] + i);
        a1 += xv * widen8(w[1] + i);
        a2 += xv * widen8(w[2] + i);
        a3 += xv * widen8(w[3] + i);
    }
    out[0] = hsum(a0);
    out[1] = hsum(a1);
    out[2] = hsum(a2);
    out[3] = hsum(a3);
    for (int64_t i = k8; i < k; i++) {
        for (int r = 0; r < DOT_ROWS; r++) out[r] += x[i] * bf16_to_f32(w[r][i]);
    }
}
#endif

static inline float dot_tail_f32(const float *a, const float *b, int64_t from, int64_t k) {
    float s = 0.f;
    for (int64_t i = from; i < k; i++) s += a[i] * b[i];
    return s;
}

/* float32 x and W; `ahead` once per 64-byte line (16 floats). */
static inline void dot4_f32(const float *x, const float *const w[DOT_ROWS], int64_t k,
                            int ahead, float out[DOT_ROWS]) {
    const int64_t k8 = k & ~(int64_t)7, skip = ROW_PREFETCH_AHEAD * k;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < k8; i += 8) {
        if (ahead && (i & 15) == 0)
            for (int r = 0; r < DOT_ROWS; r++) prefetch_l2(w[r] + i + skip);
        const v8f xv = load8(x + i);
        a0 += xv * load8(w[0] + i);
        a1 += xv * load8(w[1] + i);
        a2 += xv * load8(w[2] + i);
        a3 += xv * load8(w[3] + i);
    }
    out[0] = hsum(a0) + dot_tail_f32(x, w[0], k8, k);
    out[1] = hsum(a1) + dot_tail_f32(x, w[1], k8, k);
    out[2] = hsum(a2) + dot_tail_f32(x, w[2], k8, k);
    out[3] = hsum(a3) + dot_tail_f32(x, w[3], k8, k);
}

#endif
