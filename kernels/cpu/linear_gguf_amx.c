/* GGUF-quantized linear layers (Q4_0, Q4_1, Q8_0 blocks, as kernels/cpu/gguf_weight.py
 * lays them out) on AMX: y = x W^T (+ bias) for batches of rows.
 *
 * Why: the int8 kernel (linear_quant.c) is bound by its 256-bit dot products once a batch
 * has more than a few rows, and bf16 dense layers on oneDNN's AMX kernels ran 3x faster.
 * Here each thread widens a block of 32 rows of W, all of K, to bf16 in a buffer that
 * stays in L1/L2, and multiplies it against every row of x with tile dot products: the
 * weights are read from memory once a call, in their 4.5-8.5 bit codes, and the widening
 * is paid once per weight per call, shared by all the rows of x.
 *
 * W is the tiles' A operand (rows = outputs n, 32 k a row), so its dequantized rows load
 * as they are written; x is relaid once a call into the B operand's pair layout (row r of
 * a tile holds, for each of 16 rows m, x[m][2r], x[m][2r + 1]). The C tiles are then
 * [n][m] and are transposed on the way out.
 *
 * Built only where the compiler targets AMX-BF16 and AVX-512 BF16 (-march=native on
 * Sapphire Rapids or later); other builds carry a stub that reports "not available", so a
 * capped build (TLE_CPU_ISA=avx2/avx512) has no tile instruction.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define GGUF_AMX 1
#include "amx.h"
#else
#define GGUF_AMX 0
#endif

/* 1 when this build carries the tile kernel (tests check it against the CPU's flags). */
int linear_gguf_amx_built(void) { return GGUF_AMX; }

#if GGUF_AMX

enum { NB = 32,      /* rows of W a thread widens at once: two A tiles */
       MB = 16,      /* rows of x in one B tile */
       KS = 32 };    /* k per tile step: 16 pairs, 64 bytes a tile row */

/* 32 k of row m of x as 16 bf16 pairs (float32 x rounds to nearest even, as torch does). */
static inline __m512i load_pairs(const void *x, int x_bf16, int64_t m, int64_t k, int64_t k0) {
    if (x_bf16) return _mm512_loadu_si512((const uint16_t *)x + m * k + k0);
    const float *row = (const float *)x + m * k + k0;
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
}

/* x [m, k] -> B tiles: tile (mb, s) at xb + (mb * steps + s) * 256 dwords; rows of x past
 * m are zeros. */
static void relayout_x(const void *x, int x_bf16, int64_t m, int64_t k, uint32_t *xb,
                       int64_t mb, int64_t s) {
    const int64_t steps = k / KS;
    __m512i r[16];
    for (int c = 0; c < MB; c++) {
        const int64_t row = mb * MB + c;
        r[c] = row < m ? load_pairs(x, x_bf16, row, k, s * KS) : _mm512_setzero_si512();
    }
    transpose16(r);
    uint32_t *dst = xb + (mb * steps + s) * (MB * 16);
    for (int i = 0; i < 16; i++) _mm512_store_si512(dst + 16 * i, r[i]);
}

/* Rows j0 .. j0 + rows - 1 of W (all k) -> bf16 at buf, row-major, NB rows of k; rows
 * past the layer's end are zeros. */
static void widen_rows(int type, const uint8_t *qs, const float *d, const float *offset,
                       int64_t j0, int rows, int64_t k, uint16_t *buf) {
    const int64_t nblk = k / QK;
    for (int i = 0; i < rows; i++) {
        const int64_t j = j0 + i;
        uint16_t *out = buf + (int64_t)i * k;
        const float *dj = d + j * nblk;
        if (type == Q8_0) {
            const int8_t *q = (const int8_t *)qs + j * k;
            for (int64_t b = 0; b < nblk; b++) {
                const __m512 s = _mm512_set1_ps(dj[b]);
                const __m256i codes = _mm256_loadu_si256((const __m256i *)(q + b * QK));
                const __m512 lo = _mm512_mul_ps(s, _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes))));
                const __m512 hi = _mm512_mul_ps(s, _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1))));
                _mm512_storeu_si512(out + b * QK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        } else {
            const uint8_t *q = qs + j * (k / 2);
            const float *oj = offset + j * nblk;
            /* A block's 32 weights take at most 16 values (d * u + offset, u < 16): widen
             * those 16 once and look the codes up with one word permute, instead of
             * converting and FMA-ing every weight (~30% fewer uops a block). Same bits. */
            const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                               14, 15);
            const __m256i shifts = _mm256_setr_epi64x(0, 0, 4, 4);
            const __m256i mask = _mm256_set1_epi8(0x0F);
            for (int64_t b = 0; b < nblk; b++) {
                const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(dj[b]), iota,
                                                      _mm512_set1_ps(oj[b]));
                const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
                /* byte i holds elements i (low nibble) and i + 16 (high nibble): the low
                 * lane keeps the low nibbles, the high lane the high ones */
                const __m256i packed = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(q + b * (QK / 2))));
                const __m256i codes = _mm256_and_si256(_mm256_srlv_epi64(packed, shifts), mask);
                _mm512_storeu_si512(out + b * QK, _mm512_permutexvar_epi16(
                    _mm512_cvtepu8_epi16(codes), table));
            }
        }
    }
    if (rows < NB) memset(buf + (int64_t)rows * k, 0, (size_t)(NB - rows) * k * sizeof(uint16_t));
}

/* acc [NB n][2 * MB m] float32 (C tiles as stored) -> y rows m0 .. m0 + mrows - 1,
 * columns j0 .. j0 + nrows - 1, bias added, in y's dtype. */
static void write_out(const float *acc, int64_t m0, int mrows, int64_t j0, int nrows,
                      const float *bias, void *y, int out_bf16, int64_t n) {
    for (int nh = 0; nh < NB / 16; nh++) {
        const int nvalid = nrows - 16 * nh;
        if (nvalid <= 0) break;
        const __mmask16 keep = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
        const int64_t jn = j0 + 16 * nh;
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + jn) : _mm512_setzero_ps();
        for (int mh = 0; mh < 2; mh++) {
            const int mvalid = mrows - 16 * mh;
            if (mvalid <= 0) break;
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_load_si512(acc + (16 * nh + i) * (2 * MB) + 16 * mh);
            transpose16(r);
            for (int i = 0; i < mvalid && i < 16; i++) {
                const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[i]), b);
                const int64_t row = m0 + 16 * mh + i;
                if (out_bf16)
                    _mm256_mask_storeu_epi16((uint16_t *)y + row * n + jn, keep,
                                             (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_mask_storeu_ps((float *)y + row * n + jn, keep, v);
            }
        }
    }
}

int linear_gguf_amx(int type, const uint8_t *qs, const float *d, const float *offset,
                    int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                    const float *bias, void *y, int out_bf16, int num_threads) {
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0) || k <= 0 || k % KS || n <= 0
        || m <= 0 || (type != Q8_0 && offset == NULL) || amx_permission() != 0)
        return -1;
    const int64_t steps = k / KS, mblocks = (m + MB - 1) / MB, nblocks = (n + NB - 1) / NB;
    uint32_t *xb = aligned_alloc(64, (size_t)mblocks * steps * MB * 16 * sizeof(uint32_t));
    if (xb == NULL) return -1;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    if (nblocks < num_threads) num_threads = (int)nblocks;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static) collapse(2)
        for (int64_t mb = 0; mb < mblocks; mb++)
            for (int64_t s = 0; s < steps; s++) relayout_x(x, x_bf16, m, k, xb, mb, s);
        uint16_t *wbuf = aligned_alloc(64, (size_t)NB * k * sizeof(uint16_t));
        float *acc = aligned_alloc(64, NB * 2 * MB * sizeof(float));
        if (wbuf == NULL || acc == NULL) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        } else {
            amx_configure_full_tiles();  /* C 0-3, A (W) 4-5, B (x) 6-7 */
        }
        /* a thread without buffers skips its blocks; the call then reports failure */
        #pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (wbuf == NULL || acc == NULL) continue;
            const int64_t j0 = nb * NB;
            const int nrows = (int)(n - j0 < NB ? n - j0 : NB);
            widen_rows(type, qs, d, offset, j0, nrows, k, wbuf);
            const int64_t wstride = k * (int64_t)sizeof(uint16_t);
            for (int64_t mb = 0; mb < mblocks; mb += 2) {
                const int pair = mb + 1 < mblocks;
                const uint32_t *b0 = xb + mb * steps * (MB * 16);
                const uint32_t *b1 = b0 + steps * (MB * 16);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                if (pair) {
                    for (int64_t s = 0; s < steps; s++) {
                        _tile_loadd(4, wbuf + s * KS, wstride);
                        _tile_loadd(5, wbuf + 16 * k + s * KS, wstride);
                        _tile_loadd(6, b0 + s * (MB * 16), 64);
                        _tile_loadd(7, b1 + s * (MB * 16), 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                } else {
                    for (int64_t s = 0; s < steps; s++) {
                        _tile_loadd(4, wbuf + s * KS, wstride);
                        _tile_loadd(5, wbuf + 16 * k + s * KS, wstride);
                        _tile_loadd(6, b0 + s * (MB * 16), 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(2, 5, 6);
                    }
                }
                /* acc[n][m]: tile 0 n 0-15 m 0-15, 1 n 0-15 m 16-31, 2 n 16-31 m 0-15, 3 */
                const int64_t row_bytes = 2 * MB * sizeof(float);
                _tile_stored(0, acc, row_bytes);
                _tile_stored(1, acc + 16, row_bytes);
                _tile_stored(2, acc + 16 * 2 * MB, row_bytes);
                _tile_stored(3, acc + 16 * 2 * MB + 16, row_bytes);
                const int64_t m0 = mb * MB;
                const int mrows = (int)(m - m0 < 2 * MB ? m - m0 : 2 * MB);
                write_out(acc, m0, mrows, j0, nrows, bias, y, out_bf16, n);
            }
        }
        if (wbuf != NULL && acc != NULL) _tile_release();
        free(wbuf);
        free(acc);
    }
    free(xb);
    return failed ? -1 : 0;
}

/* 0 when the tile kernel can run in this process (built, and the kernel granted the tile
 * state), else -1: the caller keeps the other GGUF paths. */
int linear_gguf_amx_ready(void) { return amx_permission() == 0 ? 0 : -1; }

#else

int linear_gguf_amx(int type, const uint8_t *qs, const float *d, const float *offset,
                    int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                    const float *bias, void *y, int out_bf16, int num_threads) {
    (void)type; (void)qs; (void)d; (void)offset; (void)n; (void)k; (void)x; (void)x_bf16;
    (void)m; (void)bias; (void)y; (void)out_bf16; (void)num_threads;
    return -1;
}

int linear_gguf_amx_ready(void) { return -1; }

#endif
