/* y = x W^T (+ bias) in float32 for the few rows a decode step has (a single stream's
 * one token up to a handful of sequences).
 *
 * Why: at M = 1 every weight is read once and used once, so the matmul is a stream over
 * W at memory bandwidth. oneDNN's prepacked path reached ~16 GB/s over SmolLM2's layers
 * on a 2-core EPYC whose cores read ~35 GB/s; its blocking is built for reuse that
 * M = 1 does not have. Here each thread walks its own contiguous slice of W's rows, four
 * rows at a time (four independent streams and accumulators), with x in L1.
 *
 * GCC vector extensions, not intrinsics: the same source becomes AVX2, AVX-512 or SSE
 * code from the build's -march, and the 8-wide type splits where registers are narrower.
 */
#include <stdint.h>

#include "row_dot.h"
#include "matmul.h"

/* x [m, k], w [n, k], bias [n] or NULL, y [m, n]; all float32, rows contiguous. */
void linear_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    const int64_t groups = (n + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= 32768)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j0 = g * 4;
        const int rows = n - j0 < 4 ? (int)(n - j0) : 4;
        /* A short last group repeats its last row: same reads, results dropped. */
        const float *w0 = w + j0 * k;
        const float *w1 = w + (j0 + (rows > 1 ? 1 : 0)) * k;
        const float *w2 = w + (j0 + (rows > 2 ? 2 : rows - 1)) * k;
        const float *w3 = w + (j0 + rows - 1) * k;
        const float *const rows_w[4] = {w0, w1, w2, w3};
        for (int64_t r = 0; r < m; r++) {
            float out[4];
            dot4_f32(x + r * k, rows_w, k, r == 0, out);
            float *yr = y + r * n + j0;
            for (int i = 0; i < rows; i++) yr[i] = out[i] + (bias ? bias[j0 + i] : 0.f);
        }
    }
}
