/* GGUF-quantized linear layers (Q4_0, Q4_1, Q8_0) on AVX-512 VNNI: y = x W^T (+ bias) with
 * W in its codes, repacked at load into 16-output panels, for any number of rows.
 *
 * Why: the row kernel (linear_quant.c) takes one weight row against up to four x rows on
 * 256-bit vectors and reduces each block's sum across lanes; at decode batches it ran at
 * 0.53-0.58x of oneDNN's dense bf16 GEMM on a Zen 4 host. Here a 512-bit lane is an output
 * column: one vpdpbusd multiplies 4 codes of 16 columns by 4 bytes of one x row broadcast
 * to every lane (64 multiply-adds), no sum crosses lanes, and a panel's codes, loaded once
 * per block, serve up to ROWS_MAX x rows held in registers.
 *
 * Panel layout (kernels/cpu/gguf_weight.py, vnni_panels): outputs in panels of 16 (the
 * last padded with zero codes and scales); per panel, per block b, the codes as 32-bit
 * lanes, lane j = 4 consecutive code bytes of output 16 p + j:
 *   Q4_0 / Q4_1: 4 vectors; vector i holds the file's bytes 4i..4i+3, whose low nibbles
 *                are elements 4i..4i+3 and high nibbles elements 16+4i..16+4i+3;
 *   Q8_0:        8 vectors; vector i holds elements 4i..4i+3, stored as q + 128 (unsigned,
 *                as vpdpbusd's first operand must be).
 * Scales d (and Q4_1's offsets m) as [panel][block][16] float32.
 *
 * The integer block dot starts from the format's constant part, so it stays exact:
 * Q4_0's w = d (u - 8) and Q8_0's stored q + 128 both start at -8 or -128 times the x
 * block's code sum. Q4_1's offset m is added in float, times scale * sum(x codes), as the
 * row kernel does.
 *
 * Built only where the compiler targets AVX-512 VNNI and BW (-march=native on Cascade Lake,
 * Zen 4 or later); other builds carry a stub that reports "not built".
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "gguf_blocks.h"
#include "prefetch.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define GGUF_VNNI 1
#include <immintrin.h>
#else
#define GGUF_VNNI 0
#endif

/* 1 when this build carries the VNNI kernel (tests check it against the CPU's flags). */
int linear_gguf_vnni_built(void) { return GGUF_VNNI; }

enum { LANES = 16 };  /* outputs a panel holds, one per 512-bit lane */

#if GGUF_VNNI

enum { ROWS_MAX = 8 };

static inline __m512i broadcast4(const int8_t *p) {
    return _mm512_set1_epi32(*(const int32_t *)p);
}

/* One panel (16 outputs) against `rows` x rows (a constant per inlined copy, so the row
 * loops unroll into registers): out[r] = the 16 outputs of x row r, bias not added. */
static inline __attribute__((always_inline)) void panel_rows(
        const int type, const int rows, const uint8_t *codes, const float *d, const float *m,
        int64_t nblk, const int8_t *xq, int64_t k, const float *xs, const float *qsum,
        const int32_t *isum, __m512 out[ROWS_MAX]) {
    const int is_q8 = type == Q8_0;
    const int64_t block_bytes = is_q8 ? 8 * 64 : 4 * 64;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS_MAX];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *w = codes + b * block_bytes;
        /* The panel's next blocks, into L2: at a few rows a decode step streams W from
         * memory once, and a panel is one run of bytes. */
        prefetch_l2(w + 8 * block_bytes);
        if (is_q8) prefetch_l2(w + 8 * block_bytes + 256);
        __m512i dot[ROWS_MAX];
        for (int r = 0; r < rows; r++) {
            const int32_t base = type == Q4_1 ? 0 : (is_q8 ? -128 : -8) * isum[r * nblk + b];
            dot[r] = _mm512_set1_epi32(base);
        }
        const int8_t *x = xq + b * QK;
        if (is_q8) {
            for (int i = 0; i < 8; i++) {
                const __m512i wv = _mm512_loadu_si512(w + 64 * i);
                for (int r = 0; r < rows; r++)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], wv, broadcast4(x + r * k + 4 * i));
            }
        } else {
            for (int i = 0; i < 4; i++) {
                const __m512i packed = _mm512_loadu_si512(w + 64 * i);
                const __m512i low = _mm512_and_si512(packed, nibble);
                const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                for (int r = 0; r < rows; r++) {
                    dot[r] = _mm512_dpbusd_epi32(dot[r], low, broadcast4(x + r * k + 4 * i));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], high,
                                                 broadcast4(x + r * k + 16 + 4 * i));
                }
            }
        }
        const __m512 dv = _mm512_loadu_ps(d + b * LANES);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), dv),
                                     _mm512_set1_ps(xs[r * nblk + b]), acc[r]);
        if (type == Q4_1) {
            const __m512 mv = _mm512_loadu_ps(m + b * LANES);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(qsum[r * nblk + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
}

/* panel_rows with the format and the row count as constants (the switch picks a copy). */
#define PANEL_CASE(T, R) case R: panel_rows(T, R, codes, d, m, nblk, xq, k, xs, qsum, isum, out); break;
#define PANEL_TYPE(T)                                                                       \
    static void panel_##T(int rows, const uint8_t *codes, const float *d, const float *m,    \
                          int64_t nblk, const int8_t *xq, int64_t k, const float *xs,        \
                          const float *qsum, const int32_t *isum, __m512 out[ROWS_MAX]) {    \
        switch (rows) {                                                                     \
            PANEL_CASE(T, 1) PANEL_CASE(T, 2) PANEL_CASE(T, 3) PANEL_CASE(T, 4)             \
            PANEL_CASE(T, 5) PANEL_CASE(T, 6) PANEL_CASE(T, 7) PANEL_CASE(T, 8)             \
        }                                                                                   \
    }
PANEL_TYPE(Q4_0)
PANEL_TYPE(Q4_1)
PANEL_TYPE(Q8_0)

/* Row r's 16 outputs of panel p (+ bias), the first `count` of them, as float32 or bf16. */
static inline void store_panel(void *y, int out_bf16, int64_t n, int64_t r, int64_t j0,
                               int count, __m512 v, const float *bias) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + j0));
    if (!out_bf16) {
        _mm512_mask_storeu_ps((float *)y + r * n + j0, keep, v);
        return;
    }
    float tmp[LANES];
    _mm512_storeu_ps(tmp, v);
    uint16_t *dst = (uint16_t *)y + r * n + j0;
    for (int j = 0; j < count; j++) dst[j] = f32_to_bf16(tmp[j]);
}
#endif

/* y [m, n] (float32, or bf16 when out_bf16) = x W^T + bias for x [m, k] (float32, or bf16
 * when x_bf16), W as vnni panels (above), bias [n] float32 or NULL. Threads split the
 * panels; each runs its panels against every row group of x, so a panel's codes are read
 * from memory once and from L1 for the other groups.
 * Returns -1 for an unknown type, a k that is not whole blocks or a build without VNNI,
 * -2 without memory. */
int linear_gguf_vnni(int type, const uint8_t *codes, const float *d, const float *offset,
                     int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                     const float *bias, void *y, int out_bf16, int num_threads) {
#if GGUF_VNNI
    if (k % QK != 0 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    const int64_t nblk = k / QK, panels = (n + LANES - 1) / LANES;
    const int64_t panel_bytes = nblk * (type == Q8_0 ? 8 : 4) * 64;
    float *xs = malloc((size_t)(m * nblk) * (2 * sizeof(float) + sizeof(int32_t)) + (size_t)(m * k));
    if (xs == NULL) return -2;
    float *qsum = xs + m * nblk;
    int32_t *isum = (int32_t *)(qsum + m * nblk);
    int8_t *xq = (int8_t *)(isum + m * nblk);
    gguf_quantize_x(x, x_bf16, m, k, 0, xq, xs, qsum, isum, num_threads);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k * m >= 65536)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *pc = codes + p * panel_bytes;
        const float *pd = d + p * nblk * LANES;
        const float *pm = type == Q4_1 ? offset + p * nblk * LANES : NULL;
        const int64_t j0 = p * LANES;
        const int count = n - j0 < LANES ? (int)(n - j0) : LANES;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS_MAX) {
            const int rows = m - r0 < ROWS_MAX ? (int)(m - r0) : ROWS_MAX;
            __m512 out[ROWS_MAX];
            const int8_t *gx = xq + r0 * k;
            const float *gs = xs + r0 * nblk, *gq = qsum + r0 * nblk;
            const int32_t *gi = isum + r0 * nblk;
            if (type == Q8_0) panel_Q8_0(rows, pc, pd, pm, nblk, gx, k, gs, gq, gi, out);
            else if (type == Q4_1) panel_Q4_1(rows, pc, pd, pm, nblk, gx, k, gs, gq, gi, out);
            else panel_Q4_0(rows, pc, pd, pm, nblk, gx, k, gs, gq, gi, out);
            for (int r = 0; r < rows; r++)
                store_panel(y, out_bf16, n, r0 + r, j0, count, out[r], bias);
        }
    }
    free(xs);
    return 0;
#else
    (void)type; (void)codes; (void)d; (void)offset; (void)n; (void)k; (void)x; (void)x_bf16;
    (void)m; (void)bias; (void)y; (void)out_bf16; (void)num_threads;
    return -1;
#endif
}

/* Rows of W held as panels (above) -> float32 [rows, k]: the embedding lookup of a tied
 * table (row_ids, checked by the caller), or all of it (row_ids NULL). Plain C: the lookup
 * reads a few rows, and every build links it. Returns -1 for an unknown type or a k that
 * is not whole blocks. */
int dequantize_rows_gguf_vnni(int type, const uint8_t *codes, const float *d,
                              const float *offset, int64_t k, const int64_t *row_ids,
                              int64_t rows, float *out, int num_threads) {
    if (k % QK != 0 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    const int64_t nblk = k / QK, words = type == Q8_0 ? 8 : 4;
    const int64_t panel_bytes = nblk * words * LANES * 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t j = row_ids ? row_ids[r] : r, p = j / LANES, lane = j % LANES;
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *block = codes + p * panel_bytes + b * words * LANES * 4;
            const float scale = d[(p * nblk + b) * LANES + lane];
            float *o = out + r * k + b * QK;
            for (int64_t i = 0; i < words; i++) {
                const uint8_t *c = block + (i * LANES + lane) * 4;
                for (int t = 0; t < 4; t++) {
                    if (type == Q8_0) {
                        o[4 * i + t] = scale * (float)((int)c[t] - 128);
                    } else {
                        const float low = (float)(c[t] & 0x0F), high = (float)(c[t] >> 4);
                        const float off = type == Q4_1 ? offset[(p * nblk + b) * LANES + lane]
                                                       : -8.f * scale;
                        o[4 * i + t] = scale * low + off;
                        o[16 + 4 * i + t] = scale * high + off;
                    }
                }
            }
        }
    }
    return 0;
}
