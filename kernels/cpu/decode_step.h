/* What decode_step.c chains: the kernels of this library's other sources it calls, as
 * they define them (declared here, never copied), and the one-row dispatch over a
 * matmul's weight format. */
#ifndef TLE_DECODE_STEP_H
#define TLE_DECODE_STEP_H
#include <stdint.h>

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads);
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t hidden, float eps, int num_threads);
void gemma_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                        int64_t rows, int64_t hidden, float eps, int num_threads);
void gemma_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                         uint16_t *out, int64_t rows, int64_t hidden, float eps,
                         int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads);
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                       int num_threads);
void gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                        int num_threads);
void rope_f32(const float *qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
              int64_t rot_half, const int64_t *positions, const float *cos_table,
              const float *sin_table, float *out, int num_threads);
void rope_bf16(const uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t heads,
               int64_t dim, int64_t rot_half, const int64_t *positions, const uint16_t *cos_table,
               const uint16_t *sin_table, uint16_t *out, int num_threads);
void reshape_and_cache_32(const uint32_t *key, int64_t key_stride, const uint32_t *value,
                          int64_t value_stride, uint32_t *key_cache, uint32_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);
void reshape_and_cache_16(const uint16_t *key, int64_t key_stride, const uint16_t *value,
                          int64_t value_stride, uint16_t *key_cache, uint16_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);
int paged_decode_attention_windowed(const void *query, const void *key_cache,
                                    const void *value_cache, void *out,
                                    const int32_t *block_tables, const int32_t *seq_lens,
                                    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, int max_blocks, float scale, int window,
                                    float soft_cap, int is_bf16, int num_threads);
int linear_gguf(int type, const uint8_t *qs, const float *d, const float *offset, int64_t n,
                int64_t k, const void *x, int x_bf16, int64_t m, const float *bias, void *y,
                int out_bf16, int num_threads);
void linear_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k, int num_threads);
void gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
              const float *bias, float *y, int num_threads);
int linear_bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int num_threads);
int gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
              const uint16_t *bias, uint16_t *y, int num_threads);

#define DENSE_F32 (-1)
#define DENSE_BF16 (-2)
#define PANELS_F32 (-3)
#define PANELS_BF16 (-4)

/* Field order and types must match kernels/cpu/decode_step.py. */
typedef struct {
    int64_t type;          /* DENSE_F32, DENSE_BF16 ([n, k], the step's dtype), PANELS_F32,
                              PANELS_BF16 (gemm_f32's, gemm_bf16's panels), else a GGUF id */
    const void *weight;    /* dense weights, panels, or the GGUF codes */
    const float *scales;   /* GGUF only */
    const float *offsets;  /* GGUF Q4_1 only, else NULL */
    const void *bias;      /* [n] or NULL: the step's dtype, float32 beside GGUF blocks */
    int64_t n, k;
} linear_t;

/* y = x W^T + b for one row x, by the weight's format: the call the layer-by-layer path
 * makes for that format (kernels/dispatch/matmul.py). */
static inline int run_linear(const linear_t *lin, const void *x, void *y, int bf16,
                             int num_threads) {
    if (lin->type == DENSE_F32) {
        linear_f32_rows(x, lin->weight, lin->bias, y, 1, lin->n, lin->k, num_threads);
        return 0;
    }
    if (lin->type == PANELS_F32) {
        gemm_f32(x, 1, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
        return 0;
    }
    if (lin->type == PANELS_BF16)
        return gemm_bf16(x, 1, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
    if (lin->type == DENSE_BF16)
        return linear_bf16_rows(x, lin->weight, lin->bias, y, 1, lin->n, lin->k, num_threads);
    return linear_gguf((int)lin->type, (const uint8_t *)lin->weight, lin->scales, lin->offsets,
                       lin->n, lin->k, x, bf16, 1, lin->bias, y, bf16, num_threads);
}

#endif
