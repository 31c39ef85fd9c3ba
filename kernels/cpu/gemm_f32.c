/* y = x W^T (+ bias) in float32 for any row count (a decode step's one row up to long
 * prefill chunks), with W packed once at load into 16-column panels: panel p holds
 * columns 16p..16p+15 as [k][16] (the last panel zero-padded). The panels are the only
 * copy of W that serving keeps (kernels/cpu/gemm.py unpack gives the rows back).
 *
 * Why: on a 2-core AVX2 EPYC (Zen 2) oneDNN's prepacked fp32 GEMM ran SmolLM2's layers at
 * 40-48 GFLOP/s a core for 64 rows, and pads every row count to a bucket; this register
 * tile (6 rows x 16 columns: 12 accumulators, 2 panel loads and 6 broadcasts per k) ran
 * them at 55-74, 1.2-1.6x faster from 3 to 2048 rows (thread CPU time, same process).
 *
 * Each output is one chain of FMAs over k = 0, 1, 2, ... in order, whichever rows share
 * its tile and whatever the row count or thread count: a row's result does not depend on
 * the rest of the batch. Threads split the panels (columns), never k.
 *
 * AVX2 + FMA intrinsics; elsewhere the same order in plain C (tests only: dispatch picks
 * this kernel where gemm_f32_preferred() says so).
 *
 * Over 300 lines: one panel GEMM with its packing, and the GGUF-widening variant that
 * reuses its micro-kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "prefetch.h"
#include "matmul.h"

enum { NR = 16, MR = 6 };

/* Whether this build's kernel is the fastest fp32 GEMM here: AVX2 + FMA without AVX-512,
 * where it was measured; with AVX-512, oneDNN's 16-wide kernels are kept. */
int gemm_f32_preferred(void) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* w [n, k] row-major -> out [(n + 15) / 16][k][16]. */
void gemm_f32_pack(const float *w, int64_t n, int64_t k, float *out, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= 65536)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int j = 0; j < NR; j++) {
            const int64_t col = p * NR + j;
            if (col < n) {
                const float *src = w + col * k;
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = 0.f;
            }
        }
    }
}

/* rows (<= MR) rows of x from a, times one panel b -> cols (<= NR) outputs of each row.
 * Meanwhile pf_bytes from pf are fetched into L2, a line every few k steps: the same
 * lines asked for in one burst before the tile gained a third as much (the burst waits
 * on the core's few outstanding-miss slots). */
static void tile(const float *a, int64_t k, const float *b, const float *bias, float *c,
                 int64_t ldc, int rows, int cols, const char *pf, int64_t pf_bytes) {
    /* Callers never pass more than MR rows; saying so lets gcc see that the write-back
     * below stays inside a caller's MR-row block (it warned -Wstringop-overflow on
     * gemm_gguf_f32's block[NR * MR] at -march=native without it). */
    if (rows > MR || cols > NR) __builtin_unreachable();
    float out[MR][NR];
    int64_t pf_at = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t pf_lines = (pf_bytes + 63) / 64;
    const int64_t step = pf_lines == 0 ? k : (k / pf_lines > 0 ? k / pf_lines : 1);
    /* A short tile repeats its first row: same work, results dropped. */
    const float *a0 = a, *a1 = a + (rows > 1 ? 1 : 0) * k, *a2 = a + (rows > 2 ? 2 : 0) * k;
    const float *a3 = a + (rows > 3 ? 3 : 0) * k, *a4 = a + (rows > 4 ? 4 : 0) * k;
    const float *a5 = a + (rows > 5 ? 5 : 0) * k;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t i0 = 0; i0 < k; i0 += step) {
        if (pf_at < pf_bytes) {
            prefetch_l2(pf + pf_at);
            pf_at += 64;
        }
        for (int64_t i = i0; i < (i0 + step < k ? i0 + step : k); i++) {
            const __m256 b0 = _mm256_loadu_ps(b + i * NR);
            const __m256 b1 = _mm256_loadu_ps(b + i * NR + 8);
            __m256 x = _mm256_broadcast_ss(a0 + i);
            c00 = _mm256_fmadd_ps(x, b0, c00);
            c01 = _mm256_fmadd_ps(x, b1, c01);
            x = _mm256_broadcast_ss(a1 + i);
            c10 = _mm256_fmadd_ps(x, b0, c10);
            c11 = _mm256_fmadd_ps(x, b1, c11);
            x = _mm256_broadcast_ss(a2 + i);
            c20 = _mm256_fmadd_ps(x, b0, c20);
            c21 = _mm256_fmadd_ps(x, b1, c21);
            x = _mm256_broadcast_ss(a3 + i);
            c30 = _mm256_fmadd_ps(x, b0, c30);
            c31 = _mm256_fmadd_ps(x, b1, c31);
            x = _mm256_broadcast_ss(a4 + i);
            c40 = _mm256_fmadd_ps(x, b0, c40);
            c41 = _mm256_fmadd_ps(x, b1, c41);
            x = _mm256_broadcast_ss(a5 + i);
            c50 = _mm256_fmadd_ps(x, b0, c50);
            c51 = _mm256_fmadd_ps(x, b1, c51);
        }
    }
    _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20), _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30), _mm256_storeu_ps(out[3] + 8, c31);
    _mm256_storeu_ps(out[4], c40), _mm256_storeu_ps(out[4] + 8, c41);
    _mm256_storeu_ps(out[5], c50), _mm256_storeu_ps(out[5] + 8, c51);
#else
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < NR; j++) {
            float s = 0.f;
            for (int64_t i = 0; i < k; i++) s = __builtin_fmaf(a[r * k + i], b[i * NR + j], s);
            out[r][j] = s;
        }
#endif
    for (; pf_at < pf_bytes; pf_at += 64) prefetch_l2(pf + pf_at);  /* more lines than k steps */
    for (int r = 0; r < rows; r++) {
        float *dst = c + r * ldc;
        if (bias)
            for (int j = 0; j < cols; j++) dst[j] = out[r][j] + bias[j];
        else
            memcpy(dst, out[r], (size_t)cols * sizeof(float));
    }
}

enum { FEW_PANELS = 6 };

/* One or two rows (a decode step's) against np <= 6 / rows panels from p0 on: still 12
 * accumulators, so the FMA latency hides behind the other outputs' chains while each
 * output keeps its one chain over k (the bits the 6-row tile gives the same row). Weights
 * stream once at memory speed, as the fused decode step needs; the 6-row tile would
 * repeat a single row six times. */
static void few_rows_tile(const float *a, int64_t k, const float *panels, int64_t p0, int np,
                          int rows, const float *bias, float *y, int64_t n) {
    float out[2][FEW_PANELS * NR];
    const int64_t stride = k * NR;
    const float *b[FEW_PANELS];
    for (int j = 0; j < FEW_PANELS; j++)  /* a short group repeats its last panel */
        b[j] = panels + (p0 + (j < np ? j : np - 1)) * stride;
#if defined(__AVX2__) && defined(__FMA__)
    if (rows == 1) {
        const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3], *b4 = b[4], *b5 = b[5];
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00;
        __m256 c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int64_t i = 0; i < k; i++) {
            const __m256 x = _mm256_broadcast_ss(a + i);
            const int64_t o = i * NR;
            c00 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + o), c00);
            c01 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + o + 8), c01);
            c10 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b1 + o), c10);
            c11 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b1 + o + 8), c11);
            c20 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b2 + o), c20);
            c21 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b2 + o + 8), c21);
            c30 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b3 + o), c30);
            c31 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b3 + o + 8), c31);
            c40 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b4 + o), c40);
            c41 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b4 + o + 8), c41);
            c50 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b5 + o), c50);
            c51 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b5 + o + 8), c51);
        }
        _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
        _mm256_storeu_ps(out[0] + 16, c10), _mm256_storeu_ps(out[0] + 24, c11);
        _mm256_storeu_ps(out[0] + 32, c20), _mm256_storeu_ps(out[0] + 40, c21);
        _mm256_storeu_ps(out[0] + 48, c30), _mm256_storeu_ps(out[0] + 56, c31);
        _mm256_storeu_ps(out[0] + 64, c40), _mm256_storeu_ps(out[0] + 72, c41);
        _mm256_storeu_ps(out[0] + 80, c50), _mm256_storeu_ps(out[0] + 88, c51);
    } else {
        const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *a1 = a + k;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00;
        __m256 c05 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
        for (int64_t i = 0; i < k; i++) {
            const int64_t o = i * NR;
            const __m256 w0 = _mm256_loadu_ps(b0 + o), w1 = _mm256_loadu_ps(b0 + o + 8);
            const __m256 w2 = _mm256_loadu_ps(b1 + o), w3 = _mm256_loadu_ps(b1 + o + 8);
            const __m256 w4 = _mm256_loadu_ps(b2 + o), w5 = _mm256_loadu_ps(b2 + o + 8);
            __m256 x = _mm256_broadcast_ss(a + i);
            c00 = _mm256_fmadd_ps(x, w0, c00), c01 = _mm256_fmadd_ps(x, w1, c01);
            c02 = _mm256_fmadd_ps(x, w2, c02), c03 = _mm256_fmadd_ps(x, w3, c03);
            c04 = _mm256_fmadd_ps(x, w4, c04), c05 = _mm256_fmadd_ps(x, w5, c05);
            x = _mm256_broadcast_ss(a1 + i);
            c10 = _mm256_fmadd_ps(x, w0, c10), c11 = _mm256_fmadd_ps(x, w1, c11);
            c12 = _mm256_fmadd_ps(x, w2, c12), c13 = _mm256_fmadd_ps(x, w3, c13);
            c14 = _mm256_fmadd_ps(x, w4, c14), c15 = _mm256_fmadd_ps(x, w5, c15);
        }
        _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
        _mm256_storeu_ps(out[0] + 16, c02), _mm256_storeu_ps(out[0] + 24, c03);
        _mm256_storeu_ps(out[0] + 32, c04), _mm256_storeu_ps(out[0] + 40, c05);
        _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
        _mm256_storeu_ps(out[1] + 16, c12), _mm256_storeu_ps(out[1] + 24, c13);
        _mm256_storeu_ps(out[1] + 32, c14), _mm256_storeu_ps(out[1] + 40, c15);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < np * NR; j++) {
            const float *col = b[j / NR] + j % NR;
            float s = 0.f;
            for (int64_t i = 0; i < k; i++) s = __builtin_fmaf(a[r * k + i], col[i * NR], s);
            out[r][j] = s;
        }
#endif
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < np; j++) {
            const int64_t c0 = (p0 + j) * NR;
            const int cols = n - c0 < NR ? (int)(n - c0) : NR;
            float *dst = y + r * n + c0;
            for (int c = 0; c < cols; c++) dst[c] = out[r][j * NR + c] + (bias ? bias[c0 + c] : 0.f);
        }
}

/* x [m, k], panels from gemm_f32_pack (n columns), bias [n] or NULL -> y [m, n]. Rows go
 * in chunks whose x slice stays in L2 (~512 KiB) while every panel passes over it; each
 * panel (k * 64 bytes) stays in L1/L2 while the chunk's tiles use it. */
void gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
              const float *bias, float *y, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
    if (m <= 0) return;
    if (m <= 2) {
        const int per = FEW_PANELS / (int)m;
        const int64_t groups = (num_panels + per - 1) / per;
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= 32768)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * per;
            const int np = num_panels - p0 < per ? (int)(num_panels - p0) : per;
            few_rows_tile(x, k, panels, p0, np, (int)m, bias, y, n);
        }
        return;
    }
    int64_t chunk = (512 * 1024 / (int64_t)sizeof(float)) / (k > 0 ? k : 1);
    chunk = chunk < MR ? MR : chunk - chunk % MR;
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        /* While a panel's row tiles run from cache, the next panel is fetched into L2 a
         * slice per tile, so its first tile does not wait on memory (the hardware
         * prefetchers stop at each 4 KiB page of the panel): over SmolLM2's layers, 2
         * threads of a Sapphire Rapids capped to AVX2, 1.22-1.44x at 4-64 rows and
         * 1.03-1.07x at 128-2048 (docs/BENCHMARKS.md). */
        const int64_t tiles = (m1 - m0 + MR - 1) / MR;
        const int64_t panel_bytes = k * NR * (int64_t)sizeof(float);
        const int64_t slice = ((panel_bytes / tiles + 63) / 64) * 64;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const char *next = (const char *)(panels + (p + 1) * k * NR);
            const int64_t next_bytes = p + 1 < num_panels ? panel_bytes : 0;
            for (int64_t r = m0, ahead = 0; r < m1; r += MR, ahead += slice) {
                const int rows = m1 - r < MR ? (int)(m1 - r) : MR;
                const int64_t bytes = next_bytes - ahead < slice ? next_bytes - ahead : slice;
                tile(x + r * k, k, panels + p * k * NR, bias ? bias + p * NR : NULL,
                     y + r * n + p * NR, n, rows, cols, next + ahead, bytes > 0 ? bytes : 0);
            }
        }
    }
}

/* Rows j0..j0+rows-1 of a GGUF weight -> float32 [rows][k], dequantize_rows_gguf's values. */
static void dequantize_rows(int type, const uint8_t *qs, const float *d, const float *offset,
                            int64_t j0, int rows, int64_t k, float *out) {
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < k / QK; b++)
            dequantize_block(type, qs, d, offset, j0 + r, b, k, out + r * k + b * QK);
}

/* x [m, k] -> panels of 16 rows, [ceil(m / 16)][k][16], zero-padded. */
static void pack_rows(const float *x, int64_t m, int64_t k, float *out) {
    for (int64_t p = 0; p < (m + NR - 1) / NR; p++)
        for (int j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            float *dst = out + p * k * NR + j;
            if (row < m)
                for (int64_t i = 0; i < k; i++) dst[i * NR] = x[row * k + i];
            else
                for (int64_t i = 0; i < k; i++) dst[i * NR] = 0.f;
        }
}

/* y [m, n] = x [m, k] W^T + bias for W in GGUF blocks, as the transposed product: x is
 * packed into 16-row panels once, and each thread widens six weight rows at a time to
 * float32 (vectorizable, contiguous: ~0.2 ns a weight against 1.3 for writing them into
 * column panels) and runs the same register tile with the weights broadcast, storing the
 * 6 x 16 block of y transposed. Each output is again one FMA chain over k in order. For
 * batches that amortize the widening (dispatch picks the row count), the fp32 tile beats
 * the int8 one on AVX2, whose integer multiplies share one pipe. Returns -1 for an unknown
 * type or a k that is not whole blocks, -2 without memory. */
int gemm_gguf_f32(int type, const uint8_t *qs, const float *d, const float *offset, int64_t n,
                  int64_t k, const float *x, int64_t m, const float *bias, float *y,
                  int num_threads) {
    if (k % QK != 0 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    const int64_t x_panels = (m + NR - 1) / NR, w_blocks = (n + MR - 1) / MR;
    float *xp = malloc((size_t)(x_panels * k * NR) * sizeof(float));
    if (xp == NULL) return -2;
    pack_rows(x, m, k, xp);
    /* The x panels go in chunks that stay in L2 (~384 KiB) while every weight block passes
     * over them: unchunked, a long prefill's x streamed from memory once per six weight rows
     * (2.6x the dense GEMM's time at 2048 rows, k 1536). Each chunk widens the weights again:
     * ~0.5 cycle a weight against >= 4 cycles of FMAs for a full chunk. */
    int64_t chunk = (384 * 1024 / (int64_t)sizeof(float)) / (k * NR);
    chunk = chunk < 1 ? 1 : chunk;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    {
        float *w = malloc((size_t)(MR * k) * sizeof(float));
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        float block[NR * MR];
        for (int64_t p0 = 0; p0 < x_panels; p0 += chunk) {
            const int64_t p1 = p0 + chunk < x_panels ? p0 + chunk : x_panels;
            #pragma omp for schedule(static)
            for (int64_t wb = 0; wb < w_blocks; wb++) {
                if (w == NULL) continue;
                const int64_t j0 = wb * MR;
                const int wrows = n - j0 < MR ? (int)(n - j0) : MR;
                dequantize_rows(type, qs, d, offset, j0, wrows, k, w);
                for (int64_t p = p0; p < p1; p++) {
                    const int xrows = m - p * NR < NR ? (int)(m - p * NR) : NR;
                    /* block[c][r] = W row j0 + c . x row 16p + r, c < wrows, r < 16 */
                    tile(w, k, xp + p * k * NR, NULL, block, NR, wrows, NR, NULL, 0);
                    for (int r = 0; r < xrows; r++) {
                        float *dst = y + (p * NR + r) * n + j0;
                        for (int c = 0; c < wrows; c++)
                            dst[c] = block[c * NR + r] + (bias ? bias[j0 + c] : 0.f);
                    }
                }
            }
        }
        free(w);
    }
    free(xp);
    return failed ? -2 : 0;
}
