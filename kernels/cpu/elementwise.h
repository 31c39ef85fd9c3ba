/* The element-wise kernels (elementwise.c): norms, activations, RoPE, KV writes and the
 * greedy argmax, float32 and bf16. Called from Python and from decode_step.c. */
#ifndef TLE_ELEMENTWISE_H
#define TLE_ELEMENTWISE_H
#include <stdint.h>

void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t hidden, float eps, int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads);
void gemma_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                         uint16_t *out, int64_t rows, int64_t hidden, float eps,
                         int num_threads);
void gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                        int num_threads);
void argmax_bf16(const uint16_t *x, int64_t *out, int64_t rows, int64_t cols, int num_threads);
void argmax_f32(const float *x, int64_t *out, int64_t rows, int64_t cols, int num_threads);
void rope_bf16(const uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t heads,
               int64_t dim, int64_t rot_half, const int64_t *positions, const uint16_t *cos_table,
               const uint16_t *sin_table, uint16_t *out, int num_threads);
void reshape_and_cache_16(const uint16_t *key, int64_t key_stride, const uint16_t *value,
                          int64_t value_stride, uint16_t *key_cache, uint16_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int num_threads);
void gemma_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                        int64_t rows, int64_t hidden, float eps, int num_threads);
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                       int num_threads);
void rope_f32(const float *qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
              int64_t rot_half, const int64_t *positions, const float *cos_table,
              const float *sin_table, float *out, int num_threads);
void reshape_and_cache_32(const uint32_t *key, int64_t key_stride, const uint32_t *value,
                          int64_t value_stride, uint32_t *key_cache, uint32_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);

#endif
