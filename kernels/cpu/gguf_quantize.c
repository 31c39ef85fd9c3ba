/* Activations quantized to int8 per 32-value block as llama.cpp does, for both GGUF matmul
 * kernels (linear_quant.c's rows, linear_gguf_vnni.c's panels): a file of its own so
 * neither kernel calls into the other's file for it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "gguf_blocks.h"

/* Block values x[base : base + 32] (fp32 or bf16) -> int8 codes round(v * 127 / amax),
 * elements 0-15 to lo and 16-31 to hi; returns amax, the codes' sum in *sum. The vector
 * versions give the scalar one's bits: |v| maxima are exact in any order, and
 * cvtps2dq rounds to nearest even as lrintf does. Vectorized because it ran ~1 ns a
 * value scalar: a quarter of a 64-row VNNI matmul's time on SmolLM2's 576-wide layers. */
static inline float quantize_block(const void *x, int is_bf16, int64_t base, int8_t *lo,
                                   int8_t *hi, int *sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 v[2];
    for (int h = 0; h < 2; h++)
        v[h] = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                             _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + 16 * h))), 16))
                       : _mm512_loadu_ps((const float *)x + base + 16 * h);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv));
    _mm_storeu_si128((__m128i *)lo, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)hi, _mm512_cvtepi32_epi8(q1));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    return amax;
#elif defined(__AVX2__)
    __m256 v[4];
    for (int h = 0; h < 4; h++)
        v[h] = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                             _mm_loadu_si128((const __m128i *)((const uint16_t *)x + base + 8 * h))), 16))
                       : _mm256_loadu_ps((const float *)x + base + 8 * h);
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int h = 0; h < 4; h++) q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], inv));
    /* packs work within 128-bit halves: dwords come out as [a0-3 b0-3 c0-3 d0-3 | a4-7 ...] */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(bytes, 1));
    *sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    return amax;
#else
    float v[QK];
    if (is_bf16) {
        for (int i = 0; i < QK; i++) v[i] = bf16_to_f32(((const uint16_t *)x)[base + i]);
    } else {
        memcpy(v, (const float *)x + base, sizeof v);
    }
    float amax = 0.f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int total = 0;
    for (int i = 0; i < QK; i++) {
        const int qi = (int)lrintf(v[i] * inv);
        (i < 16 ? lo : hi - 16)[i] = (int8_t)qi;
        total += qi;
    }
    *sum = total;
    return amax;
#endif
}

/* x [rows, k] (fp32 or bf16) -> q [rows, k] int8, scale and scale * sum(q) [rows, k / 32],
 * and sum(q) itself when isum is not NULL.
 * pair_layout (for the 4-bit formats): each pair of blocks (b, b + 1) is stored as
 * x_b[0:16], x_b1[0:16], x_b[16:32], x_b1[16:32], the order one 32-byte load of the two
 * blocks' nibbles yields after masking (low nibbles) and shifting (high nibbles); a last
 * odd block keeps its natural order. */
void gguf_quantize_x(const void *x, int is_bf16, int64_t rows, int64_t k, int pair_layout,
                     int8_t *q, float *scale, float *qsum, int32_t *isum, int num_threads) {
    const int64_t nblk = k / QK;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nblk; b++) {
            /* Where block b's halves go (see pair_layout above). */
            const int paired = pair_layout && (b ^ 1) < nblk;
            int8_t *dst = q + r * k + (paired ? (b & ~(int64_t)1) * QK : b * QK);
            const int half = paired ? (int)(b & 1) * 16 : 0, stride = paired ? 32 : 16;
            int block_sum;
            const float amax = quantize_block(x, is_bf16, r * k + b * QK, dst + half,
                                              dst + stride + half, &block_sum);
            scale[r * nblk + b] = amax / 127.f;
            qsum[r * nblk + b] = amax / 127.f * (float)block_sum;
            if (isum) isum[r * nblk + b] = block_sum;
        }
    }
}
