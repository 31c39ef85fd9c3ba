/* Weight-only quantized linear layers on GGUF's blocks: y = x W^T (+ bias) with W kept
 * in the file's Q4_0, Q4_1 or Q8_0 codes and scales (kernels/cpu/gguf_weight.py lays them out:
 * codes without the interleaved fp16 scales, scales and offsets as float32 arrays).
 *
 * Why not dequantize: decoding one token reads every weight once, so its time is the
 * weights' bytes over the memory bandwidth; Q4_1 is 5 bits a weight against fp32's 32.
 * The activations are quantized to int8 per block of 32 (one float scale each, as
 * llama.cpp does), so the inner product is an integer dot of bytes: 32 multiply-adds in
 * two instructions on AVX2 (maddubs + madd) or one with VNNI, where converting weights to
 * float and FMA-ing them costs 6-8 instructions per 8 weights: compute-bound decode.
 * Without AVX2 the same loops run in plain C.
 *
 * Over 300 lines: the AVX2 / VNNI and portable variants of the GGUF row kernel side by
 * side, whose bits the tests compare.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_blocks.h"
#include "prefetch.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { PREFETCH_PAIRS = 4 };

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                    _mm256_set1_epi16(1)));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Two 4-bit blocks (b, b + 1: 32 bytes of nibbles) . x in pair layout -> 8 int32, lanes
 * 0-3 summing to block b's dot, lanes 4-7 to block b + 1's. */
static inline __m256i q4_pair_dot(const uint8_t *qs, __m256i xa, __m256i xb) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)qs);
    const __m256i low = _mm256_and_si256(packed, mask);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), low, xa), high, xb);
#else
    /* int16 lanes hold two 4-bit x int8 products (|.| <= 2 * 15 * 127), so the two halves
     * add without saturating before one widening madd */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(low, xa),
                                              _mm256_maddubs_epi16(high, xb)),
                             _mm256_set1_epi16(1));
#endif
}

/* One Q8_0 block . x block -> 8 int32 summing to the dot (sign trick: maddubs multiplies
 * unsigned by signed, so |w| against x carrying w's sign). */
static inline __m256i q8_dot(const int8_t *qs, __m256i x) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)qs);
    return dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* Four pair vectors (blocks 0..7 as q4_pair_dot lays them out) -> the 8 block sums. */
static inline __m256i reduce_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    /* h = [b0 b2 b4 b6 | b1 b3 b5 b7] */
    return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Eight per-block vectors -> the 8 block sums, in order. */
static inline __m256i reduce_blocks(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* a = [b0lo b1lo b2lo b3lo | b0hi b1hi b2hi b3hi], b likewise for blocks 4..7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

static const int32_t LANE_MASKS[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Eight floats from p, or the first `count` and zeros (no read past them). */
static inline __m256 load_upto8(const float *p, int count) {
    if (count == 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(LANE_MASKS + 8 - count)));
}

/* acc += block sums (8 int32) * d[0:count] * xs[0:count] */
static inline __m256 scale_add(__m256 acc, __m256i sums, const float *d, __m256 xs, int count) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(load_upto8(d, count), xs), acc);
}

static float q8_dot_row(const int8_t *qs, const float *d, const int8_t *xq, const float *xs,
                        int64_t nblk) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b += 8) {
        const int count = nblk - b < 8 ? (int)(nblk - b) : 8;
        __m256i v[8];
        for (int i = 0; i < 8; i++)
            v[i] = i < count ? q8_dot(qs + (b + i) * QK,
                                      _mm256_loadu_si256((const __m256i *)(xq + (b + i) * QK)))
                             : _mm256_setzero_si256();
        acc = scale_add(acc, reduce_blocks(v), d + b, load_upto8(xs + b, count), count);
    }
    return hsum8(acc);
}

/* Odd last 4-bit block (x in natural order) -> its integer dot. */
static inline int32_t q4_single_dot(const uint8_t *qs, const int8_t *xq) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                           _mm256_set1_epi8(0x0F));
    return hsum8i(dot_u8s8(_mm256_setzero_si256(), codes,
                           _mm256_loadu_si256((const __m256i *)xq)));
}

/* For weight rows a and b (b may repeat a) and one x row: out[i] = sum over blocks of
 * d[blk] * xs[blk] * (codes . x)[blk]. Two rows share every x load and the loop's
 * bookkeeping; eight blocks' integer sums are reduced to one vector before the float
 * scaling, so per block the float work is an eighth of a convert-multiply-add. */
static void dot_rows(int is_q8, const uint8_t *qa, const uint8_t *qb, const float *da,
                     const float *db, const int8_t *xq, const float *xs, int64_t nblk,
                     float out[2]) {
    __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    if (is_q8) {  /* row by row: sixteen live block vectors would spill */
        out[0] = q8_dot_row((const int8_t *)qa, da, xq, xs, nblk);
        out[1] = qb == qa ? out[0] : q8_dot_row((const int8_t *)qb, db, xq, xs, nblk);
        return;
    }
    const int64_t paired = nblk & ~(int64_t)1;
    for (int64_t b = 0; b < paired; b += 8) {
        const int count = paired - b < 8 ? (int)(paired - b) : 8;
        __m256i pa[4], pb[4];
        for (int i = 0; i < 4; i++) {
            if (2 * i < count) {
                const int8_t *x = xq + (b + 2 * i) * QK;
                const __m256i xa = _mm256_loadu_si256((const __m256i *)x);
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(x + 32));
                pa[i] = q4_pair_dot(qa + (b + 2 * i) * (QK / 2), xa, xb);
                pb[i] = q4_pair_dot(qb + (b + 2 * i) * (QK / 2), xa, xb);
            } else {
                pa[i] = pb[i] = zero;
            }
        }
        const __m256 x_scales = load_upto8(xs + b, count);
        acc_a = scale_add(acc_a, reduce_pairs(pa[0], pa[1], pa[2], pa[3]), da + b, x_scales, count);
        acc_b = scale_add(acc_b, reduce_pairs(pb[0], pb[1], pb[2], pb[3]), db + b, x_scales, count);
    }
    out[0] = hsum8(acc_a);
    out[1] = hsum8(acc_b);
    if (paired < nblk) {
        const int8_t *x = xq + paired * QK;
        out[0] += da[paired] * xs[paired] * (float)q4_single_dot(qa + paired * (QK / 2), x);
        out[1] += db[paired] * xs[paired] * (float)q4_single_dot(qb + paired * (QK / 2), x);
    }
}

/* Batches (m >= 2): one weight row against four x rows at a time, so a block's codes are
 * unpacked once for four rows and the block scaling is done per block pair in float (no
 * cross-lane reduction, which needed more registers than a tile has). The sums round in
 * another order than dot_rows's, so a request's logits may differ in the last bits with
 * its batch (greedy text diverged after 5-13 tokens on 2 of 6 prompts); a tile with
 * dot_rows's exact arithmetic measured 170 against 148 ms a weight pass at 64 rows. xs_pairs holds, per
 * x row and block pair, the x scales spread as the pair's int32 lanes are: [s_b x4,
 * s_b+1 x4]. */
static void q4_row_tile(const uint8_t *qw, const float *dw, int64_t nblk, const int8_t *xq,
                        const float *xs, const float *xs_pairs, int64_t k, int rows,
                        float out[4]) {
    const int64_t npairs = nblk / 2;
    const __m256i mask = _mm256_set1_epi8(0x0F);
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t p = 0; p < npairs; p++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(qw + p * QK));
        const __m256i low = _mm256_and_si256(packed, mask);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        const __m256 w_scales = _mm256_set_m128(_mm_set1_ps(dw[2 * p + 1]), _mm_set1_ps(dw[2 * p]));
        for (int r = 0; r < 4; r++) {
            if (r >= rows) break;
            const int8_t *x = xq + r * k + p * 2 * QK;
            const __m256i xa = _mm256_loadu_si256((const __m256i *)x);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(x + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            const __m256i dots = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(),
                                                                         low, xa), high, xb);
#else
            const __m256i dots = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(low, xa),
                                                                    _mm256_maddubs_epi16(high, xb)),
                                                   ones);
#endif
            const __m256 scales = _mm256_mul_ps(w_scales,
                                                _mm256_loadu_ps(xs_pairs + (r * npairs + p) * 8));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scales, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        out[r] = hsum8(acc[r]);
        if (nblk & 1) {  /* a last odd block, x in natural order */
            const int64_t b = nblk - 1;
            out[r] += dw[b] * xs[r * nblk + b] *
                      (float)q4_single_dot(qw + b * (QK / 2), xq + r * k + b * QK);
        }
    }
}

static void q8_row_tile(const int8_t *qw, const float *dw, int64_t nblk, const int8_t *xq,
                        const float *xs, int64_t k, int rows, float out[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t b = 0; b < nblk; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qw + b * QK));
        const __m256i w_abs = _mm256_sign_epi8(w, w);
        for (int r = 0; r < 4; r++) {
            if (r >= rows) break;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * QK));
            const __m256i dots = _mm256_madd_epi16(
                _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                                     _mm256_set1_ps(dw[b] * xs[r * nblk + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum8(acc[r]);
}
#else
static float dot_one(int is_q8, const uint8_t *qs, const float *d, const int8_t *xq,
                     const float *xs, int64_t nblk) {
    float total = 0.f;
    for (int64_t b = 0; b < nblk; b++) {
        int32_t isum = 0;
        if (is_q8) {
            const int8_t *w = (const int8_t *)qs + b * QK, *x = xq + b * QK;
            for (int i = 0; i < QK; i++) isum += (int32_t)w[i] * x[i];
        } else {
            const uint8_t *w = qs + b * (QK / 2);
            /* where element i of block b sits in the pair layout (gguf_quantize_x) */
            const int paired = (b ^ 1) < nblk;
            const int8_t *x = xq + (paired ? (b & ~(int64_t)1) * QK : b * QK);
            const int half = paired ? (int)(b & 1) * 16 : 0, stride = paired ? 32 : 16;
            for (int i = 0; i < QK / 2; i++)
                isum += (int32_t)(w[i] & 0x0F) * x[half + i] + (int32_t)(w[i] >> 4) * x[stride + half + i];
        }
        total += d[b] * xs[b] * (float)isum;
    }
    return total;
}

static void dot_rows(int is_q8, const uint8_t *qa, const uint8_t *qb, const float *da,
                     const float *db, const int8_t *xq, const float *xs, int64_t nblk,
                     float out[2]) {
    out[0] = dot_one(is_q8, qa, da, xq, xs, nblk);
    out[1] = qb == qa ? out[0] : dot_one(is_q8, qb, db, xq, xs, nblk);
}
#endif

/* y[r, j] = dot + the Q4 offsets' part + bias, stored as float32 or bf16. */
static inline void store_output(void *y, int out_bf16, int64_t n, int64_t r, int64_t j, float dot,
                                const float *offset, const float *qsums, const float *bias,
                                int64_t nblk) {
    float out = dot;
    if (offset) out += dot_f32(offset + j * nblk, qsums + r * nblk, nblk);
    if (bias) out += bias[j];
    if (out_bf16) ((uint16_t *)y)[r * n + j] = f32_to_bf16(out);
    else ((float *)y)[r * n + j] = out;
}

/* y [m, n] (fp32, or bf16 when out_bf16) = x W^T + bias for x [m, k] (fp32, or bf16 when
 * x_bf16). x is quantized here first (gguf_quantize_x; pair layout for the 4-bit
 * formats) into one malloc'd buffer: one call from Python instead of two and four
 * tensors, which cost more than the matmul itself for the small layers of a decode step.
 * The weight offsets multiply the quantized x's block sums (scale * sum(q)), as llama.cpp's
 * Q8_1 does: the codes' large mean (u in 0..15) and the offset then see the same x, so
 * their errors cancel; with the exact sum(x) the error was 2.2x larger on SmolLM2. Each thread streams its own slice of W's
 * rows once; a row stays in L1 while every activation row meets it.
 * Returns -1 for an unknown type or a k that is not whole blocks, -2 without memory. */
static int linear_gguf_impl(int type, const uint8_t *qs, const float *d, const float *offset,
                            int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                            const float *bias, void *y, int out_bf16, int num_threads,
                            int allow_tiles) {
    /* Panels run their own kernel at every m, row-invariant as it is (allow_tiles moot). */
    if (type & GGUF_VNNI_PANELS)
        return linear_gguf_vnni(type & ~GGUF_VNNI_PANELS, qs, d, offset, n, k, x, x_bf16, m,
                                bias, y, out_bf16, num_threads);
    if (k % QK != 0 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    const int is_q8 = type == Q8_0;
    const int64_t nblk = k / QK, row_bytes = is_q8 ? k : k / 2;
    float *scales = malloc((size_t)(m * nblk) * 2 * sizeof(float) + (size_t)(m * k));
    if (scales == NULL) return -2;
    float *qsums = scales + m * nblk;
    int8_t *xq = (int8_t *)(qsums + m * nblk);
    gguf_quantize_x(x, x_bf16, m, k, !is_q8, xq, scales, qsums, NULL, num_threads);
#if defined(__AVX2__)
    if (m >= 2 && allow_tiles) {
        const int64_t npairs = nblk / 2;
        float *xs_pairs = NULL;
        if (!is_q8 && npairs > 0) {
            xs_pairs = malloc((size_t)(m * npairs) * 8 * sizeof(float));
            if (xs_pairs == NULL) { free(scales); return -2; }
            for (int64_t r = 0; r < m; r++)
                for (int64_t p = 0; p < npairs; p++)
                    for (int i = 0; i < 8; i++)
                        xs_pairs[(r * npairs + p) * 8 + i] = scales[r * nblk + 2 * p + i / 4];
        }
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k * m >= 65536)
        for (int64_t j = 0; j < n; j++) {
            for (int64_t r0 = 0; r0 < m; r0 += 4) {
                const int rows = m - r0 < 4 ? (int)(m - r0) : 4;
                float dots[4];
                if (is_q8)
                    q8_row_tile((const int8_t *)qs + j * row_bytes, d + j * nblk, nblk,
                                xq + r0 * k, scales + r0 * nblk, k, rows, dots);
                else
                    q4_row_tile(qs + j * row_bytes, d + j * nblk, nblk, xq + r0 * k,
                                scales + r0 * nblk, xs_pairs + r0 * npairs * 8, k, rows, dots);
                for (int r = 0; r < rows; r++)
                    store_output(y, out_bf16, n, r0 + r, j, dots[r], offset, qsums, bias, nblk);
            }
        }
        free(xs_pairs);
        free(scales);
        return 0;
    }
#endif
    const int64_t pairs = (n + 1) / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n * k * m >= 65536)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t j0 = 2 * p, j1 = j0 + 1 < n ? j0 + 1 : j0;  /* odd n: the last twice */
#if defined(__AVX2__)
        /* The next row pairs' codes, a few pairs ahead: decode streams W from DRAM once,
         * and the hardware prefetcher alone left the kernel waiting on it. Into L2, as the
         * dense row kernels do (prefetch.h): on Llama-3.2-1B's layers at one row, 2 threads,
         * Zen 4, Q8_0 read 27.2 GB/s (25.3 into L1) and Q4_1 24.8 (21.9); SmolLM2's alike. */
        const char *ahead = (const char *)(qs + (j0 + 2 * PREFETCH_PAIRS) * row_bytes);
        if (j0 + 2 * PREFETCH_PAIRS + 1 < n)
            for (int64_t off = 0; off < 2 * row_bytes; off += 64) prefetch_l2(ahead + off);
#endif
        for (int64_t r = 0; r < m; r++) {
            float dots[2];
            dot_rows(is_q8, qs + j0 * row_bytes, qs + j1 * row_bytes, d + j0 * nblk,
                     d + j1 * nblk, xq + r * k, scales + r * nblk, nblk, dots);
            for (int64_t j = j0; j <= j1; j++)
                store_output(y, out_bf16, n, r, j, dots[j - j0], offset, qsums, bias, nblk);
        }
    }
    free(scales);
    return 0;
}

/* Rows of W as float32 [rows, k]: the embedding lookup of a quantized table (row_ids), or
 * all of it (row_ids NULL) for a large batch's matmul. */
int dequantize_rows_gguf(int type, const uint8_t *qs, const float *d, const float *offset,
                         int64_t k, const int64_t *row_ids, int64_t rows, float *out,
                         int num_threads) {
    if (type & GGUF_VNNI_PANELS)
        return dequantize_rows_gguf_vnni(type & ~GGUF_VNNI_PANELS, qs, d, offset, k, row_ids,
                                         rows, out, num_threads);
    if (k % QK != 0 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    const int64_t nblk = k / QK;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t j = row_ids ? row_ids[r] : r;
        for (int64_t b = 0; b < nblk; b++)
            dequantize_block(type, qs, d, offset, j, b, k, out + r * k + b * QK);
    }
    return 0;
}

int linear_gguf(int type, const uint8_t *qs, const float *d, const float *offset, int64_t n,
                int64_t k, const void *x, int x_bf16, int64_t m, const float *bias, void *y,
                int out_bf16, int num_threads) {
    return linear_gguf_impl(type, qs, d, offset, n, k, x, x_bf16, m, bias, y, out_bf16,
                            num_threads, 1);
}

/* linear_gguf with one row's arithmetic (dot_rows) for every row, whatever m is: the sums
 * round as for a single row, so a row's result does not depend on its batch (the
 * engine's batch_invariant mode). The VNNI panel kernel is so for any m already: each x
 * row runs the same instructions in its own registers, whichever rows share its pass. */
int linear_gguf_rows(int type, const uint8_t *qs, const float *d, const float *offset,
                     int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                     const float *bias, void *y, int out_bf16, int num_threads) {
    return linear_gguf_impl(type, qs, d, offset, n, k, x, x_bf16, m, bias, y, out_bf16,
                            num_threads, 0);
}
