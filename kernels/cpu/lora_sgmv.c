/* The batched LoRA update of one layer for every adapter group of a step, in one call:
 * for each segment g (its rows listed in rows[starts[g] .. starts[g+1]]),
 *     y[row] += (x[row] A_g^T) B_g^T,    A_g^T [in, rank_g] and B_g^T [rank_g, out],
 *                                         both row-major (kernels/lora_ops.py LoRAWeights).
 *
 * Why: the torch path costs four small ops per group per layer (gather, shrink, expand,
 * scatter-add), ~120 layers a step; at decode sizes their dispatch overhead, not their
 * arithmetic (rank 16 is ~9% of SmolLM2's base FLOPs), is what a step pays.
 *
 * How: rows go up to ROWS at a time through one read of A^T and of B^T (both stay in cache
 * across a segment). Both products are outer products along a contiguous vector: the
 * shrink broadcasts x[r][i] against A^T's row i (VW ranks at a time), the expand t[r][k]
 * against B^T's row k (VW outputs at a time). So no output needs a horizontal sum, and
 * every output lane is one FMA chain in a fixed order (over i, then over k) whatever rows
 * share its pass: the batch-invariant mode relies on that. The pass body is compiled once
 * per row count (a switch on it), so that the loops over rows unroll into registers: a
 * run-time count had left a compare and branch in every inner step.
 *
 * The expand reads, per SPAN_COLUMNS output columns, only the ranks whose B entries there
 * are not all zero: a fused layer's B is block-diagonal over q/k/v or gate/up, so a column
 * needs a third or a half of the stacked ranks. The terms skipped are exact zeros, and an
 * FMA chain that starts at +0 never holds -0, so skipping them changes no bit.
 *
 * float32 or bf16 activations and weights (the base model's dtype), float32 sums; in
 * bf16 the shrink result and the update are rounded to bf16 as torch's bf16 matmuls
 * round theirs. GCC vector extensions: AVX-512, AVX2/FMA or SSE code from the build's
 * -march (the detected ISA), plain C where there is no vector unit.
 *
 * Over 300 lines: the shrink and expand halves of one segmented LoRA matmul, each with
 * its vector and portable loop.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "prefetch.h"

#define LORA_MAX_RANK 1024
#define LORA_MAX_IN 16384
/* Output columns per rank span (kernels/lora_ops.py SPAN_COLUMNS): a multiple of VW. */
#define SPAN_COLUMNS 16

/* ROWS x KB shrink and ROWS x OB expand accumulators: 24 and 16 of AVX-512's 32 vector
 * registers, 8 of AVX2's 16. */
#ifdef __AVX512F__
#define VW 16
#define ROWS 8
#define KB 3
#else
#define VW 8
#define ROWS 4
#define KB 2
#endif
#define OB 2

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
/* One row's shrink result; a group's lanes past the rank land in the slack. */
typedef float rank_row[LORA_MAX_RANK + KB * VW];

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

/* bf16.h's f32_to_bf16, every lane (AVX512_BF16's conversion rounds alike, flushing
 * denormals: 1.04-1.09x on the bf16 kernel, bench/bench_lora_ab.py) */
static inline vh narrow(vf f) {
#if defined(__AVX512BF16__) && VW == 16
    return (vh)_mm512_cvtneps_pbh((__m512)f);
#else
    const vu u = (vu)f;
    return __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vh);
#endif
}

/* acc + a b as one fused multiply-add where the build has FMA, else a multiply and an add:
 * never left to the compiler. GCC's tuning for Zen splits FMA chains into a multiply and
 * an add when a loop carries one accumulator (a pass of one row) and not when it carries
 * several, which rounded a row differently by how many rows shared its pass. */
static inline vf fmadd(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

static inline vf splat(float s) {
    vf v = {0};
    return v + s;
}

static inline vf ldv(const void *p, int64_t i, int bf16) {
    return bf16 ? widen((const uint16_t *)p + i) : loadf((const float *)p + i);
}

static inline float ld1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* t[r][k0 .. k0 + kb VW) for the pass's n rows: kb vectors of ranks from k0. The last
 * group's last vector may run past the rank into A^T's next row (lanes nobody reads);
 * the rows where it would run past A^T's end are read from a zero-padded copy. */
INLINE void shrink_group(const int n, const int kb, float *const *xs, const void *at,
                         int64_t rank, int64_t in, int64_t k0, int bf16, rank_row *t) {
    vf acc[ROWS][KB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < kb; j++) acc[r][j] = (vf){0};
    const int64_t over = k0 + kb * VW - rank;
    const int64_t unsafe = over <= 0 ? 0 : (over + rank - 1) / rank;
    const int64_t safe = unsafe < in ? in - unsafe : 0;
    for (int64_t i = 0; i < safe; i++) {
        vf av[KB];
        for (int j = 0; j < kb; j++) av[j] = ldv(at, i * rank + k0 + j * VW, bf16);
        for (int r = 0; r < n; r++) {
            const vf xv = splat(xs[r][i]);
            for (int j = 0; j < kb; j++) acc[r][j] = fmadd(xv, av[j], acc[r][j]);
        }
    }
    for (int64_t i = safe; i < in; i++) {
        float row[KB * VW] = {0};
        for (int64_t k = k0; k < rank && k < k0 + kb * VW; k++)
            row[k - k0] = ld1(at, i * rank + k, bf16);
        vf av[KB];
        for (int j = 0; j < kb; j++) av[j] = loadf(row + j * VW);
        for (int r = 0; r < n; r++) {
            const vf xv = splat(xs[r][i]);
            for (int j = 0; j < kb; j++) acc[r][j] = fmadd(xv, av[j], acc[r][j]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < kb; j++) {
            /* in bf16 rounded as torch's bf16 shrink rounds its output */
            const vf v = bf16 ? widen_bits(narrow(acc[r][j])) : acc[r][j];
            memcpy(&t[r][k0 + j * VW], &v, sizeof v);
        }
}

INLINE void shrink_rows(const int n, float *const *xs, const void *at, int64_t rank,
                        int64_t in, int bf16, rank_row *t) {
    for (int64_t k0 = 0; k0 < rank; k0 += KB * VW) {
        const int64_t left = (rank - k0 + VW - 1) / VW;
        if (left >= KB) shrink_group(n, KB, xs, at, rank, in, k0, bf16, t);
        else if (left == 1) shrink_group(n, 1, xs, at, rank, in, k0, bf16, t);
#if KB > 2
        else shrink_group(n, 2, xs, at, rank, in, k0, bf16, t);
#endif
    }
}

/* The union of the rank spans of output columns [first, last]. */
static inline void span_of(const int32_t *spans, int64_t first, int64_t last, int *lo,
                           int *hi) {
    *lo = 0;
    *hi = 0;
    for (int64_t b = first / SPAN_COLUMNS; b <= last / SPAN_COLUMNS; b++) {
        const int32_t l = spans[2 * b], h = spans[2 * b + 1];
        if (l >= h) continue;
        if (*hi <= *lo) {
            *lo = l;
            *hi = h;
        } else {
            *lo = l < *lo ? l : *lo;
            *hi = h > *hi ? h : *hi;
        }
    }
}

/* bf16 y[0 .. VW) += update, the update rounded to bf16 first, as torch rounds it. */
static inline void add_update_vector(uint16_t *y, vf update) {
    const vh packed = narrow(widen(y) + widen_bits(narrow(update)));
    memcpy(y, &packed, sizeof packed);
}

/* The same for a row's y[o .. o + VW), the lanes below out only. */
static inline void add_update(void *y_row, int64_t o, int64_t out, vf update) {
    uint16_t *y = (uint16_t *)y_row + o;
    if (o + VW <= out) {
        add_update_vector(y, update);
        return;
    }
    uint16_t lanes[VW] = {0};
    memcpy(lanes, y, (size_t)(out - o) * 2);
    add_update_vector(lanes, update);
    memcpy(y, lanes, (size_t)(out - o) * 2);
}

/* y[r][o .. o + ob VW) += t[r] B^T over ranks [lo, hi), for the pass's n rows. */
INLINE void expand_cols(const int n, const int ob, rank_row *t, const void *bt, int64_t out,
                        int64_t o, int lo, int hi, void *const *ys, int bf16) {
    vf acc[ROWS][OB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) acc[r][j] = (vf){0};
    for (int k = lo; k < hi; k++) {
        vf bv[OB];
        for (int j = 0; j < ob; j++) bv[j] = ldv(bt, k * out + o + j * VW, bf16);
        for (int r = 0; r < n; r++) {
            const vf tv = splat(t[r][k]);
            for (int j = 0; j < ob; j++) acc[r][j] = fmadd(tv, bv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) {
            if (bf16) {
                add_update_vector((uint16_t *)ys[r] + o + j * VW, acc[r][j]);
            } else {
                float *y = (float *)ys[r] + o + j * VW;
                const vf v = loadf(y) + acc[r][j];
                memcpy(y, &v, sizeof v);
            }
        }
}

/* One row's columns past the last whole vector. Not inlined: every row runs this same
 * code, whatever its pass's row count. */
static __attribute__((noinline)) void expand_tail(const float *t, const void *bt,
                                                  const int32_t *spans, int64_t from,
                                                  int64_t out, void *y, int bf16) {
    for (int64_t o = from; o < out; o++) {
        int lo, hi;
        span_of(spans, o, o, &lo, &hi);
        float s = 0.f;
        for (int k = lo; k < hi; k++) s += ld1(bt, k * out + o, bf16) * t[k];
        if (bf16) {
            uint16_t *yh = (uint16_t *)y + o;
            *yh = f32_to_bf16(bf16_to_f32(*yh) + round_bf16(s));
        } else {
            ((float *)y)[o] += s;
        }
    }
}

INLINE void expand_rows(const int n, rank_row *t, const void *bt, const int32_t *spans,
                        int64_t out, void *const *ys, int bf16) {
    const int64_t outv = out - out % VW;
    int64_t o = 0;
    int lo, hi;
    const int64_t esize = bf16 ? 2 : 4;
    for (; o + OB * VW <= outv; o += OB * VW) {
        span_of(spans, o, o + OB * VW - 1, &lo, &hi);
        if (o + 2 * OB * VW <= outv) {
            /* The next column block's lines of B^T into L2: its ranks lie a row of B^T
             * apart (1-12 KB at SmolLM2's widths), a stride the hardware prefetchers do
             * not follow. 1.09-1.18x with each layer's weights streamed from memory
             * (bench/bench_lora_ab.py); prefetching a block further ahead, all of B^T
             * before the shrink, or A^T's stream gained nothing more. */
            int nlo, nhi;
            span_of(spans, o + OB * VW, o + 2 * OB * VW - 1, &nlo, &nhi);
            for (int k = nlo; k < nhi; k++) {
                const char *line = (const char *)bt + (k * out + o + OB * VW) * esize;
                prefetch_l2(line);
                if (OB * VW * esize > 64) prefetch_l2(line + 64);
            }
        }
        if (lo < hi) expand_cols(n, OB, t, bt, out, o, lo, hi, ys, bf16);
    }
    for (; o < outv; o += VW) {
        span_of(spans, o, o + VW - 1, &lo, &hi);
        if (lo < hi) expand_cols(n, 1, t, bt, out, o, lo, hi, ys, bf16);
    }
    if (outv < out)
        for (int r = 0; r < n; r++) expand_tail(t[r], bt, spans, outv, out, ys[r], bf16);
}

INLINE void pass_rows(const int n, float *const *xs, void *const *ys, const void *at,
                      const void *bt, const int32_t *spans, int rank, int64_t in,
                      int64_t out, int bf16) {
    rank_row t[ROWS];
    shrink_rows(n, xs, at, rank, in, bf16, t);
    expand_rows(n, t, bt, spans, out, ys, bf16);
}

/* Up to ROWS rows of one segment: xs[r] their float32 inputs, ys[r] their outputs. */
static void rows_update(float *const *xs, void *const *ys, int n, const void *at,
                        const void *bt, const int32_t *spans, int rank, int64_t in,
                        int64_t out, int bf16) {
    switch (n) {
#define PASS(N) case N: pass_rows(N, xs, ys, at, bt, spans, rank, in, out, bf16); break;
        PASS(1) PASS(2) PASS(3) PASS(4)
#if ROWS > 4
        PASS(5) PASS(6) PASS(7) PASS(8)
#endif
#undef PASS
        default: break;
    }
}

#if defined(__AVX512BF16__) && VW == 16
/* bf16 on AVX512_BF16: vdpbf16ps multiplies two bf16 pairs into a float32 lane, twice the
 * multiply-adds of vfmadd231ps an instruction, on operands that need no widening. The
 * weights come packed two consecutive summands to a 32-bit lane (kernels/cpu/lora.py
 * pack_pairs): A^T as [ceil(in / 2)][rank16][2], B^T as [ceil(rank / 2)][out16][2], rank16
 * and out16 the next multiples of 16, zero-padded. x's rows are read as they are, a pair
 * at a time. Each output lane is again one chain of dot products in a fixed order. */
#define HAS_PAIRS 1

typedef uint16_t pair_rank_row[LORA_MAX_RANK + 16]; /* the shrink result in bf16 */

static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __m512bh splat_pair(uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

static inline __m512bh load_pairs(const uint32_t *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

INLINE void shrink_pairs_group(const int n, const int kb, const uint16_t *const *xh,
                               const uint32_t *ap, int64_t rank16, int64_t in, int64_t k0,
                               pair_rank_row *t) {
    __m512 acc[ROWS][KB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < kb; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t pairs = (in + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh a[KB];
        for (int j = 0; j < kb; j++) a[j] = load_pairs(ap + p * rank16 + k0 + j * VW);
        for (int r = 0; r < n; r++) {
            /* an odd row's last pair pads x with +0: x[in] is not x's */
            const uint32_t pair = 2 * p + 1 < in ? pair_at(xh[r] + 2 * p) : xh[r][2 * p];
            const __m512bh xb = splat_pair(pair);
            for (int j = 0; j < kb; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, a[j]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < kb; j++) {
            const vh v = narrow((vf)acc[r][j]);
            memcpy(&t[r][k0 + j * VW], &v, sizeof v);
        }
}

INLINE void shrink_pairs(const int n, const uint16_t *const *xh, const uint32_t *ap,
                         int64_t rank16, int64_t in, pair_rank_row *t) {
    for (int64_t k0 = 0; k0 < rank16; k0 += KB * VW) {
        const int64_t left = (rank16 - k0) / VW;
        if (left >= KB) shrink_pairs_group(n, KB, xh, ap, rank16, in, k0, t);
        else if (left == 1) shrink_pairs_group(n, 1, xh, ap, rank16, in, k0, t);
        else shrink_pairs_group(n, 2, xh, ap, rank16, in, k0, t);
    }
}

INLINE void expand_pairs_cols(const int n, const int ob, pair_rank_row *t, const uint32_t *bp,
                              int64_t out16, int64_t out, int64_t o, int q_lo, int q_hi,
                              void *const *ys) {
    __m512 acc[ROWS][OB];
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) acc[r][j] = _mm512_setzero_ps();
    for (int q = q_lo; q < q_hi; q++) {
        __m512bh b[OB];
        for (int j = 0; j < ob; j++) b[j] = load_pairs(bp + q * out16 + o + j * VW);
        for (int r = 0; r < n; r++) {
            const __m512bh tb = splat_pair(pair_at(t[r] + 2 * q));
            for (int j = 0; j < ob; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], tb, b[j]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < ob; j++) add_update(ys[r], o + j * VW, out, (vf)acc[r][j]);
}

INLINE void expand_pairs(const int n, pair_rank_row *t, const uint32_t *bp,
                         const int32_t *spans, int64_t out, void *const *ys) {
    const int64_t out16 = (out + VW - 1) / VW * VW;
    int lo, hi;
    int64_t o = 0;
    for (; o < out16; o += OB * VW) {
        const int ob = o + OB * VW <= out16 ? OB : 1;
        const int64_t last = o + ob * VW <= out ? o + ob * VW - 1 : out - 1;
        span_of(spans, o, last, &lo, &hi);
        if (o + 2 * OB * VW <= out16) {
            int nlo, nhi;
            const int64_t next = o + OB * VW;
            span_of(spans, next, next + OB * VW - 1 < out ? next + OB * VW - 1 : out - 1,
                    &nlo, &nhi);
            for (int q = nlo / 2; q < (nhi + 1) / 2; q++) {
                const char *line = (const char *)(bp + q * out16 + next);
                prefetch_l2(line);
                prefetch_l2(line + 64);
            }
        }
        if (lo >= hi) continue;
        if (ob == OB) expand_pairs_cols(n, OB, t, bp, out16, out, o, lo / 2, (hi + 1) / 2, ys);
        else expand_pairs_cols(n, 1, t, bp, out16, out, o, lo / 2, (hi + 1) / 2, ys);
    }
}

INLINE void pass_pairs(const int n, const uint16_t *const *xh, void *const *ys,
                       const uint32_t *ap, const uint32_t *bp, const int32_t *spans,
                       int rank, int64_t in, int64_t out) {
    pair_rank_row t[ROWS];
    shrink_pairs(n, xh, ap, (rank + VW - 1) / VW * VW, in, t);
    expand_pairs(n, t, bp, spans, out, ys);
}

static void pairs_update(const uint16_t *const *xh, void *const *ys, int n, const void *ap,
                         const void *bp, const int32_t *spans, int rank, int64_t in,
                         int64_t out) {
    switch (n) {
#define PASS(N) case N: pass_pairs(N, xh, ys, ap, bp, spans, rank, in, out); break;
        PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
        default: break;
    }
}
#endif

/* x [*, in] and y [*, out] with row strides (elements, unit column stride); at[g] (A^T,
 * [rank, ...] see above), bt[g] (B^T) and spans[g] (int32 [ceil(out / SPAN_COLUMNS)][2],
 * each block's ranks [lo, hi) with a nonzero B entry) the segment's weights, NULL where
 * that adapter has no update for this layer; at_pairs[g] and bt_pairs[g] the same A^T and
 * B^T packed in pairs (bf16; NULL: none), which a build with AVX512_BF16 runs on. Returns
 * 0, or -1 for a rank or width this kernel does not take (the caller runs torch then). */
int lora_sgmv(int is_bf16, const void *x, int64_t x_stride, void *y, int64_t y_stride,
              const int64_t *rows, const int64_t *starts, int num_segments,
              const void *const *at, const void *const *bt, const int32_t *const *spans,
              const void *const *at_pairs, const void *const *bt_pairs,
              const int32_t *ranks, int64_t in, int64_t out, int num_threads) {
    (void)at_pairs;
    (void)bt_pairs;
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
            if (at[g] == NULL || ranks[g] == 0) continue;
            const int64_t pos = starts[g] + (blk - first_block[g]) * ROWS;
            const int64_t end = starts[g + 1];
            const int n = end - pos < ROWS ? (int)(end - pos) : ROWS;
#ifdef HAS_PAIRS
            if (is_bf16 && at_pairs[g] != NULL && bt_pairs[g] != NULL) {
                const uint16_t *xh[ROWS];
                void *ys[ROWS];
                for (int r = 0; r < n; r++) {
                    const int64_t row = rows[pos + r];
                    xh[r] = (const uint16_t *)x + row * x_stride;
                    ys[r] = (uint16_t *)y + row * y_stride;
                }
                pairs_update(xh, ys, n, at_pairs[g], bt_pairs[g], spans[g], ranks[g], in, out);
                continue;
            }
#endif
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
            rows_update(xs, ys, n, at[g], bt[g], spans[g], ranks[g], in, out, is_bf16);
        }
    }
    return 0;
}
