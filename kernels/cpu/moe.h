/* The fused mixture-of-experts op (moe.c says why it is built so) for both weight formats,
 * dense rows (moe.c) and MXFP4 blocks (moe_mxfp4.c): they differ only in how a group of
 * DOT_ROWS weight rows reaches the dot product (moe_t.rows: in place, or decoded into the
 * thread's buffer). Grouping, work items, roundings and slot sums are this one code. */
#ifndef TLE_MOE_H
#define TLE_MOE_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "row_dot.h"
#include "silu.h"
enum { MOE_SILU = 0, MOE_SWIGLUOAI = 1 };  /* kernels/torch_moe.ACTIVATIONS' order */

/* Outputs per work item: GATE_COLS gate outputs and the matching up outputs (a 2048-wide
 * bf16 row: 256 KB of W), or DOWN_ROWS rows of w2. Small enough that one token's 8
 * experts make 192 and 256 items (Qwen3-30B-A3B: I = 768, H = 2048), so 2..64 cores stay
 * busy, large enough that an item is a long sequential read. */
enum { GATE_COLS = 32, DOWN_ROWS = 64 };
/* Tokens that pass over a group of W rows together: the group stays in L1 while their
 * x rows (16 x 4 KB at H = 2048) sit in L2, however many tokens an expert has. */
enum { TOKEN_BLOCK = 16 };
/* Scratch for the per-pair activations and outputs, per token chunk: a prefill of
 * thousands of tokens runs in chunks, each reading the active weights once. */
#define CHUNK_BYTES ((int64_t)64 << 20)
typedef struct moe moe_t;
/* Rows r0..r0+n-1 (n <= DOT_ROWS) of expert e's w13 (down = 0: 2I rows of H) or w2
 * (down = 1: H rows of I), k apart, in moe_t.w_bf16's format; buf: decode_bytes. */
typedef const void *(*moe_rows_fn)(const moe_t *m, int down, int64_t e, int64_t r0, int n,
                                   void *buf);

struct moe {
    int bf16;         /* x and biases (and dense weights) are bf16, else float32 */
    int act;          /* MOE_SILU or MOE_SWIGLUOAI */
    float alpha, limit;
    int64_t H, I, k;
    const void *w13, *w2;  /* the weights, in the format `rows` reads */
    const void *b13, *b2;  /* [E, 2I], [E, H], or NULL */
    const void *s13, *s2;  /* per-format extras (MXFP4: the scales), else NULL */
    moe_rows_fn rows;
    int w_bf16;            /* what `rows` returns: bf16 (dot4_bf16) or float32 (dot4_f32) */
    int64_t decode_bytes;  /* per-thread buffer `rows` decodes into; 0: rows in place */
};

/* x's rows as the dot product reads them: bf16 where vdpbf16ps does, else float32. */
static inline int64_t dot_x_size(int bf16) { return bf16 && ROW_DOT_DPBF16 ? 2 : 4; }

/* rows 0.. (`rows` of them, at most DOT_ROWS; a short group repeats its last row: same
 * reads, results dropped) of w [*, k] against one x row. */
static inline void dot_rows(int w_bf16, const void *x, const void *w, int rows, int64_t k,
                            int ahead, float out[DOT_ROWS]) {
    if (w_bf16) {
        const uint16_t *wr[DOT_ROWS];
        for (int r = 0; r < DOT_ROWS; r++)
            wr[r] = (const uint16_t *)w + (r < rows ? r : rows - 1) * k;
        dot4_bf16((const bf16_dot_x *)x, wr, k, ahead, out);
    } else {
        const float *wr[DOT_ROWS];
        for (int r = 0; r < DOT_ROWS; r++)
            wr[r] = (const float *)w + (r < rows ? r : rows - 1) * k;
        dot4_f32((const float *)x, wr, k, ahead, out);
    }
}

/* A matmul output as torch_moe has it: in bf16, rounded, then + bias and rounded again. */
static inline float finish(int bf16, float v, const void *bias, int64_t i) {
    if (bf16) {
        v = round_bf16(v);
        return bias ? round_bf16(v + bf16_to_f32(((const uint16_t *)bias)[i])) : v;
    }
    return bias ? v + ((const float *)bias)[i] : v;
}

/* g[i] = activation(g[i], u[i]) in float32, for n outputs. The exp arguments are clamped
 * where the result is zero in float32 anyway: under -ffast-math a quotient by inf becomes
 * NaN (silu.h). */
static inline void activate(const moe_t *m, float *restrict g, const float *restrict u,
                            int n) {
    if (m->act == MOE_SILU) {
        for (int i = 0; i < n; i++) g[i] = silu(g[i]) * u[i];
        return;
    }
    const float alpha = m->alpha, limit = m->limit;
    for (int i = 0; i < n; i++) {
        const float gate = fminf(g[i], limit), up = fminf(fmaxf(u[i], -limit), limit);
        const float sigmoid = 1.f / (1.f + expf(-fmaxf(gate * alpha, -88.f)));
        g[i] = (up + 1.f) * (gate * sigmoid);
    }
}

/* One activation into the buffer the down projection reads as x (dot_x_size). */
static inline void store_dot_x(int bf16, void *dst, int64_t i, float v) {
#if ROW_DOT_DPBF16
    if (bf16) {
        ((uint16_t *)dst)[i] = f32_to_bf16(v);
        return;
    }
#endif
    ((float *)dst)[i] = bf16 ? round_bf16(v) : v;
}

/* Gate and up outputs c0..c0+n-1 of expert e for its `count` pairs (pair p is token
 * p / k), activated into act [pairs, I]. g and u: scratch of count * GATE_COLS each;
 * wbuf: the thread's decode buffer (decoded rows are in cache: no prefetch). */
static inline void gate_up_item(const moe_t *m, int64_t e, int64_t c0, int n,
                                const int64_t *pairs, int64_t count, const void *xs, void *act,
                                float *g, float *u, void *wbuf) {
    const int64_t H = m->H, I = m->I, xsize = dot_x_size(m->bf16), bsize = m->bf16 ? 2 : 4;
    const void *bias = m->b13 ? (const char *)m->b13 + e * 2 * I * bsize : NULL;
    for (int64_t t0 = 0; t0 < count; t0 += TOKEN_BLOCK) {
        const int64_t t1 = t0 + TOKEN_BLOCK < count ? t0 + TOKEN_BLOCK : count;
        for (int half = 0; half < 2; half++) {
            float *dst = half ? u : g;
            const int64_t row0 = half * I + c0;
            for (int c = 0; c < n; c += DOT_ROWS) {
                const int rows = n - c < DOT_ROWS ? n - c : DOT_ROWS;
                const void *w = m->rows(m, 0, e, row0 + c, rows, wbuf);
                for (int64_t t = t0; t < t1; t++) {
                    float o[DOT_ROWS];
                    const char *x = (const char *)xs + pairs[t] / m->k * H * xsize;
                    dot_rows(m->w_bf16, x, w, rows, H, t == 0 && !m->decode_bytes, o);
                    for (int r = 0; r < rows; r++)
                        dst[t * GATE_COLS + c + r] = finish(m->bf16, o[r], bias, row0 + c + r);
                }
            }
        }
    }
    for (int64_t t = 0; t < count; t++) {
        float *a = g + t * GATE_COLS;
        activate(m, a, u + t * GATE_COLS, n);
        for (int i = 0; i < n; i++) store_dot_x(m->bf16, act, pairs[t] * I + c0 + i, a[i]);
    }
}

/* Down-projection outputs h0..h0+n-1 of expert e for its pairs -> y [pairs, H]. */
static inline void down_item(const moe_t *m, int64_t e, int64_t h0, int n, const int64_t *pairs,
                             int64_t count, const void *act, float *y, void *wbuf) {
    const int64_t H = m->H, I = m->I, xsize = dot_x_size(m->bf16), bsize = m->bf16 ? 2 : 4;
    const void *bias = m->b2 ? (const char *)m->b2 + e * H * bsize : NULL;
    for (int64_t t0 = 0; t0 < count; t0 += TOKEN_BLOCK) {
        const int64_t t1 = t0 + TOKEN_BLOCK < count ? t0 + TOKEN_BLOCK : count;
        for (int c = 0; c < n; c += DOT_ROWS) {
            const int rows = n - c < DOT_ROWS ? n - c : DOT_ROWS;
            const void *w = m->rows(m, 1, e, h0 + c, rows, wbuf);
            for (int64_t t = t0; t < t1; t++) {
                float o[DOT_ROWS];
                const char *a = (const char *)act + pairs[t] * I * xsize;
                dot_rows(m->w_bf16, a, w, rows, I, t == 0 && !m->decode_bytes, o);
                for (int r = 0; r < rows; r++)
                    y[pairs[t] * H + h0 + c + r] = finish(m->bf16, o[r], bias, h0 + c + r);
            }
        }
    }
}

static inline int64_t expert_of(const void *ids, int ids_64, int64_t q) {
    return ids_64 ? ((const int64_t *)ids)[q] : (int64_t)((const int32_t *)ids)[q];
}
/* out[t][h0..h0+n) = sum over the slots of token t in order (j = 0..k-1) of w * y,
 * float32, for `tokens` tokens; slots without a valid expert are skipped, so a token
 * with none gets zeros. ids and weights [tokens, k] from this chunk's first token. */
static inline void sum_slots(const moe_t *m, int64_t E, int64_t tokens, const void *ids,
                             int ids_64, const float *weights, const float *y, int64_t h0,
                             int n, void *out) {
    const int64_t H = m->H, k = m->k;
    for (int64_t t = 0; t < tokens; t++) {
        float acc[DOWN_ROWS] = {0.f};
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = expert_of(ids, ids_64, t * k + j);
            if (e < 0 || e >= E) continue;
            const float wj = weights[t * k + j], *yj = y + (t * k + j) * H + h0;
            for (int i = 0; i < n; i++) acc[i] += wj * yj[i];
        }
        if (m->bf16) {
            uint16_t *o = (uint16_t *)out + t * H + h0;
            for (int i = 0; i < n; i++) o[i] = f32_to_bf16(acc[i]);
        } else {
            memcpy((float *)out + t * H + h0, acc, (size_t)n * sizeof(float));
        }
    }
}

/* The whole op for m's weights: x [T, H] in m's activation dtype; topk_weights [T, k]
 * float32; topk_ids [T, k] int64 (ids_64) or int32, ids outside [0, E) skipped; out
 * [T, H]. Returns 0, or -1 when scratch could not be allocated (nothing written). */
static inline int moe_run(const moe_t *mp, const void *x, int64_t T, int64_t E,
                          const float *topk_weights, const void *topk_ids, int ids_64,
                          void *out, int num_threads) {
    if (T <= 0 || mp->H <= 0) return 0;
    const moe_t m = *mp;
    const int64_t H = m.H, I = m.I, k = m.k, xsize = dot_x_size(m.bf16);
    /* A portable bf16 build widens x to float32 once per chunk for the dot products. */
    const int widen_x = m.bf16 && xsize == 4;
    const int64_t per_token = k * (H * 4 + I * xsize) + (widen_x ? H * 4 : 0);
    int64_t chunk = CHUNK_BYTES / (per_token > 0 ? per_token : 1);
    chunk = chunk < 1 ? 1 : chunk > T ? T : chunk;
    if (num_threads < 1) num_threads = 1;
    const int64_t max_pairs = chunk * k;
    const int64_t down_blocks = (H + DOWN_ROWS - 1) / DOWN_ROWS;
    const int64_t wbuf_bytes = (m.decode_bytes + 63) / 64 * 64;  /* whole lines a thread */
    int64_t *offsets = malloc((size_t)(2 * E + 1 + down_blocks) * sizeof(int64_t));
    int64_t *active = malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t));
    int64_t *pairs = malloc((size_t)(max_pairs > 0 ? max_pairs : 1) * sizeof(int64_t));
    float *y = malloc((size_t)(max_pairs * H + 1) * sizeof(float));
    void *act = malloc((size_t)(max_pairs * I + 1) * (size_t)xsize);
    /* 64-byte aligned, as is each thread's share and each pair's row in it (multiples of
     * 2 * GATE_COLS floats): gcc may peel a vector loop's first elements to an alignment,
     * and an activation then computed by the scalar exp instead of the vector one would
     * make a row's bits depend on its neighbours through the batch's largest expert. */
    float *scratch = aligned_alloc(64, (size_t)num_threads * 2 * GATE_COLS
                                           * (size_t)(max_pairs + 1) * sizeof(float));
    char *wbufs = wbuf_bytes ? aligned_alloc(64, (size_t)(num_threads * wbuf_bytes)) : NULL;
    float *xw = widen_x ? malloc((size_t)(chunk * H) * sizeof(float)) : NULL;
    if (!offsets || !active || !pairs || !y || !act || !scratch || (wbuf_bytes && !wbufs)
        || (widen_x && !xw)) {
        free(offsets), free(active), free(pairs), free(y), free(act), free(scratch);
        free(wbufs), free(xw);
        return -1;
    }
    int64_t *fill = offsets + E + 1, *left = fill + E;
    const int64_t gate_blocks = (I + GATE_COLS - 1) / GATE_COLS;
    const int64_t xbytes = m.bf16 ? 2 : 4;

    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        const int64_t tokens = T - c0 < chunk ? T - c0 : chunk, n_pairs = tokens * k;
        /* Group the chunk's pairs by expert: counts, prefix sums, then each expert's pairs
         * in pair order (the order does not change any value; it keeps runs repeatable). */
        memset(offsets, 0, (size_t)(E + 1) * sizeof(int64_t));
        for (int64_t p = 0; p < n_pairs; p++) {
            const int64_t e = expert_of(topk_ids, ids_64, c0 * k + p);
            if (e >= 0 && e < E) offsets[e + 1]++;
        }
        int64_t n_active = 0, max_count = 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t count = offsets[e + 1];
            if (count > 0) active[n_active++] = e;
            if (count > max_count) max_count = count;
            offsets[e + 1] += offsets[e];
            fill[e] = offsets[e];
        }
        for (int64_t p = 0; p < n_pairs; p++) {
            const int64_t e = expert_of(topk_ids, ids_64, c0 * k + p);
            if (e >= 0 && e < E) pairs[fill[e]++] = p;
        }
        const char *xc = (const char *)x + c0 * H * xbytes;
        const void *xs = widen_x ? (const void *)xw : (const void *)xc;
        const float *wc = topk_weights + c0 * k;
        char *oc = (char *)out + c0 * H * xbytes;
        if (n_active == 0) {  /* nothing routed here: zeros (all-zero bits in bf16 too) */
            memset(oc, 0, (size_t)(tokens * H * xbytes));
            continue;
        }
        /* Experts still to finish each block of DOWN_ROWS outputs: the thread that
         * finishes the last one sums that block for every token at once, so no barrier
         * waits for the whole down projection before the sums start, and a thread held
         * up mid-item (a busy host deschedules one for a time slice) delays only the
         * sums of its own block. */
        for (int64_t b = 0; b < down_blocks; b++) left[b] = n_active;
        const int64_t weight_elems = n_active * 3 * I * H;
        #pragma omp parallel num_threads(num_threads) if (weight_elems >= 65536)
        {
            const int thread = omp_get_thread_num();
            float *g = scratch + (int64_t)thread * 2 * GATE_COLS * (max_count + 1);
            float *u = g + GATE_COLS * (max_count + 1);
            void *wbuf = wbufs ? wbufs + thread * wbuf_bytes : NULL;
            if (widen_x) {
                #pragma omp for schedule(static)
                for (int64_t i = 0; i < tokens * H; i++)
                    xw[i] = bf16_to_f32(((const uint16_t *)xc)[i]);
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_active * gate_blocks; it++) {
                const int64_t e = active[it / gate_blocks], col = (it % gate_blocks) * GATE_COLS;
                const int n = I - col < GATE_COLS ? (int)(I - col) : GATE_COLS;
                gate_up_item(&m, e, col, n, pairs + offsets[e], offsets[e + 1] - offsets[e],
                             xs, act, g, u, wbuf);
            }
            #pragma omp for schedule(dynamic, 1) nowait
            for (int64_t it = 0; it < n_active * down_blocks; it++) {
                const int64_t e = active[it / down_blocks], b = it % down_blocks;
                const int64_t h0 = b * DOWN_ROWS;
                const int n = H - h0 < DOWN_ROWS ? (int)(H - h0) : DOWN_ROWS;
                down_item(&m, e, h0, n, pairs + offsets[e], offsets[e + 1] - offsets[e], act, y,
                          wbuf);
                /* acq_rel: the thread that reaches 0 sees every other expert's y */
                if (__atomic_sub_fetch(&left[b], 1, __ATOMIC_ACQ_REL) == 0)
                    sum_slots(&m, E, tokens, (const char *)topk_ids + c0 * k * (ids_64 ? 8 : 4),
                              ids_64, wc, y, h0, n, oc);
            }
        }
    }
    free(offsets), free(active), free(pairs), free(y), free(act), free(scratch);
    free(wbufs), free(xw);
    return 0;
}

#endif
