/* Gemma's GeGLU activation, gelu_tanh(gate) * up, the one arithmetic of every kernel that
 * computes it: gelu_tanh_mul_bf16 and gelu_tanh_mul_f32 (elementwise.c), which the
 * layer-by-layer path and the fused decode step both call.
 *
 * gelu_tanh(g) = g (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (g + 0.044715 g^3) (torch's
 * approximate="tanh"), computed as g / (1 + exp(-2u)): (1 + tanh u) / 2 is sigmoid(2u),
 * so the result keeps exp's relative error where a tanh's absolute error (soft_cap.h's)
 * would swamp the small values of a strongly negative gate. -2u is clamped at 88 (as
 * silu.h clamps), where the quotient is already ~0. bf16 on AVX-512 builds runs 16 lanes
 * through silu.h's exp; elsewhere the scalar loop. */
#ifndef TLE_GELU_H
#define TLE_GELU_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "silu.h"

#define GELU_TWO_BETA 1.5957691216057308f  /* 2 sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

static inline float gelu_tanh(float g) {
    const float u2 = GELU_TWO_BETA * (g + GELU_KAPPA * (g * g * g));
    return g / (1.f + expf(-fmaxf(u2, -88.f)));
}

#if SILU_AVX512
/* bf16(bf16(gelu_tanh(g)) * u) for 16 lanes of g and u (bf16 values held as float32). */
static inline __m256i gelu_mul16_bf16(__m512 g, __m512 u) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    __m512 u2 = _mm512_mul_ps(_mm512_set1_ps(GELU_TWO_BETA),
                              _mm512_fmadd_ps(_mm512_set1_ps(GELU_KAPPA), g3, g));
    u2 = _mm512_max_ps(u2, _mm512_set1_ps(-88.f));
    const __m512 e = silu_exp512(_mm512_sub_ps(_mm512_setzero_ps(), u2));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return bf16x16_round(_mm512_mul_ps(bf16x16_widen(bf16x16_round(s)), u));
}
#endif

/* dst[i] = bf16(bf16(gelu_tanh(gate[i])) * up[i]) for i < n: torch's F.gelu on bf16
 * rounds its result before the multiply. */
static inline void gelu_mul_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *dst,
                                     int64_t n) {
#if SILU_AVX512
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keep = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = bf16x16_widen(_mm256_maskz_loadu_epi16(keep, gate + i));
        const __m512 u = bf16x16_widen(_mm256_maskz_loadu_epi16(keep, up + i));
        _mm256_mask_storeu_epi16(dst + i, keep, gelu_mul16_bf16(g, u));
    }
#else
    for (int64_t i = 0; i < n; i++) {
        const float s = round_bf16(gelu_tanh(bf16_to_f32(gate[i])));
        dst[i] = f32_to_bf16(s * bf16_to_f32(up[i]));
    }
#endif
}

#endif
