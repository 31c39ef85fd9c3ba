/* y = x W^T (+ bias) with bf16 activations and bf16 weights, for the few rows of a decode
 * step; float32 accumulation, one rounding to bf16 per output (after the bias).
 *
 * Why: a decode row reads every weight once, so a step's time is the bytes of W over the
 * memory bandwidth. bf16 weights halve those bytes against float32, but torch's bf16
 * matmul on CPUs without native bf16 (AVX2) converts through slow paths, and oneDNN's
 * blocked GEMM, built for reuse, reads W below bandwidth at M = 1 (linear_f32.c).
 *
 * Two inner loops, chosen by the build's target (the native build follows the detected
 * CPU, or TLE_CPU_ISA's cap; kernels/cpu/features.py):
 * - AVX-512 BF16 (`vdpbf16ps`): 32 bf16 products a row per instruction, summed in pairs
 *   into float32 lanes.
 * - everywhere else: each bf16 widened to float32 with a 16-bit shift (exact) and
 *   multiplied with float32 FMA; GCC vector extensions, so the same source is AVX2,
 *   AVX-512F or SSE code.
 * The two sum in different orders, so their results may differ in the last float32 bits
 * before rounding; each is deterministic, and the fused decode step calls this same
 * function, which keeps it bit-equal to the layer-by-layer path on a given host.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "prefetch.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LINEAR_BF16_DPBF16 1
#else
#define LINEAR_BF16_DPBF16 0
#endif

/* Which inner loop this build carries: 1 vdpbf16ps, 0 widen-and-FMA (tests check it
 * against the CPU's features). */
int linear_bf16_uses_dpbf16(void) { return LINEAR_BF16_DPBF16; }

/* Rows of W a thread streams side by side: four independent loads and accumulators. */
#define ROWS 4

#if LINEAR_BF16_DPBF16

static inline __m512bh load32(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* out[i] = sum over k of x * w[i], the first k32 elements by vdpbf16ps; each line of the
 * rows ROW_PREFETCH_AHEAD further on is prefetched when `ahead` (the first x row) */
static void dot4(const uint16_t *x, const uint16_t *const w[ROWS], int64_t k, int ahead,
                 float out[ROWS]) {
    const int64_t k32 = k & ~(int64_t)31, skip = ROW_PREFETCH_AHEAD * k;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < k32; i += 32) {
        if (ahead)
            for (int r = 0; r < ROWS; r++) prefetch_l2(w[r] + i + skip);
        const __m512bh xv = load32(x + i);
        a0 = _mm512_dpbf16_ps(a0, xv, load32(w[0] + i));
        a1 = _mm512_dpbf16_ps(a1, xv, load32(w[1] + i));
        a2 = _mm512_dpbf16_ps(a2, xv, load32(w[2] + i));
        a3 = _mm512_dpbf16_ps(a3, xv, load32(w[3] + i));
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
    for (int64_t i = k32; i < k; i++) {
        const float xi = bf16_to_f32(x[i]);
        for (int r = 0; r < ROWS; r++) out[r] += xi * bf16_to_f32(w[r][i]);
    }
}

#else

#include "vec8.h"

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

/* x here is the row already widened to float32 (done once per call, not once per W row);
 * `ahead` as above, once per 64-byte line (32 bf16) */
static void dot4(const float *x, const uint16_t *const w[ROWS], int64_t k, int ahead,
                 float out[ROWS]) {
    const int64_t k8 = k & ~(int64_t)7, skip = ROW_PREFETCH_AHEAD * k;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < k8; i += 8) {
        if (ahead && (i & 31) == 0)
            for (int r = 0; r < ROWS; r++) prefetch_l2(w[r] + i + skip);
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
        for (int r = 0; r < ROWS; r++) out[r] += x[i] * bf16_to_f32(w[r][i]);
    }
}

#endif

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; all bf16, rows contiguous.
 * Returns 0, or -1 if the float32 copy of x could not be allocated (nothing written). */
int linear_bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int num_threads) {
#if LINEAR_BF16_DPBF16
    const uint16_t *xs = x;
#else
    float *xs = malloc((size_t)(m * k) * sizeof(float));
    if (xs == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) xs[i] = bf16_to_f32(x[i]);
#endif
    const int64_t groups = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j0 = g * ROWS;
        const int rows = n - j0 < ROWS ? (int)(n - j0) : ROWS;
        /* A short last group repeats its last row: same reads, results dropped. */
        const uint16_t *rows_w[ROWS];
        for (int r = 0; r < ROWS; r++) rows_w[r] = w + (j0 + (r < rows ? r : rows - 1)) * k;
        for (int64_t r = 0; r < m; r++) {
            float out[ROWS];
            dot4(xs + r * k, rows_w, k, r == 0, out);
            uint16_t *yr = y + r * n + j0;
            for (int i = 0; i < rows; i++)
                yr[i] = f32_to_bf16(out[i] + (bias ? bf16_to_f32(bias[j0 + i]) : 0.f));
        }
    }
#if !LINEAR_BF16_DPBF16
    free(xs);
#endif
    return 0;
}
