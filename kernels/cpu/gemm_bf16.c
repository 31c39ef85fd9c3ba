/* y = x W^T (+ bias) in bf16 for batches (a decode step's rows up to prefill chunks) on
 * AVX-512 BF16 (and one row on AMX hosts, whose batches run gemm_bf16_amx below on the
 * same panels), with W packed once at load into pairs of 16-output panels:
 * panel p holds outputs 16p..16p+15 as [k / 2][16][2], so one 512-bit load is two
 * consecutive k of 16 outputs, what one vdpbf16ps multiplies by a pair of x broadcast to
 * every lane (32 multiply-adds, no sum crossing lanes). The panels are the only copy of W
 * that serving keeps (kernels/cpu/gemm.py unpack_bf16 gives the rows back).
 *
 * Why: at decode batches (16-64 rows) oneDNN's prepacked bf16 GEMM ran SmolLM2's layers
 * at 60-92% of this core's vdpbf16ps peak with the weights in cache, and served a step
 * ~30% slower than that: each step streams every weight from memory once, and that read
 * did not overlap its compute. Here a tile is 2 panels x up to 8 rows (16 accumulators,
 * 2 loads and 8 broadcasts per 16 vdpbf16ps), every row group of the batch meets a panel
 * pair while it sits in L1/L2, and the first group asks for the pair PREFETCH_PAIRS ahead
 * into L2, so the next weights arrive while this pair computes. Rows are not padded to
 * oneDNN's buckets either.
 *
 * Each output is one chain of vdpbf16ps over k = 0, 2, 4, ... in order, whatever rows
 * share its tile and whatever the row count or thread count: a row's result does not
 * depend on the rest of the batch. Threads split the panel pairs, never k.
 *
 * Built only where the compiler targets AVX-512 BF16 and BW (-march=native on Cooper Lake,
 * Zen 4 or later); other builds carry a stub that reports "not built". The packing is
 * plain C in every build.
 *
 * Over 300 lines: the vdpbf16ps and AMX tile variants of one panel GEMM share its
 * packing and edge handling.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "matmul.h"
#include "prefetch.h"
#include "silu.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMM_BF16 1
#include <immintrin.h>
#else
#define GEMM_BF16 0
#endif
#if GEMM_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GEMM_AMX 1
#include <stdlib.h>
#include "amx.h"
#else
#define GEMM_AMX 0
#endif

/* PREFETCH_PAIRS: how far ahead the first row group asks for W (see the header). On AMX
 * builds (Sapphire Rapids and later) none: there the hardware prefetchers kept up alone,
 * and asking two pairs ahead made one row over Llama-3.2-1B's layers 0.84x the dense row
 * kernel where without it the panels ran level with it (1.01x; 2-core Sapphire Rapids). */
enum { LANES = 16, PANELS = 2, ROWS_MAX = 8, PREFETCH_PAIRS = GEMM_AMX ? 0 : 2 };

/* 1 when this build carries the kernel (tests check it against the CPU's flags). */
int gemm_bf16_built(void) { return GEMM_BF16; }

/* 1 when it carries the AMX one too (gemm_bf16_amx). */
int gemm_bf16_amx_built(void) { return GEMM_AMX; }

/* w [n, k] bf16 -> [pairs * 2][ceil(k / 2)][16][2], pairs = ceil(n / 32): outputs past n
 * and a last odd k hold zeros, so every tile runs whole. */
void gemm_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out, int num_threads) {
    const int64_t kp = (k + 1) / 2, panels = (n + PANELS * LANES - 1) / (PANELS * LANES) * PANELS;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k >= 65536)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = out + p * kp * LANES * 2;
        for (int j = 0; j < LANES; j++) {
            const int64_t col = p * LANES + j;
            for (int64_t i = 0; i < kp; i++)
                for (int t = 0; t < 2; t++) {
                    const int64_t at = 2 * i + t;
                    dst[(i * LANES + j) * 2 + t] = (col < n && at < k) ? w[col * k + at] : 0;
                }
        }
    }
}

#if GEMM_BF16

static inline __m512bh pair_of(const uint16_t *x) {
    int32_t bits;
    memcpy(&bits, x, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(bits);
}

/* `rows` x rows (a constant per inlined copy, so the loops unroll into registers) against
 * one panel pair: out[r][h] = the 16 outputs of panel h for row r, bias not added. With
 * `ahead` set, the same offsets of a later pair are fetched into L2 along the way. */
static inline __attribute__((always_inline)) void pair_rows(
        const int rows, const uint16_t *x, int64_t k, int64_t kp, const uint16_t *w,
        const uint16_t *ahead, __m512 out[ROWS_MAX][PANELS]) {
    const int64_t stride = kp * LANES * 2;
    const uint16_t *w0 = w, *w1 = w + stride;
    __m512 acc[ROWS_MAX][PANELS];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i++) {
        if (ahead) {
            prefetch_l2(ahead + i * LANES * 2);
            prefetch_l2(ahead + stride + i * LANES * 2);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + i * LANES * 2);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + i * LANES * 2);
        for (int r = 0; r < rows; r++) {
            const __m512bh a = pair_of(x + r * k + 2 * i);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    for (int r = 0; r < rows; r++) out[r][0] = acc[r][0], out[r][1] = acc[r][1];
}

#define PAIR_CASE(R) case R: pair_rows(R, x, k, kp, w, ahead, out); break;
static void pair_any(int rows, const uint16_t *x, int64_t k, int64_t kp, const uint16_t *w,
                     const uint16_t *ahead, __m512 out[ROWS_MAX][PANELS]) {
    switch (rows) {
        PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4)
        PAIR_CASE(5) PAIR_CASE(6) PAIR_CASE(7) PAIR_CASE(8)
    }
}

/* 16 outputs from j0 (the first `count` of them) of one row, + bias, rounded as torch
 * rounds (bf16.h's nearest-even, lane by lane). */
static inline void store16(uint16_t *dst, int count, __m512 v, const uint16_t *bias) {
    const __mmask16 keep = (__mmask16)((1u << count) - 1u);
    if (bias) v = _mm512_add_ps(v, bf16x16_widen(_mm256_maskz_loadu_epi16(keep, bias)));
    _mm256_mask_storeu_epi16(dst, keep, bf16x16_round(v));
}

/* 16 outputs + bias as store16 rounds them, kept as float32 values. */
static inline __m512 rounded16(__m512 v, const uint16_t *bias) {
    if (bias) v = _mm512_add_ps(v, bf16x16_widen(_mm256_loadu_si256((const __m256i *)bias)));
    return bf16x16_widen(bf16x16_round(v));
}
#endif

/* y [m, n] bf16 = x [m, k] bf16 W^T + bias [n] bf16 (or NULL), W as gemm_bf16_pack laid
 * it out. x's rows go in chunks that stay in L2 (~512 KiB, half a Zen 4 core's) while
 * every panel pair passes over them: at 256 KiB Llama-3.2-1B's layers ran 0.90-0.93x
 * oneDNN from 256 rows (its down projection's 8192-wide rows re-streamed W every 16 rows),
 * at 512 KiB 0.98-1.03x. Returns -1 for a build without the kernel or an odd k (x is read
 * in pairs). */
int gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
              const uint16_t *bias, uint16_t *y, int num_threads) {
#if GEMM_BF16
    if (k % 2 != 0) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t kp = k / 2, pairs = (n + PANELS * LANES - 1) / (PANELS * LANES);
    const int64_t pair_elems = PANELS * kp * LANES * 2;
    int64_t chunk = (512 * 1024 / 2) / k;
    chunk = chunk < ROWS_MAX ? ROWS_MAX : chunk - chunk % ROWS_MAX;
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; q++) {
            const uint16_t *w = panels + q * pair_elems;
            /* Ahead within the whole weight: a thread's next pairs are its own (static
             * split), and the first chunk is where W comes from memory. */
            const uint16_t *ahead = (PREFETCH_PAIRS && m0 == 0 && q + PREFETCH_PAIRS < pairs)
                                    ? w + PREFETCH_PAIRS * pair_elems : NULL;
            for (int64_t r0 = m0; r0 < m1; r0 += ROWS_MAX) {
                const int rows = m1 - r0 < ROWS_MAX ? (int)(m1 - r0) : ROWS_MAX;
                __m512 out[ROWS_MAX][PANELS];
                pair_any(rows, x + r0 * k, k, kp, w, r0 == m0 ? ahead : NULL, out);
                for (int h = 0; h < PANELS; h++) {
                    const int64_t j0 = (q * PANELS + h) * LANES;
                    if (j0 >= n) break;
                    const int count = n - j0 < LANES ? (int)(n - j0) : LANES;
                    for (int r = 0; r < rows; r++)
                        store16(y + (r0 + r) * n + j0, count, out[r][h], bias ? bias + j0 : NULL);
                }
            }
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)panels; (void)n; (void)bias; (void)y; (void)num_threads;
    return -1;
#endif
}

#if GEMM_AMX
enum { TILE_ROWS = 16, TILE_K = 32, TILE_ELEMS = TILE_ROWS * TILE_K };
/* x's share of L2 (half an AMX core's 2 MiB), the most rows a chunk takes when k is
 * split, and the chunk below which k is split (see gemm_bf16_amx). */
enum { TILES_CHUNK_BYTES = 1024 * 1024, ROWS_CHUNK = 512, KSPLIT_BELOW_ROWS = 128 };

/* x [m, k] -> A tiles, tile (b, s) = rows 16b.. x k 32s.. as 16 rows of 64 bytes at
 * xt + (b * steps + s) * TILE_ELEMS; rows past m are zeros, so the last tile needs no
 * padded copy of its own. (Read in place instead, 16 rows k * 2 bytes apart, the speed
 * was the same.) */
static void tile_x(const uint16_t *x, int64_t m, int64_t k, uint16_t *xt, int64_t b, int64_t s) {
    uint16_t *dst = xt + (b * (k / TILE_K) + s) * TILE_ELEMS;
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t row = b * TILE_ROWS + r;
        const __m512i v = row < m ? _mm512_loadu_si512(x + row * k + s * TILE_K)
                                  : _mm512_setzero_si512();
        _mm512_store_si512(dst + r * TILE_K, v);
    }
}

/* One or two A tiles' rows (tiles 4 and 5, consecutive k steps TILE_ELEMS apart) against
 * one panel pair (B tiles 6 and 7: a panel's 16 pairs of k at a step are 16 rows of 64
 * bytes, exactly a B tile) over `steps` steps -> c [32 rows][32 outputs] float32, rows
 * ldc apart; with `resume`, on top of the partial sums already there (stored float32
 * sums reload exactly, so splitting k does not change a bit). No software prefetch:
 * asking for the pair two ahead into L2, as gemm_bf16 does, made Llama-3.2-1B's layers
 * 0.85x oneDNN at 64 rows where without it they ran 1.13x (2-core Sapphire Rapids). */
static inline __attribute__((always_inline)) void tiles_block(
        const int two, const uint16_t *a0, const uint16_t *a1, const uint16_t *w,
        int64_t panel_elems, int64_t steps, float *c, int64_t ldc, int resume) {
    const int64_t cb = ldc * (int64_t)sizeof(float);
    if (resume) {
        _tile_loadd(0, c, cb);
        _tile_loadd(1, c + LANES, cb);
        if (two) {
            _tile_loadd(2, c + TILE_ROWS * ldc, cb);
            _tile_loadd(3, c + TILE_ROWS * ldc + LANES, cb);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *b = w + s * TILE_K * LANES;
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + panel_elems, 64);
        _tile_loadd(4, a0 + s * TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + s * TILE_ELEMS, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, cb);
    _tile_stored(1, c + LANES, cb);
    if (two) {
        _tile_stored(2, c + TILE_ROWS * ldc, cb);
        _tile_stored(3, c + TILE_ROWS * ldc + LANES, cb);
    }
}
#endif

#if GEMM_AMX
/* gemm_bf16_amx, and with inter > 0 gemm_bf16_amx_silu: then n = 2 * inter, and each
 * thread takes a gate pair q and its up pair q + inter / 32 for the same rows, so the two
 * halves of an output meet in the epilogue. */
static int tiles_gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels,
                      int64_t n, const uint16_t *bias, uint16_t *y, int num_threads,
                      int64_t inter) {
    if (k % TILE_K != 0 || amx_permission() != 0) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t kp = k / 2, pairs = (n + PANELS * LANES - 1) / (PANELS * LANES);
    const int64_t panel_elems = kp * LANES * 2, steps = k / TILE_K;
    const int64_t blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
    uint16_t *xt = aligned_alloc(64, (size_t)blocks * steps * TILE_ELEMS * sizeof(uint16_t));
    if (xt == NULL) return -1;
    /* Rows of x go in chunks whose tiles (~1 MiB) stay in L2 while every panel pair passes
     * over them; W is streamed again for each chunk. Where k is so wide that a chunk would
     * hold under KSPLIT_BELOW_ROWS rows, k goes in blocks of kc instead, with up to
     * ROWS_CHUNK rows, and a chunk's partial sums wait in c (float32) for the next block:
     * Llama-3.2-1B's 8192-wide down projection had left 64 rows a chunk and ran its layers
     * at 0.81x oneDNN at 256 rows, 0.92-0.94x split (2-core Sapphire Rapids). */
    int64_t rows_chunk = (TILES_CHUNK_BYTES / 2) / k / (2 * TILE_ROWS) * (2 * TILE_ROWS), kc = k;
    if (rows_chunk < KSPLIT_BELOW_ROWS && m > rows_chunk) {
        rows_chunk = (m + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS) * (2 * TILE_ROWS);
        if (rows_chunk > ROWS_CHUNK) rows_chunk = ROWS_CHUNK;
        kc = (TILES_CHUNK_BYTES / 2) / rows_chunk / TILE_K * TILE_K;
        kc = kc < TILE_K ? TILE_K : kc > k ? k : kc;
    }
    if (rows_chunk < 2 * TILE_ROWS) rows_chunk = 2 * TILE_ROWS;
    const int64_t ldc = pairs * PANELS * LANES;
    float *c = NULL;
    if (kc < k && (c = aligned_alloc(64, (size_t)rows_chunk * ldc * sizeof(float))) == NULL) {
        free(xt);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads) if (m * n * k >= 65536)
    {
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t s = 0; s < steps; s++) tile_x(x, m, k, xt, b, s);
        float acc[2][2 * TILE_ROWS * PANELS * LANES] __attribute__((aligned(64)));
        const int64_t runs = inter ? inter / (PANELS * LANES) : pairs, halves = inter ? 2 : 1;
        amx_configure_full_tiles();
        for (int64_t m0 = 0; m0 < m; m0 += rows_chunk) {
            const int64_t m1 = m0 + rows_chunk < m ? m0 + rows_chunk : m;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t s0 = k0 / TILE_K, ns = (k - k0 < kc ? k - k0 : kc) / TILE_K;
                const int last = k0 + kc >= k;
                #pragma omp for schedule(static)
                for (int64_t run = 0; run < runs; run++) {
                    for (int64_t r0 = m0; r0 < m1; r0 += 2 * TILE_ROWS) {
                        const uint16_t *a0 = xt + ((r0 / TILE_ROWS) * steps + s0) * TILE_ELEMS;
                        const uint16_t *a1 = a0 + steps * TILE_ELEMS;
                        float *cq[2];
                        const int64_t ldq = c ? ldc : PANELS * LANES;
                        for (int half = 0; half < halves; half++) {
                            const int64_t q = run + half * runs;  /* the up pair second */
                            const uint16_t *w =
                                panels + q * PANELS * panel_elems + s0 * TILE_K * LANES;
                            cq[half] = c ? c + (r0 - m0) * ldc + q * PANELS * LANES : acc[half];
                            if (r0 + TILE_ROWS < m1)
                                tiles_block(1, a0, a1, w, panel_elems, ns, cq[half], ldq, k0 > 0);
                            else
                                tiles_block(0, a0, a1, w, panel_elems, ns, cq[half], ldq, k0 > 0);
                        }
                        if (!last) continue;
                        const int rows = m1 - r0 < 2 * TILE_ROWS ? (int)(m1 - r0) : 2 * TILE_ROWS;
                        for (int h = 0; h < PANELS; h++) {
                            const int64_t j0 = (run * PANELS + h) * LANES;
                            if (inter) {
                                /* gate and up rounded as gemm_bf16_amx stores them, then
                                 * silu_mul_bf16's arithmetic (silu.h): the same bits. */
                                for (int r = 0; r < rows; r++) {
                                    const __m512 g = rounded16(
                                        _mm512_load_ps(cq[0] + r * ldq + h * LANES),
                                        bias ? bias + j0 : NULL);
                                    const __m512 u = rounded16(
                                        _mm512_load_ps(cq[1] + r * ldq + h * LANES),
                                        bias ? bias + inter + j0 : NULL);
                                    _mm256_storeu_si256((__m256i *)(y + (r0 + r) * inter + j0),
                                                        silu_mul16_bf16(g, u));
                                }
                                continue;
                            }
                            if (j0 >= n) break;
                            const int count = n - j0 < LANES ? (int)(n - j0) : LANES;
                            for (int r = 0; r < rows; r++)
                                store16(y + (r0 + r) * n + j0, count,
                                        _mm512_load_ps(cq[0] + r * ldq + h * LANES),
                                        bias ? bias + j0 : NULL);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    free(c);
    free(xt);
    return 0;
}
#endif

/* gemm_bf16 on AMX tiles, on the same panels: each output one chain of tile dot products
 * over k in steps of 32 (so, like gemm_bf16, a row's bits do not depend on the other rows,
 * but they need not be gemm_bf16's bits). Returns -1 where the build has no tiles, Linux
 * refused the tile state, k is not a multiple of 32, or a buffer could not be had. */
int gemm_bf16_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
                  const uint16_t *bias, uint16_t *y, int num_threads) {
#if GEMM_AMX
    return tiles_gemm(x, m, k, panels, n, bias, y, num_threads, 0);
#else
    (void)x; (void)m; (void)k; (void)panels; (void)n; (void)bias; (void)y; (void)num_threads;
    return -1;
#endif
}

/* The MLP's gate_up matmul and silu_mul in one pass: y [m, inter] = silu_mul(x W^T + bias)
 * for W = [gate; up] of 2 * inter outputs, bit for bit what gemm_bf16_amx then
 * silu_mul_bf16 give, without writing and reading back the [m, 2 * inter] product.
 * -1 as gemm_bf16_amx, or where inter is not a multiple of 32 (a panel pair). */
int gemm_bf16_amx_silu(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels,
                       int64_t inter, const uint16_t *bias, uint16_t *y, int num_threads) {
#if GEMM_AMX
    if (inter <= 0 || inter % (PANELS * LANES) != 0) return -1;
    return tiles_gemm(x, m, k, panels, 2 * inter, bias, y, num_threads, inter);
#else
    (void)x; (void)m; (void)k; (void)panels; (void)inter; (void)bias; (void)y;
    (void)num_threads;
    return -1;
#endif
}
