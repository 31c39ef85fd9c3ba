/* GGUF's 32-weight blocks as kernels/cpu/gguf_weight.py lays them out (codes without the
 * interleaved fp16 scales; float32 scales d and, for the 4-bit formats, offsets: w = d * u
 * + offset, or d * q for Q8_0), shared by the int8 kernel (linear_quant.c) and the float32
 * GEMM that widens them (gemm_f32.c). */
#ifndef TLE_GGUF_BLOCKS_H
#define TLE_GGUF_BLOCKS_H
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
/* The sum of an AVX2 register's 8 int32 lanes. */
static inline int32_t hsum8i(__m256i v) {
    __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E));
    lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xB1));
    return _mm_cvtsi128_si32(lo);
}
#endif

enum { QK = 32, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  /* GGML type ids */
/* Or'd into a type id: the weights are in linear_gguf_vnni.c's 16-output panels, not rows. */
enum { GGUF_VNNI_PANELS = 0x100 };

/* The GGUF kernel family's entry points, each defined in the file named beside it. */
/* linear_quant.c: y = x W^T (+ bias) on the blocks, rows of W (any x row count). */
int linear_gguf(int type, const uint8_t *qs, const float *d, const float *offset, int64_t n,
                int64_t k, const void *x, int x_bf16, int64_t m, const float *bias, void *y,
                int out_bf16, int num_threads);
/* linear_gguf_vnni.c: the same on 16-output panels (GGUF_VNNI_PANELS). */
int linear_gguf_vnni(int type, const uint8_t *codes, const float *d, const float *offset,
                     int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                     const float *bias, void *y, int out_bf16, int num_threads);
int dequantize_rows_gguf_vnni(int type, const uint8_t *codes, const float *d,
                              const float *offset, int64_t k, const int64_t *row_ids,
                              int64_t rows, float *out, int num_threads);

/* x [rows, k] (float32, or bf16 when is_bf16) quantized per 32-block to int8 as llama.cpp
 * does (gguf_quantize.c, which both matmul kernels call): codes q, scales, scale * sum(q), and sum(q) when isum is not NULL;
 * pair_layout interleaves block pairs for the 4-bit row kernels. */
void gguf_quantize_x(const void *x, int is_bf16, int64_t rows, int64_t k, int pair_layout,
                     int8_t *q, float *scale, float *qsum, int32_t *isum, int num_threads);

/* Block b of weight row j (k inputs a row) -> its 32 float32 values at o. */
static inline void dequantize_block(int type, const uint8_t *qs, const float *d,
                                    const float *offset, int64_t j, int64_t b, int64_t k,
                                    float *o) {
    const int64_t nblk = k / QK;
    const float scale = d[j * nblk + b];
    if (type == Q8_0) {
        const int8_t *q = (const int8_t *)qs + j * k + b * QK;
        for (int i = 0; i < QK; i++) o[i] = scale * (float)q[i];
        return;
    }
    const uint8_t *q = qs + j * (k / 2) + b * (QK / 2);
    const float off = offset[j * nblk + b];
#if defined(__AVX2__) && defined(__FMA__)
    /* gcc leaves the nibble loop below scalar; byte i holds elements i and i + 16 */
    const __m128i packed = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m256 vs = _mm256_set1_ps(scale), vo = _mm256_set1_ps(off);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int h = 0; h < 4; h++)
        _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(
            vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h])), vo));
#else
    for (int i = 0; i < QK / 2; i++) {
        o[i] = scale * (float)(q[i] & 0x0F) + off;
        o[i + 16] = scale * (float)(q[i] >> 4) + off;
    }
#endif
}

#endif
