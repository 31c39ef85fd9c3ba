/* The fused mixture-of-experts op (kernels/torch_moe.py) with its experts' weights in
 * MXFP4, as gpt-oss checkpoints store them (kernels/torch_mxfp4.py defines the format):
 * each weight row is blocks of 32 FP4 E2M1 values, two a byte (low nibble first), with
 * one E8M0 scale byte 2^(s - 127) per block. x, biases and outputs are float32 or bf16 as
 * in moe.c, whose structure this shares through moe.h: grouping by expert, work items,
 * roundings, slot sums.
 *
 * Why: gpt-oss-20b's experts are 10 GB in MXFP4 and 38 GB widened to bf16; kept as they
 * are, one token's four experts a layer are 4.25 bits a weight to read instead of 16.
 *
 * How: each group of DOT_ROWS weight rows is decoded, once per token block, into the
 * thread's buffer as the dense rows the dot product reads (row_dot.h): bf16 where it runs
 * vdpbf16ps on bf16 activations, float32 otherwise. An FP4 value times a power of two is
 * exact in both, so a decoded row is exactly the dequantized weight row
 * (torch_mxfp4.dequantize), and every output is the dense kernel's chain of operations on
 * those weights: row-invariant as it is, and the decode's cost is shared by every token
 * of the block. The decode goes through a 16-entry table: on AVX-512 one register of
 * floats that vpermps indexes with the nibbles, 32 values at a time; elsewhere a scalar
 * table lookup.
 */
#include <stdint.h>

#include "moe.h"
#include "prefetch.h"

enum { MX_BLOCK = 32, MX_BYTES = 16 };

/* E2M1: sign bit 3, two exponent bits (bias 1), one mantissa bit. */
static const float FP4_VALUES[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                     -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* 2^(s - 127) from its exponent bits: s = 0 is the subnormal 2^-127, 255 (NaN in the
 * format) comes out as inf. */
static inline float e8m0(uint8_t s) {
    union { uint32_t u; float f; } v;
    v.u = s ? (uint32_t)s << 23 : 0x00400000u;
    return v.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 32 values of one block: the 16 bytes widened to 16 lanes, the low nibbles (the even
 * values) and the high ones (odd) looked up by vpermps, scaled, and interleaved back into
 * order by two two-source permutes. */
static inline void decode_block(const uint8_t *b, uint8_t s, __m512 *lo, __m512 *hi) {
    const __m512 table = _mm512_loadu_ps(FP4_VALUES), scale = _mm512_set1_ps(e8m0(s));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    const __m512i nib_lo = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    const __m512i nib_hi = _mm512_srli_epi32(bytes, 4);
    const __m512 even = _mm512_mul_ps(_mm512_permutexvar_ps(nib_lo, table), scale);
    const __m512 odd = _mm512_mul_ps(_mm512_permutexvar_ps(nib_hi, table), scale);
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    *lo = _mm512_permutex2var_ps(even, first, odd);
    *hi = _mm512_permutex2var_ps(even, second, odd);
}

static inline void decode_f32(const uint8_t *b, uint8_t s, float *out) {
    __m512 lo, hi;
    decode_block(b, s, &lo, &hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
}

#if ROW_DOT_DPBF16
static inline void decode_bf16(const uint8_t *b, uint8_t s, uint16_t *out) {
    __m512 lo, hi;
    decode_block(b, s, &lo, &hi);
    /* exact: every decoded value has at most two significant bits */
    _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

#else

static inline void decode_f32(const uint8_t *b, uint8_t s, float *out) {
    const float scale = e8m0(s);
    for (int i = 0; i < MX_BYTES; i++) {
        out[2 * i] = FP4_VALUES[b[i] & 15] * scale;
        out[2 * i + 1] = FP4_VALUES[b[i] >> 4] * scale;
    }
}
#endif

/* Rows r0..r0+n-1 of expert e's w13 or w2, decoded into buf: n rows of a weight are one
 * contiguous run of blocks and scales. The packed rows ROW_PREFETCH_AHEAD further on are
 * asked for into L2 as the decode goes, as row_dot.h does for dense rows. */
static const void *mxfp4_rows(const moe_t *m, int down, int64_t e, int64_t r0, int n,
                              void *buf) {
    const int64_t k = down ? m->I : m->H, per_expert = down ? m->H : 2 * m->I;
    const int64_t groups = k / MX_BLOCK, first = (e * per_expert + r0) * groups;
    const uint8_t *blocks = (const uint8_t *)(down ? m->w2 : m->w13) + first * MX_BYTES;
    const uint8_t *scales = (const uint8_t *)(down ? m->s2 : m->s13) + first;
    const int64_t count = n * groups, skip = ROW_PREFETCH_AHEAD * groups;
    for (int64_t g = 0; g < count; g++) {
        if ((g & 3) == 0) prefetch_l2(blocks + (g + skip) * MX_BYTES);
        if ((g & 63) == 0) prefetch_l2(scales + g + skip);
#if ROW_DOT_DPBF16
        if (m->w_bf16) {
            decode_bf16(blocks + g * MX_BYTES, scales[g], (uint16_t *)buf + g * MX_BLOCK);
            continue;
        }
#endif
        decode_f32(blocks + g * MX_BYTES, scales[g], (float *)buf + g * MX_BLOCK);
    }
    return buf;
}

/* x [T, H]; w13 as blocks [E, 2I, H/32, 16] uint8 and scales [E, 2I, H/32] uint8 (each
 * expert's gate rows, then its up rows); w2 as blocks [E, H, I/32, 16] and scales
 * [E, H, I/32]; H and I multiples of 32. The rest as moe.c's fused_moe_rows: x, biases
 * and out bf16 when is_bf16, else float32. Returns 0, or -1 when scratch could not be
 * allocated (nothing written). */
int fused_moe_mxfp4_rows(const void *x, int is_bf16, int64_t T, int64_t H,
                         const uint8_t *w13_blocks, const uint8_t *w13_scales,
                         const uint8_t *w2_blocks, const uint8_t *w2_scales, int64_t E, int64_t I,
                         const float *topk_weights, const void *topk_ids, int ids_64, int64_t k,
                         const void *b13, const void *b2, int activation, float alpha,
                         float limit, void *out, int num_threads) {
    if (H % MX_BLOCK || I % MX_BLOCK) return -1;
    /* bf16 rows where the dot product multiplies bf16 by bf16; float32 rows beside float32
     * activations, and beside bf16 ones that a portable build widens to float32 */
    const int w_bf16 = is_bf16 && ROW_DOT_DPBF16;
    const int64_t widest = H > I ? H : I;
    const moe_t m = {.bf16 = is_bf16 != 0, .act = activation, .alpha = alpha, .limit = limit,
                     .H = H, .I = I, .k = k, .w13 = w13_blocks, .w2 = w2_blocks, .b13 = b13,
                     .b2 = b2, .s13 = w13_scales, .s2 = w2_scales, .rows = mxfp4_rows,
                     .w_bf16 = w_bf16, .decode_bytes = DOT_ROWS * widest * (w_bf16 ? 2 : 4)};
    return moe_run(&m, x, T, E, topk_weights, topk_ids, ids_64, out, num_threads);
}
