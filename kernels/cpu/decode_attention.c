/* Paged decode attention for the CPU: one query token per sequence, K/V read in place
 * through the block table (no gathered copy), online softmax in float32. Two loops: a
 * vector one for the common shapes (below) and a per-lane one for the rest.
 *
 * Work item = one sequence; sequences are spread over OpenMP threads. libgomp's
 * soname matches the copy torch ships, so the loader reuses
 * torch's runtime and thread pool instead of starting a second one that would fight
 * it for the cores.
 *
 * Layouts (docs/CONTRACTS.md): query/out [S, H, D]; caches [blocks, block_size, KVH, D];
 * block_tables [S, max_blocks] int32; seq_lens [S] int32. dtype: bf16 (1) or fp32 (0).
 *
 * Sliding window W (0: none): the row at position len - 1 sees keys len - W .. len - 1,
 * and the loops start at the block holding len - W: blocks before it are never read (the
 * KV manager frees them while the request runs, their table entries naming a placeholder
 * of garbage), so a windowed decode costs O(W) whatever the context. Soft cap (0: none):
 * each scaled score s becomes cap * tanh(s / cap) before the softmax (soft_cap.h).
 *
 * Over 300 lines: the AVX-512, AVX2 and portable variants of one decode loop side by
 * side, so each is checked against the others.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "soft_cap.h"
#include "decode_attention.h"

#define MAX_HEAD_DIM 256
#define MAX_HEADS 128

typedef struct {
    const void *query, *key_cache, *value_cache;
    void *out;
    const int32_t *block_tables, *seq_lens;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16, window;
    float scale, soft_cap;
} job_t;

/* The first position a row at len - 1 sees. */
static inline int window_start(const job_t *job, int len) {
    return job->window > 0 && len > job->window ? len - job->window : 0;
}

static inline void load_row(const void *base, int64_t offset, int is_bf16, int n, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* One sequence, all heads. A block's K (then V) rows for every KV head are one
 * contiguous run of memory, converted to float once and reused by the `group` query
 * heads of each KV head; loops run head-outer so a head's query/accumulator stay in
 * registers across the block's tokens. Inlined with a constant head_dim by run_item. */
static inline __attribute__((always_inline)) void run_item_d(const job_t *job, int64_t seq,
                                                             const int d) {
    const int kvh = job->num_kv_heads, bs = job->block_size, heads = job->num_heads;
    const int group = heads / kvh, row = kvh * d;
    const int len = job->seq_lens[seq];
    const int32_t *table = job->block_tables + seq * job->max_blocks;

    float q[heads][d], acc[heads][d], row_max[heads], row_sum[heads];
    float kv[bs][row], scores[heads][bs];
    load_row(job->query, seq * heads * d, job->is_bf16, heads * d, &q[0][0]);
    for (int h = 0; h < heads; h++) {
        for (int i = 0; i < d; i++) { q[h][i] *= job->scale; acc[h][i] = 0.f; }
        row_max[h] = -1e30f;  /* finite, so the build may use fast-math */
        row_sum[h] = 0.f;
    }
    const int lo = window_start(job, len), first = lo / bs * bs;
    for (int start = first; start < len; start += bs) {
        const int n = (len - start < bs) ? len - start : bs;
        const int l = lo > start ? lo - start : 0;  /* this block's keys before the window */
        const int64_t base = (int64_t)table[start / bs] * bs * row;
        if (start + bs < len) {
            /* Blocks sit anywhere in a pool far larger than the caches: fetch the next
             * block's K and V while this one is computed (measured ~1.5x on cold KV). */
            const int64_t next = (int64_t)table[start / bs + 1] * bs * row;
            const int64_t bytes = (int64_t)bs * row * (job->is_bf16 ? 2 : 4);
            const char *next_k = (const char *)job->key_cache + next * (job->is_bf16 ? 2 : 4);
            const char *next_v = (const char *)job->value_cache + next * (job->is_bf16 ? 2 : 4);
            for (int64_t off = 0; off < bytes; off += 64) {
                __builtin_prefetch(next_k + off, 0, 1);
                __builtin_prefetch(next_v + off, 0, 1);
            }
        }
        load_row(job->key_cache, base + (int64_t)l * row, job->is_bf16, (n - l) * row, &kv[l][0]);
        for (int h = 0; h < heads; h++) {
            const float *qh = q[h];
            const int off = (h / group) * d;
            float m = row_max[h];
            for (int t = l; t < n; t++) {
                float s = 0.f;
                for (int i = 0; i < d; i++) s += qh[i] * kv[t][off + i];
                scores[h][t] = s;
            }
            if (job->soft_cap > 0.f) soft_cap_scores(scores[h] + l, n - l, job->soft_cap);
            for (int t = l; t < n; t++) m = scores[h][t] > m ? scores[h][t] : m;
            /* Nothing to correct on the first block (and expf's underflow path is slow). */
            const float correction = start == first ? 0.f : expf(row_max[h] - m);
            float sum = row_sum[h] * correction;
            for (int t = l; t < n; t++) {
                scores[h][t] = expf(scores[h][t] - m);
                sum += scores[h][t];
            }
            row_max[h] = m;
            row_sum[h] = sum;
            for (int i = 0; i < d; i++) acc[h][i] *= correction;
        }
        load_row(job->value_cache, base + (int64_t)l * row, job->is_bf16, (n - l) * row, &kv[l][0]);
        for (int h = 0; h < heads; h++) {
            const int off = (h / group) * d;
            float *ah = acc[h];
            for (int t = l; t < n; t++) {
                const float p = scores[h][t];
                for (int i = 0; i < d; i++) ah[i] += p * kv[t][off + i];
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.f / row_sum[h];
        const int64_t offset = (seq * heads + h) * d;
        if (job->is_bf16) {
            uint16_t *dst = (uint16_t *)job->out + offset;
            for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[h][i] * inv);
        } else {
            float *dst = (float *)job->out + offset;
            for (int i = 0; i < d; i++) dst[i] = acc[h][i] * inv;
        }
    }
}

/* ---- the vector path: head_dim a multiple of 2 * VL (<= 256), <= 8 query heads a KV head ----
 * The per-lane loop above converts a block to float32 in a stack buffer and sums each
 * score on its own; on one Sapphire Rapids core it read 8 GB/s of bf16 KV. Here each
 * K/V row is widened in registers, a query group's partial dot products for VL tokens
 * are reduced together (one butterfly, not VL horizontal sums), a (block, KV head)'s
 * accumulators stay in registers, and the next block is prefetched a row at a time
 * between the arithmetic: 1.5-1.9x the per-lane loop on one core (docs/BENCHMARKS.md).
 * VL is the build's vector: 16 lanes (one zmm) on AVX-512 builds, 8 (one ymm) elsewhere.
 * AVX2 builds had run 16 lanes as pairs of ymm, whose 32-wide shuffles and spilled
 * accumulators made the path 1.7-2.3x slower than the per-lane loop; at 8 lanes it runs
 * 2.4-2.9x the pairs (one core of a Sapphire Rapids capped to AVX2). A sequence is still
 * one work item summed in one order, so its result does not depend on the batch. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

#define NEG_LARGE (-1e30f)
/* fixed bounds, not VLAs: gcc saves and restores the stack pointer around a VLA in a
 * loop body, and keeps its elements in memory */
#define VEC_MAX_GROUP 8
#define VEC_MAX_DV (256 / VL)  /* head_dim <= 256 (Gemma's) */

/* dv vectors of a row of dv * VL values. bf16: each 2 * VL values are one vector load
 * whose even elements (low halves) widen by a shift and odd ones (high halves) by a
 * mask, so vector 2p holds dims 2VLp, 2VLp+2, ... and 2p+1 the odd ones: no
 * cross-lane widening (port 5, shared with the butterfly's shuffles). q, K and V are
 * all read this way, so dot products and the accumulators see one consistent order,
 * undone when the output is written. float32: plain order. */
static inline __attribute__((always_inline)) void load_vectors(const void *base, int64_t offset,
                                                         int is_bf16, const int dv, vf *out) {
    for (int p = 0; p < dv / 2; p++) {
        if (is_bf16) {
            vu x;
            memcpy(&x, (const uint16_t *)base + offset + 2 * VL * p, sizeof x);
            out[2 * p] = (vf)(x << 16);
            out[2 * p + 1] = (vf)(x & 0xFFFF0000u);
        } else {
            memcpy(&out[2 * p], (const float *)base + offset + 2 * VL * p, sizeof out[0]);
            memcpy(&out[2 * p + 1], (const float *)base + offset + 2 * VL * p + VL,
                   sizeof out[0]);
        }
    }
}

static inline __attribute__((always_inline)) vf pair_sum(vf a, vf b, vi even, vi odd) {
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* VL vectors of VL partial sums -> one vector whose lane t is the sum of part[t]. Each
 * level adds neighbouring lane groups of two vectors into one (8 + 4 + 2 + 1 adds at 16
 * lanes, 4 + 2 + 1 at 8). */
#if VL == 16
static inline __attribute__((always_inline)) vf transpose_sum(const vf part[16]) {
    const vi e1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi o1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const vi e2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi o2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi e3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi o3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi e4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi o4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    vf c[8], e[4], g[2];
    for (int i = 0; i < 8; i++) c[i] = pair_sum(part[2 * i], part[2 * i + 1], e1, o1);
    for (int i = 0; i < 4; i++) e[i] = pair_sum(c[2 * i], c[2 * i + 1], e2, o2);
    for (int i = 0; i < 2; i++) g[i] = pair_sum(e[2 * i], e[2 * i + 1], e3, o3);
    return pair_sum(g[0], g[1], e4, o4);
}
#else
static inline __attribute__((always_inline)) vf transpose_sum(const vf part[8]) {
    const vi e1 = {0, 8, 2, 10, 4, 12, 6, 14}, o1 = {1, 9, 3, 11, 5, 13, 7, 15};
    const vi e2 = {0, 1, 8, 9, 4, 5, 12, 13}, o2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi e3 = {0, 1, 2, 3, 8, 9, 10, 11}, o3 = {4, 5, 6, 7, 12, 13, 14, 15};
    vf c[4], e[2];
    for (int i = 0; i < 4; i++) c[i] = pair_sum(part[2 * i], part[2 * i + 1], e1, o1);
    for (int i = 0; i < 2; i++) e[i] = pair_sum(c[2 * i], c[2 * i + 1], e2, o2);
    return pair_sum(e[0], e[1], e3, o3);
}
#endif

/* One sequence. For each block and KV head: the `group` query heads' scores for up to
 * VL tokens at a time, an online-softmax update, then V. Inlined with constant group
 * and dv (head_dim / VL) for the common shapes, so q and the accumulators are registers. */
static inline __attribute__((always_inline)) void run_item_vec(const job_t *job, int64_t seq,
                                                               const int group, const int dv) {
    const int kvh = job->num_kv_heads, bs = job->block_size, heads = job->num_heads;
    const int d = dv * VL, row = kvh * d, is_bf16 = job->is_bf16;
    const int len = job->seq_lens[seq];
    const int32_t *table = job->block_tables + seq * job->max_blocks;
    const int elem = is_bf16 ? 2 : 4;
#if VL == 16
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

    vf acc_all[heads][dv];
    float row_max[heads], row_sum[heads];
    for (int h = 0; h < heads; h++) {
        for (int j = 0; j < dv; j++) acc_all[h][j] = (vf){0};
        row_max[h] = NEG_LARGE;
        row_sum[h] = 0.f;
    }
    const int lo = window_start(job, len);
    const float cap = job->soft_cap;
    for (int start = lo / bs * bs; start < len; start += bs) {
        const int64_t base = (int64_t)table[start / bs] * bs * row;
        const int has_next = start + bs < len;
        const int64_t next = has_next ? (int64_t)table[start / bs + 1] * bs * row : 0;
        for (int kh = 0; kh < kvh; kh++) {
            vf q[VEC_MAX_GROUP][VEC_MAX_DV], acc[VEC_MAX_GROUP][VEC_MAX_DV];
            for (int g = 0; g < group; g++) {
                const int h = kh * group + g;
                load_vectors(job->query, (seq * heads + h) * d, is_bf16, dv, q[g]);
                for (int j = 0; j < dv; j++) {
                    q[g][j] *= job->scale;
                    acc[g][j] = acc_all[h][j];
                }
            }
            for (int c = 0; c < bs && start + c < len; c += VL) {
                int n = len - start - c;  /* tokens in this chunk: <= VL, in the block */
                n = n < VL ? n : VL;
                n = n < bs - c ? n : bs - c;
                /* tokens before the window (only in its first block): not read */
                const int skip = lo - start - c;
                if (skip >= n) continue;
                const int64_t chunk = base + (int64_t)c * row + kh * d;
                vf part[VEC_MAX_GROUP][VL];
                for (int t = 0; t < VL; t++) {
                    if (t < n && t >= skip) {
                        vf k[VEC_MAX_DV];
                        load_vectors(job->key_cache, chunk + (int64_t)t * row, is_bf16, dv, k);
                        for (int g = 0; g < group; g++) {
                            vf s = q[g][0] * k[0];
                            for (int j = 1; j < dv; j++) s += q[g][j] * k[j];
                            part[g][t] = s;
                        }
                    } else {
                        for (int g = 0; g < group; g++) part[g][t] = (vf){0};
                    }
                    if (has_next && t < bs - c) {
                        /* this row's K and V lines of the next block, for this KV head,
                         * into L2: into L1 (locality 3) it ran 1.22-2.12x slower on one
                         * Zen 4 core (1.10-1.76x at 2 threads), the prefetches evicting
                         * the lines in use (bench.bench_decode_attention_ab) */
                        const int64_t at = (next + (int64_t)(c + t) * row + kh * d) * elem;
                        for (int64_t off = 0; off < (int64_t)d * elem; off += 64) {
                            __builtin_prefetch((const char *)job->key_cache + at + off, 0, 2);
                            __builtin_prefetch((const char *)job->value_cache + at + off, 0, 2);
                        }
                    }
                }
                float p[VEC_MAX_GROUP][VL];
                const vi valid = (lane < (vi){0} + n) & (lane >= (vi){0} + skip);
                for (int g = 0; g < group; g++) {
                    const int h = kh * group + g;
                    vf s = transpose_sum(part[g]);
                    /* through memory: gcc vectorizes (libmvec's expf) loops over arrays,
                     * not over a vector's elements */
                    float *pg = p[g];
                    if (cap > 0.f) {
                        memcpy(pg, &s, sizeof s);
                        soft_cap_scores(pg, VL, cap);
                        memcpy(&s, pg, sizeof s);
                    }
                    s = (vf)(((vi)s & valid) | ((vi)((vf){0} + NEG_LARGE) & ~valid));
                    memcpy(pg, &s, sizeof s);
                    float m = row_max[h];
                    for (int t = 0; t < VL; t++) m = pg[t] > m ? pg[t] : m;
                    float sum = 0.f;
                    #pragma omp simd reduction(+:sum)
                    for (int t = 0; t < VL; t++) { pg[t] = expf(pg[t] - m); sum += pg[t]; }
                    /* nothing to correct on the first scores (expf's underflow is slow) */
                    const float correction = row_max[h] == NEG_LARGE ? 0.f : expf(row_max[h] - m);
                    row_max[h] = m;
                    row_sum[h] = row_sum[h] * correction + sum;
                    for (int j = 0; j < dv; j++) acc[g][j] *= correction;
                }
                for (int t = skip > 0 ? skip : 0; t < n; t++) {
                    vf v[VEC_MAX_DV];
                    load_vectors(job->value_cache, chunk + (int64_t)t * row, is_bf16, dv, v);
                    #pragma GCC unroll 8
                    for (int g = 0; g < group; g++) {
                        #pragma GCC unroll 16
                        for (int j = 0; j < dv; j++) acc[g][j] += p[g][t] * v[j];
                    }
                }
            }
            for (int g = 0; g < group; g++)
                for (int j = 0; j < dv; j++) acc_all[kh * group + g][j] = acc[g][j];
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.f / row_sum[h];
        const int64_t offset = (seq * heads + h) * d;
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)job->out + offset;
            for (int p = 0; p < dv / 2; p++) {
                const vf even = acc_all[h][2 * p] * inv, odd = acc_all[h][2 * p + 1] * inv;
                for (int i = 0; i < VL; i++) {
                    dst[2 * VL * p + 2 * i] = f32_to_bf16(even[i]);
                    dst[2 * VL * p + 2 * i + 1] = f32_to_bf16(odd[i]);
                }
            }
        } else {
            for (int j = 0; j < dv; j++) {
                const vf o = acc_all[h][j] * inv;
                memcpy((float *)job->out + offset + j * VL, &o, sizeof o);
            }
        }
    }
}

#define VEC_CASE(G, D) \
    if (group == G && dv == D / VL) { run_item_vec(job, seq, G, D / VL); return; }

static void run_item(const job_t *job, int64_t seq) {
    const int group = job->num_heads / job->num_kv_heads, dv = job->head_dim / VL;
    if (job->head_dim % (2 * VL) == 0 && group <= VEC_MAX_GROUP && dv <= VEC_MAX_DV) {
        /* SmolLM2 (3, 64), Llama-3.2-1B/3B (4, 64 / 3, 128), Llama-3-8B (4, 128), MHA */
        VEC_CASE(1, 64) VEC_CASE(2, 64) VEC_CASE(3, 64) VEC_CASE(4, 64) VEC_CASE(8, 64)
        VEC_CASE(1, 128) VEC_CASE(2, 128) VEC_CASE(3, 128) VEC_CASE(4, 128) VEC_CASE(7, 128)
        VEC_CASE(8, 128)
        /* Gemma 2/3 (2, 256 and 4 / 1, 256) */
        VEC_CASE(1, 256) VEC_CASE(2, 256) VEC_CASE(4, 256)
        run_item_vec(job, seq, group, dv);
        return;
    }
    switch (job->head_dim) {
        case 64: run_item_d(job, seq, 64); break;
        case 128: run_item_d(job, seq, 128); break;
        default: run_item_d(job, seq, job->head_dim);
    }
}

/* Returns 0 on success, a negative code for shapes this kernel does not handle. window:
 * keys a row sees (itself included), 0 for all; soft_cap: 0 for none. */
int paged_decode_attention_windowed(const void *query, const void *key_cache,
                                    const void *value_cache, void *out,
                                    const int32_t *block_tables, const int32_t *seq_lens,
                                    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, int max_blocks, float scale, int window,
                                    float soft_cap, int is_bf16, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_HEADS || block_size > 128 || window < 0
            || !(soft_cap >= 0.f))
        return -1;
    const job_t job = {query, key_cache, value_cache, out, block_tables, seq_lens, num_heads,
                       num_kv_heads, head_dim, block_size, max_blocks, is_bf16, window,
                       scale, soft_cap};
    /* Dynamic chunks: sequences have very different lengths. One sequence (a single
     * stream) runs on this thread: waking the pool for it cost more than its attention. */
    #pragma omp parallel for schedule(dynamic, 2) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (num_seqs > 1)
    for (int64_t seq = 0; seq < num_seqs; seq++) run_item(&job, seq);
    return 0;
}

/* Full attention, no cap: the entry the fused decode step (decode_step.c) calls. */
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           void *out, const int32_t *block_tables, const int32_t *seq_lens,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16,
                           int num_threads) {
    return paged_decode_attention_windowed(query, key_cache, value_cache, out, block_tables,
                                           seq_lens, num_seqs, num_heads, num_kv_heads,
                                           head_dim, block_size, max_blocks, scale, 0, 0.f,
                                           is_bf16, num_threads);
}
