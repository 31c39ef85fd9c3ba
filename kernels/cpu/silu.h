/* silu(gate) * up, the one arithmetic of every kernel that computes it: silu_mul_bf16 and
 * silu_mul_f32 (elementwise.c, also the fused decode step's) and the AMX GEMM that ends
 * the MLP's gate_up matmul in it (gemm_bf16.c), so a row's activations are the same bits
 * whichever of them ran.
 *
 * bf16 on AVX-512 builds runs 16 lanes with exp from its own polynomial (gcc vectorised
 * the scalar loop only 4 lanes wide, through libmvec's expf); elsewhere the scalar silu.
 */
#ifndef TLE_SILU_H
#define TLE_SILU_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* silu(g) = g / (1 + exp(-g)), with g clamped at -88 so exp(-g) stays finite: under
 * -ffast-math gcc divides by multiplying with a refined reciprocal, which turns
 * g / inf into NaN (gates below about -88.7). silu(-88) is ~-5e-37: zero in practice. */
static inline float silu(float g) {
    g = fmaxf(g, -88.f);
    return g / (1.f + expf(-g));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SILU_AVX512 1
#include <immintrin.h>

/* exp(x) for x <= 88: x = n ln2 + r (ln2 in two parts), |r| <= ln2 / 2, exp(r) by its
 * Taylor series to r^7 (relative error ~2e-8, below float's half ulp), times 2^n. x is
 * clamped at -104, where exp is already below float's least subnormal (the reduction
 * would lose r for a gate of 1e30). */
static inline __m512 silu_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* bf16(bf16(silu(g)) * u) for 16 lanes of g and u (bf16 values held as float32). */
static inline __m256i silu_mul16_bf16(__m512 g, __m512 u) {
    g = _mm512_max_ps(g, _mm512_set1_ps(-88.f));
    const __m512 e = silu_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return bf16x16_round(_mm512_mul_ps(bf16x16_widen(bf16x16_round(s)), u));
}
#else
#define SILU_AVX512 0
#endif

/* dst[i] = bf16(bf16(silu(gate[i])) * up[i]) for i < n. */
static inline void silu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *dst,
                                     int64_t n) {
#if SILU_AVX512
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keep = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = bf16x16_widen(_mm256_maskz_loadu_epi16(keep, gate + i));
        const __m512 u = bf16x16_widen(_mm256_maskz_loadu_epi16(keep, up + i));
        _mm256_mask_storeu_epi16(dst + i, keep, silu_mul16_bf16(g, u));
    }
#else
    for (int64_t i = 0; i < n; i++) {
        const float s = round_bf16(silu(bf16_to_f32(gate[i])));
        dst[i] = f32_to_bf16(s * bf16_to_f32(up[i]));
    }
#endif
}

#endif
