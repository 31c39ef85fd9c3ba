/* Fused element-wise ops for the CPU decode path, in bf16 and in float32 (the dtype
 * the engine runs in on CPUs without native bf16). Each replaces a chain of 3-6 torch
 * ops (and their temporaries) over [tokens, hidden]; at decode batch sizes those chains
 * cost more in launches and memory passes than in arithmetic.
 *
 * Rounding follows the torch op chains they replace (and HF's Llama): every
 * intermediate that torch would store as bf16 is rounded to bf16 here too, so results
 * differ from the torch path only by the order of float32 sums and exp's last bit (in
 * float32 the same holds with nothing to round). Rows are spread over torch's OpenMP pool
 * when there are enough of them (fork_rows; see decode_attention.c for why the runtime is
 * shared).
 *
 * Over 300 lines: the float32 and bf16 variants of each element-wise op side by side,
 * sharing the norm's sum loop.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "gelu.h"
#include "silu.h"
#include "elementwise.h"

/* The kernels fork threads only for more than one row and more than PARALLEL_MIN_WORK
 * elements in all (fork_rows). Rows are the unit of work, so a single row (each of the
 * dozens of calls a single stream's decode step makes, the fused one in decode_step.c
 * included) can only ever keep one thread busy: a parallel region then costs its start
 * and, on a loaded host, a wait at its barrier for a second thread that may not be
 * scheduled. Measured on 2 Sapphire Rapids cores, best of 5, SmolLM2's widths: a second
 * thread starts to pay off between 4K and 8K floats for silu_mul_f32 and around 8K for
 * add_rms_norm_f32; in bf16 (load average 6) near 4.6K elements for add_rms_norm
 * (8 x 576), 7.7K for rope (8 x 960) and 3K-9K for silu_mul (2-6 x 1536), gaining at
 * most ~1 us below 8K, where a stalled region loses far more. Each row is computed alone
 * either way, so results do not depend on which side of the threshold a call falls. */
#define PARALLEL_MIN_WORK 8192

static inline int fork_rows(int64_t rows, int64_t per_row) {
    return rows > 1 && rows * per_row > PARALLEL_MIN_WORK;
}

/* One row of the bf16 norms: res += x (when x is not NULL), rounded to bf16 as torch's
 * in-place add; returns rsqrt(mean(res^2) + eps) of the updated row, in float32. */
static inline float add_rms_bf16(const uint16_t *x, uint16_t *res, int64_t hidden, float eps) {
    float sum = 0.f;
    if (x != 0) {
        for (int64_t i = 0; i < hidden; i++) {
            const uint16_t v = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(x[i]));
            res[i] = v;
            const float f = bf16_to_f32(v);
            sum += f * f;
        }
    } else {
        for (int64_t i = 0; i < hidden; i++) {
            const float f = bf16_to_f32(res[i]);
            sum += f * f;
        }
    }
    return 1.f / sqrtf(sum / (float)hidden + eps);
}

/* residual += x (when x is not NULL); out = bf16(bf16(residual * rsqrt(mean(residual^2) + eps)) * weight)
 * Matches: residual.add_(x); F.rms_norm(residual.float(), ..., None, eps).to(bf16) * weight */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t hidden, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, hidden))
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * hidden;
        uint16_t *dst = out + r * hidden;
        const float inv = add_rms_bf16(x == 0 ? 0 : x + r * hidden, res, hidden, eps);
        for (int64_t i = 0; i < hidden; i++) {
            const float normed = round_bf16(bf16_to_f32(res[i]) * inv);
            dst[i] = f32_to_bf16(normed * bf16_to_f32(weight[i]));
        }
    }
}

/* out[r, i] = bf16(bf16(silu(gate_up[r, i])) * gate_up[r, inter + i])
 * Matches: F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]) (silu.h) */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, inter))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter;
        silu_mul_row_bf16(gate, gate + inter, out + r * inter, inter);
    }
}

/* Gemma's RMSNorm: residual += x (when x is not NULL);
 * out = bf16(residual * rsqrt(mean(residual^2) + eps) * (1 + weight)), the (1 + w) scale
 * and both products in float32 and one rounding at the end.
 * Matches: layers.GemmaRMSNorm (HF's; add_rms_norm_bf16 rounds before its weight). */
void gemma_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                         uint16_t *out, int64_t rows, int64_t hidden, float eps,
                         int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, hidden))
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * hidden;
        uint16_t *dst = out + r * hidden;
        const float inv = add_rms_bf16(x == 0 ? 0 : x + r * hidden, res, hidden, eps);
        for (int64_t i = 0; i < hidden; i++)
            dst[i] = f32_to_bf16(bf16_to_f32(res[i]) * inv * (1.f + bf16_to_f32(weight[i])));
    }
}

/* out[r, i] = bf16(bf16(gelu_tanh(gate_up[r, i])) * gate_up[r, inter + i])
 * Matches: F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:]) (gelu.h) */
void gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                        int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, inter))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter;
        gelu_mul_row_bf16(gate, gate + inter, out + r * inter, inter);
    }
}

/* Row-wise argmax, index of the first maximum (torch.argmax without NaNs), bf16 or
 * float32. One pass takes each 256-wide block's maximum (a vectorized reduction); only
 * the first block holding the row's maximum is scanned again for the index. [64, 49152]
 * logits on 2 Sapphire Rapids cores: float32 0.27 ms where torch.argmax took 2.0; bf16
 * 0.12-0.15 ms where two whole passes took 0.56-0.64 (torch upcasts bf16 first: 5.1). */
#define ARGMAX_BLOCK 256

static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int is_bf16,
                                                                int64_t cols) {
    float best = -3.0e38f;  /* finite: the build uses fast-math */
    int64_t first_block = 0;
    for (int64_t b0 = 0; b0 < cols; b0 += ARGMAX_BLOCK) {
        const int64_t n = cols - b0 < ARGMAX_BLOCK ? cols - b0 : ARGMAX_BLOCK;
        float m = -3.0e38f;
        if (is_bf16) {
            const uint16_t *v = (const uint16_t *)x + b0;
            for (int64_t i = 0; i < n; i++) m = bf16_to_f32(v[i]) > m ? bf16_to_f32(v[i]) : m;
        } else {
            const float *v = (const float *)x + b0;
            for (int64_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
        }
        if (m > best) { best = m; first_block = b0; }  /* strictly: ties keep the first */
    }
    for (int64_t i = first_block; i < cols; i++) {
        const float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        if (v == best) return i;
    }
    return 0;  /* every value below -3e38 (all -inf): torch answers 0 too */
}

void argmax_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t cols, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (rows > 1 && rows * cols >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, 1, cols);
}

void argmax_f32(const float *x, int64_t *out, int64_t rows, int64_t cols, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (rows > 1 && rows * cols >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, 0, cols);
}

/* Rotate-half RoPE over the first `heads` heads of each row of a fused qkv buffer
 * (row r starts at qkv + r * row_stride), written to a contiguous [rows, heads, dim].
 * cos/sin: [positions, rot_half] bf16 tables. Each product and sum is rounded to bf16,
 * as the torch expression (x1 * cos - x2 * sin, x2 * cos + x1 * sin) rounds them. */
void rope_bf16(const uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t heads,
               int64_t dim, int64_t rot_half, const int64_t *positions, const uint16_t *cos_table,
               const uint16_t *sin_table, uint16_t *out, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, heads * dim))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *cs = cos_table + positions[r] * rot_half;
        const uint16_t *sn = sin_table + positions[r] * rot_half;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *src = qkv + r * row_stride + h * dim;
            uint16_t *dst = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < rot_half; i++) {
                const float x1 = bf16_to_f32(src[i]), x2 = bf16_to_f32(src[i + rot_half]);
                const float c = bf16_to_f32(cs[i]), s = bf16_to_f32(sn[i]);
                dst[i] = f32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
                dst[i + rot_half] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
            }
            for (int64_t i = 2 * rot_half; i < dim; i++) dst[i] = src[i];
        }
    }
}

/* key_cache/value_cache viewed as [slots, row]: copy each token's K and V row to its
 * slot; slot < 0 is padding. Rows may be strided views (V inside the fused qkv). */
void reshape_and_cache_16(const uint16_t *key, int64_t key_stride, const uint16_t *value,
                          int64_t value_stride, uint16_t *key_cache, uint16_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(tokens, 2 * row))
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const uint16_t *k = key + t * key_stride, *v = value + t * value_stride;
        uint16_t *kd = key_cache + slot * row, *vd = value_cache + slot * row;
        for (int64_t i = 0; i < row; i++) { kd[i] = k[i]; vd[i] = v[i]; }
    }
}

/* The float32 norms' row: res += x (when x is not NULL); returns
 * rsqrt(mean(res^2) + eps) of the updated row. */
static inline float add_rms_f32(const float *x, float *res, int64_t hidden, float eps) {
    if (x != 0)
        for (int64_t i = 0; i < hidden; i++) res[i] += x[i];
    float sum = 0.f;
    for (int64_t i = 0; i < hidden; i++) sum += res[i] * res[i];
    return 1.f / sqrtf(sum / (float)hidden + eps);
}

/* float32 add_rms_norm: residual += x (when x is not NULL);
 * out = (residual * rsqrt(mean(residual^2) + eps)) * weight, all in float32.
 * Matches reference.add_rms_norm for float32 up to the order of the float32 sum. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, hidden))
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * hidden;
        float *dst = out + r * hidden;
        const float inv = add_rms_f32(x == 0 ? 0 : x + r * hidden, res, hidden, eps);
        for (int64_t i = 0; i < hidden; i++) dst[i] = (res[i] * inv) * weight[i];
    }
}

/* float32 silu_mul: out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, inter))
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter;
        const float *up = gate + inter;
        float *dst = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            dst[i] = silu(gate[i]) * up[i];
        }
    }
}

/* float32 Gemma RMSNorm: residual += x (when x is not NULL);
 * out = residual * rsqrt(mean(residual^2) + eps) * (1 + weight). */
void gemma_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                        int64_t rows, int64_t hidden, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, hidden))
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * hidden;
        float *dst = out + r * hidden;
        const float inv = add_rms_f32(x == 0 ? 0 : x + r * hidden, res, hidden, eps);
        for (int64_t i = 0; i < hidden; i++) dst[i] = res[i] * inv * (1.f + weight[i]);
    }
}

/* float32 gelu_tanh_mul: out[r, i] = gelu_tanh(gate_up[r, i]) * gate_up[r, inter + i]. */
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                       int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, inter))
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter;
        const float *up = gate + inter;
        float *dst = out + r * inter;
        for (int64_t i = 0; i < inter; i++) dst[i] = gelu_tanh(gate[i]) * up[i];
    }
}

/* float32 rope, same layout as rope_bf16; cos/sin tables are float32. Bit-equal to the
 * torch expression (x1 * cos - x2 * sin, x2 * cos + x1 * sin), which rounds each product
 * before the sum; fusing them into an FMA (gcc does by default where the CPU has FMA)
 * would not, so contraction is off for this function. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void rope_f32(const float *qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
              int64_t rot_half, const int64_t *positions, const float *cos_table,
              const float *sin_table, float *out, int num_threads) {
#ifdef __clang__
    #pragma clang fp contract(off)
#endif
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(rows, heads * dim))
    for (int64_t r = 0; r < rows; r++) {
        const float *cs = cos_table + positions[r] * rot_half;
        const float *sn = sin_table + positions[r] * rot_half;
        for (int64_t h = 0; h < heads; h++) {
            const float *src = qkv + r * row_stride + h * dim;
            float *dst = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < rot_half; i++) {
                const float x1 = src[i], x2 = src[i + rot_half];
                const float p1 = x1 * cs[i], p2 = x2 * sn[i], p3 = x2 * cs[i], p4 = x1 * sn[i];
                dst[i] = p1 - p2;
                dst[i + rot_half] = p3 + p4;
            }
            for (int64_t i = 2 * rot_half; i < dim; i++) dst[i] = src[i];
        }
    }
}

/* reshape_and_cache_16 for 4-byte elements (float32 caches): same contract. */
void reshape_and_cache_32(const uint32_t *key, int64_t key_stride, const uint32_t *value,
                          int64_t value_stride, uint32_t *key_cache, uint32_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (fork_rows(tokens, 2 * row))
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const uint32_t *k = key + t * key_stride, *v = value + t * value_stride;
        uint32_t *kd = key_cache + slot * row, *vd = value_cache + slot * row;
        for (int64_t i = 0; i < row; i++) { kd[i] = k[i]; vd[i] = v[i]; }
    }
}
