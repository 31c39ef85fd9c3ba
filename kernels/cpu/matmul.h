/* The dense matmul kernels other kernels chain: the row kernels for few rows
 * (linear_f32.c, linear_bf16.c) and the GEMMs on packed panels (gemm_f32.c, gemm_bf16.c). */
#ifndef TLE_MATMUL_H
#define TLE_MATMUL_H
#include <stdint.h>

void linear_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k, int num_threads);
int linear_bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int num_threads);
void gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
              const float *bias, float *y, int num_threads);
int gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
              const uint16_t *bias, uint16_t *y, int num_threads);

#endif
