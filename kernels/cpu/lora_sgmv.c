/* The batched LoRA update of one layer for every adapter group of a step, in one call:
 * for each segment g (its rows listed in rows[starts[g] .. starts[g+1]]),
 *     y[row] += (x[row] A_g^T) B_g^T,    A_g [rank_g, in] row-major,
 *                                         B_g [out, rank_g] column-major (B^T's rows).
 *
 * Why: the torch path costs four small ops per group per layer (gather, shrink, expand,
 * scatter-add), ~120 layers a step; at decode sizes their dispatch overhead, not their
 * arithmetic (rank 16 is ~9% of SmolLM2's base FLOPs), is what a step pays. Here rows go
 * four at a time through one read of A and of B^T (both stay in cache across a segment):
 * the shrink is dot products over `in`, the expand a broadcast FMA over `out` per rank,
 * so neither needs a horizontal sum per output.
 *
 * float32 or bf16 activations and weights (the base model's dtype), float32 sums; in
 * bf16 the shrink result and the update are rounded to bf16 as torch's bf16 matmuls
 * round theirs. GCC vector extensions (vec8.h): AVX2/FMA, AVX-512 or SSE code from the
 * build's -march (the detected ISA), plain C where there is no vector unit. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec8.h"

#define LORA_MAX_RANK 1024
#define LORA_MAX_IN 16384
#define ROWS 4

typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f widen8(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u w = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline v8f ld8(const void *p, int64_t i, int bf16) {
    return bf16 ? widen8((const uint16_t *)p + i) : load8((const float *)p + i);
}

static inline float ld1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Up to ROWS rows of one segment: xs[r] their float32 inputs, ys[r] their outputs. */
static inline void rows_update(float *const *xs, void *const *ys, int n, const void *a,
                               const void *bt, int rank, int64_t in, int64_t out, int bf16) {
    float t[ROWS][LORA_MAX_RANK];
    const int64_t in8 = in & ~(int64_t)7, out8 = out & ~(int64_t)7;
    for (int k = 0; k < rank; k++) {
        v8f acc[ROWS] = {{0}};
        const int64_t base = k * in;
        for (int64_t i = 0; i < in8; i += 8) {
            const v8f av = ld8(a, base + i, bf16);
            for (int r = 0; r < n; r++) acc[r] += av * load8(xs[r] + i);
        }
        for (int r = 0; r < n; r++) {
            float s = hsum(acc[r]);
            for (int64_t i = in8; i < in; i++) s += ld1(a, base + i, bf16) * xs[r][i];
            t[r][k] = bf16 ? round_bf16(s) : s;
        }
    }
    for (int64_t o = 0; o < out8; o += 8) {
        v8f acc[ROWS] = {{0}};
        for (int k = 0; k < rank; k++) {
            const v8f bv = ld8(bt, k * out + o, bf16);
            for (int r = 0; r < n; r++) acc[r] += bv * t[r][k];
        }
        for (int r = 0; r < n; r++) {
            if (bf16) {
                uint16_t *y = (uint16_t *)ys[r] + o;
                for (int j = 0; j < 8; j++)
                    y[j] = f32_to_bf16(bf16_to_f32(y[j]) + round_bf16(acc[r][j]));
            } else {
                float *y = (float *)ys[r] + o;
                v8f yv = load8(y) + acc[r];
                memcpy(y, &yv, sizeof yv);
            }
        }
    }
    for (int64_t o = out8; o < out; o++) {
        for (int r = 0; r < n; r++) {
            float s = 0.f;
            for (int k = 0; k < rank; k++) s += ld1(bt, k * out + o, bf16) * t[r][k];
            if (bf16) {
                uint16_t *y = (uint16_t *)ys[r] + o;
                *y = f32_to_bf16(bf16_to_f32(*y) + round_bf16(s));
            } else {
                ((float *)ys[r])[o] += s;
            }
        }
    }
}

/* x [*, in] and y [*, out] with row strides (elements, unit column stride); a[g] and
 * bt[g] (B^T, [rank, out] row-major) the segment's weights, NULL where that adapter has
 * no update for this layer. Returns 0, or -1 for a rank or width this kernel does not
 * take (the caller runs torch then). */
int lora_sgmv(int is_bf16, const void *x, int64_t x_stride, void *y, int64_t y_stride,
              const int64_t *rows, const int64_t *starts, int num_segments,
              const void *const *a, const void *const *bt, const int32_t *ranks, int64_t in,
              int64_t out, int num_threads) {
    if (in > LORA_MAX_IN || num_segments > 4096) return -1;
    int64_t blocks = 0, work = 0;
    int64_t first_block[4097];
    for (int g = 0; g < num_segments; g++) {
        if (ranks[g] < 0 || ranks[g] > LORA_MAX_RANK) return -1;
        const int64_t n = starts[g + 1] - starts[g];
        first_block[g] = blocks;
        blocks += (n + ROWS - 1) / ROWS;
        work += n * ranks[g] * (in + out);
    }
    first_block[num_segments] = blocks;
    const size_t esize = is_bf16 ? 2 : 4;
    #pragma omp parallel num_threads(num_threads) if (work >= 200000)
    {
        float xf[ROWS][is_bf16 ? in : 1];
        #pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            int g = 0;
            while (first_block[g + 1] <= blk) g++;
            if (a[g] == NULL || ranks[g] == 0) continue;
            const int64_t pos = starts[g] + (blk - first_block[g]) * ROWS;
            const int64_t end = starts[g + 1];
            const int n = end - pos < ROWS ? (int)(end - pos) : ROWS;
            float *xs[ROWS];
            void *ys[ROWS];
            for (int r = 0; r < n; r++) {
                const int64_t row = rows[pos + r];
                const char *xr = (const char *)x + row * x_stride * esize;
                if (is_bf16) {
                    const uint16_t *xh = (const uint16_t *)xr;
                    for (int64_t i = 0; i < in; i++) xf[r][i] = bf16_to_f32(xh[i]);
                    xs[r] = xf[r];
                } else {
                    xs[r] = (float *)xr;
                }
                ys[r] = (char *)y + row * y_stride * esize;
            }
            rows_update(xs, ys, n, a[g], bt[g], ranks[g], in, out, is_bf16);
        }
    }
    return 0;
}
