/* What decode_step.c chains: the kernels of this library's other sources, through their
 * families' headers (which their own sources include, so a signature cannot drift), and
 * the dispatch over a matmul's weight format for a step's few rows. */
#ifndef TLE_DECODE_STEP_H
#define TLE_DECODE_STEP_H
#include <stdint.h>

#include "decode_attention.h"
#include "elementwise.h"
#include "gguf_blocks.h"
#include "matmul.h"

/* linear_quant.c: linear_gguf with one row's arithmetic for every row (kernels/cpu/linear.py
 * binds it too; gguf_blocks.h does not declare it). */
int linear_gguf_rows(int type, const uint8_t *qs, const float *d, const float *offset,
                     int64_t n, int64_t k, const void *x, int x_bf16, int64_t m,
                     const float *bias, void *y, int out_bf16, int num_threads);

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

/* y = x W^T + b for `rows` rows x, by the weight's format: at one row the call the
 * layer-by-layer path makes for that format (kernels/dispatch/matmul.py), and at any row
 * count a kernel whose every row is computed as that one row would be (decode_step.c's
 * header): GGUF blocks through linear_gguf_rows, equal to linear_gguf at one row. */
static inline int run_linear(const linear_t *lin, const void *x, void *y, int64_t rows,
                             int bf16, int num_threads) {
    if (lin->type == DENSE_F32) {
        linear_f32_rows(x, lin->weight, lin->bias, y, rows, lin->n, lin->k, num_threads);
        return 0;
    }
    if (lin->type == PANELS_F32) {
        gemm_f32(x, rows, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
        return 0;
    }
    if (lin->type == PANELS_BF16)
        return gemm_bf16(x, rows, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
    if (lin->type == DENSE_BF16)
        return linear_bf16_rows(x, lin->weight, lin->bias, y, rows, lin->n, lin->k,
                                num_threads);
    return linear_gguf_rows((int)lin->type, (const uint8_t *)lin->weight, lin->scales,
                            lin->offsets, lin->n, lin->k, x, bf16, rows, lin->bias, y, bf16,
                            num_threads);
}

#endif
