/* The batched LoRA update of one layer for every adapter group of a step, in one call:
 * for each segment g (its rows listed in rows[starts[g] .. starts[g+1]]),
 *     y[row] += (x[row] A_g^T) B_g^T,    A_g [rank_g, in] row-major,
 *                                         B_g [out, rank_g] column-major (B^T's rows).
 *
 * Why: the torch path costs four small ops per group per layer (gather, shrink, expand,
 * scatter-add), ~120 layers a step; at decode sizes their dispatch overhead, not their
 * arithmetic (rank 16 is ~9% of SmolLM2's base FLOPs), is what a step pays. Here rows go
 * ROWS (4 or 8) at a time through one read of A and of B^T (both stay in cache across a
 * segment): the shrink is dot products over `in`, the expand a broadcast FMA over `out`
 * per rank, so neither needs a horizontal sum per output.
 *
 * float32 or bf16 activations and weights (the base model's dtype), float32 sums; in
 * bf16 the shrink result and the update are rounded to bf16 as torch's bf16 matmuls
 * round theirs. GCC vector extensions: AVX-512, AVX2/FMA or SSE code from the build's
 * -march (the detected ISA), plain C where there is no vector unit. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LORA_MAX_RANK 1024
#define LORA_MAX_IN 16384

/* 16 lanes and 8 rows a pass where the build has AVX-512 (32 vector registers), else 8
 * lanes and 4 rows: 1.6-2x the 8-lane kernel on an AMX host's AVX-512 units
 * (bench/bench_lora_dispatch.py). */
#ifdef __AVX512F__
#define VW 16
#define ROWS 8
#else
#define VW 8
#define ROWS 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf widen_bits(vh h) { return (vf)(__builtin_convertvector(h, vu) << 16); }

static inline vf widen(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return widen_bits(h);
}

/* bf16.h's f32_to_bf16, every lane */
static inline vh narrow(vf f) {
    const vu u = (vu)f;
    return __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vh);
}

static inline vf ldv(const void *p, int64_t i, int bf16) {
    return bf16 ? widen((const uint16_t *)p + i) : loadf((const float *)p + i);
}

static inline float ld1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float hsumv(vf v) {
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

/* Up to ROWS rows of one segment: xs[r] their float32 inputs, ys[r] their outputs. */
static inline void rows_update(float *const *xs, void *const *ys, int n, const void *a,
                               const void *bt, int rank, int64_t in, int64_t out, int bf16) {
    float t[ROWS][LORA_MAX_RANK];
    const int64_t inv = in - in % VW, outv = out - out % VW;
    for (int k = 0; k < rank; k++) {
        vf acc[ROWS] = {{0}};
        const int64_t base = k * in;
        for (int64_t i = 0; i < inv; i += VW) {
            const vf av = ldv(a, base + i, bf16);
            for (int r = 0; r < n; r++) acc[r] += av * loadf(xs[r] + i);
        }
        for (int r = 0; r < n; r++) {
            float s = hsumv(acc[r]);
            for (int64_t i = inv; i < in; i++) s += ld1(a, base + i, bf16) * xs[r][i];
            t[r][k] = bf16 ? round_bf16(s) : s;
        }
    }
    for (int64_t o = 0; o < outv; o += VW) {
        vf acc[ROWS] = {{0}};
        for (int k = 0; k < rank; k++) {
            const vf bv = ldv(bt, k * out + o, bf16);
            for (int r = 0; r < n; r++) acc[r] += bv * t[r][k];
        }
        for (int r = 0; r < n; r++) {
            if (bf16) {
                uint16_t *y = (uint16_t *)ys[r] + o;
                /* the update rounded to bf16 first, as torch rounds it */
                const vf sum = widen(y) + widen_bits(narrow(acc[r]));
                const vh packed = narrow(sum);
                memcpy(y, &packed, sizeof packed);
            } else {
                float *y = (float *)ys[r] + o;
                const vf yv = loadf(y) + acc[r];
                memcpy(y, &yv, sizeof yv);
            }
        }
    }
    for (int64_t o = outv; o < out; o++) {
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
