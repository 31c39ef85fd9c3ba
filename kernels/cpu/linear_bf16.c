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
#include "row_dot.h"
#include "matmul.h"

/* The two inner loops live in row_dot.h (shared with moe.c). */
#define LINEAR_BF16_DPBF16 ROW_DOT_DPBF16

/* Which inner loop this build carries: 1 vdpbf16ps, 0 widen-and-FMA (tests check it
 * against the CPU's features). */
int linear_bf16_uses_dpbf16(void) { return LINEAR_BF16_DPBF16; }

/* Rows of W a thread streams side by side: four independent loads and accumulators. */
#define ROWS DOT_ROWS

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
            dot4_bf16(xs + r * k, rows_w, k, r == 0, out);
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
