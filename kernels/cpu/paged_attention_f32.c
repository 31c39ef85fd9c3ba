/* Paged causal attention for float32 and bf16, every sequence of a step in one call:
 * decode rows and prefill chunks alike, K/V read in place through the block table.
 *
 * Why: prefill chunks went through the decode kernel one query row at a time, each row
 * reading its whole context again, and its score loop is one dependent chain of FMAs
 * per key. Here a work item is a tile of query positions (all heads), so every K/V row
 * loaded from the cache meets all of the tile's query rows, and the scores are 2 rows x
 * 4 keys of independent chains: 61 vs 89 ms for four fresh 512-token prompts, 30 vs 44
 * for eight of 256 (SmolLM2's 9/3 heads, one layer, 1 thread, AVX2 EPYC). Decode-only
 * steps stay on decode_attention.c, bound by reading the cache (4.3 vs 4.1 ms here).
 *
 * A score, a softmax block and an output lane are computed the same way whatever tile a
 * row is in (per-lane FMA chains over head_dim, then sum4's order; blocks of block_size
 * keys from position 0, online softmax as decode_attention.c), so a row's result does
 * not depend on its chunk or on which rows share its tile.
 *
 * bf16 runs the same float32 arithmetic: query rows are widened on load, and a block's
 * K/V rows of one head are widened into a per-thread buffer that every row of the tile
 * then reads (widening is exact, so the bits match the float32 kernel on the widened
 * inputs); the output is rounded to bf16 at the end (nearest-even, bf16.h).
 *
 * Sliding window W (0: none): the row at position p sees keys p - W + 1 .. p. A tile's
 * blocks start at the one holding its first row's lowest key, so blocks before every
 * row's window are never read (they may be freed, their entries naming a placeholder of
 * garbage); in a block a row sees only part of, it softmaxes its own keys and adds exact
 * zeros for the others, so a row's bits still do not depend on its tile. Soft cap (0:
 * none): each scaled score s becomes cap * tanh(s / cap) before the softmax.
 *
 * Layouts (docs/CONTRACTS.md): query/out [T, H, D]; caches [blocks, block_size, KVH, D];
 * block_tables [S, max_blocks] int32; query_start_loc [S + 1] and seq_lens [S] int32.
 * head_dim a multiple of 8.
 *
 * Over 300 lines: the float32 and bf16 paged-attention kernels share the block walk and
 * the online softmax.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "soft_cap.h"
#include "vec8.h"

#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128
#define MAX_HEADS 128
/* Query rows per KV head (positions x the heads of its group) a work item holds at most,
 * when the group allows. */
#define TILE_ROWS 16

typedef struct {
    const void *query, *key_cache, *value_cache;  /* float or uint16_t (bf16) */
    void *out;
    const int32_t *block_tables, *seq_lens;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale, soft_cap;
} attn_t;

typedef int v8i __attribute__((vector_size(32)));

/* Lanes 0-3: the sums of a, b, c, d (pairs of lanes, then pairs of pairs, then halves:
 * one fixed order for every score). */
static inline v8f sum4(v8f a, v8f b, v8f c, v8f d) {
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    const v8f ab = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
    const v8f cd = __builtin_shuffle(c, d, even) + __builtin_shuffle(c, d, odd);
    const v8f y = __builtin_shuffle(ab, cd, even) + __builtin_shuffle(ab, cd, odd);
    return y + __builtin_shuffle(y, (v8i){4, 5, 6, 7, 0, 1, 2, 3});
}

/* Scores of two query rows (q1 may repeat q0) against four keys. */
static inline __attribute__((always_inline)) void qk_2x4(const float *q0, const float *q1,
                                                         const float *const *k, const int d,
                                                         float *s0, float *s1) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int i = 0; i < d; i += 8) {
        const v8f k0 = load8(k[0] + i), k1 = load8(k[1] + i);
        const v8f k2 = load8(k[2] + i), k3 = load8(k[3] + i);
        const v8f x = load8(q0 + i), y = load8(q1 + i);
        a0 += x * k0; a1 += x * k1; a2 += x * k2; a3 += x * k3;
        b0 += y * k0; b1 += y * k1; b2 += y * k2; b3 += y * k3;
    }
    const v8f sa = sum4(a0, a1, a2, a3), sb = sum4(b0, b1, b2, b3);
    memcpy(s0, &sa, 4 * sizeof(float));
    memcpy(s1, &sb, 4 * sizeof(float));
}

/* acc_r[:] += sum over t < n of p_r[t] * v[t][:], two rows at once (acc1 may be NULL). */
static inline __attribute__((always_inline)) void pv_2(float *acc0, float *acc1,
                                                       const float *p0, const float *p1,
                                                       const float *const *v, int n,
                                                       const int d) {
    for (int c = 0; c < d; c += 32) {
        const int nv = (d - c) >= 32 ? 4 : (d - c) / 8;
        v8f a[4], b[4];
        for (int j = 0; j < nv; j++) {
            a[j] = load8(acc0 + c + 8 * j);
            b[j] = acc1 ? load8(acc1 + c + 8 * j) : a[j];
        }
        for (int t = 0; t < n; t++) {
            const float x = p0[t], y = acc1 ? p1[t] : 0.f;
            for (int j = 0; j < nv; j++) {
                const v8f w = load8(v[t] + c + 8 * j);
                a[j] += x * w;
                b[j] += y * w;
            }
        }
        for (int j = 0; j < nv; j++) {
            memcpy(acc0 + c + 8 * j, &a[j], sizeof a[j]);
            if (acc1) memcpy(acc1 + c + 8 * j, &b[j], sizeof b[j]);
        }
    }
}

/* Online softmax of one row's block of n scores, in place -> weights (soft-capped first
 * when cap > 0); returns the factor the row's accumulator is rescaled by. Out of line:
 * one copy of this arithmetic. */
static __attribute__((noinline)) float softmax_block(float *s, int n, int first, float cap,
                                                     float *row_max, float *row_sum) {
    if (cap > 0.f) soft_cap_scores(s, n, cap);
    float m = *row_max;
    for (int t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    /* Nothing to correct on the first block (and expf's underflow path is slow). */
    const float correction = first ? 0.f : expf(*row_max - m);
    float sum = *row_sum * correction;
    for (int t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    *row_max = m;
    *row_sum = sum;
    return correction;
}

/* Rows first_pos .. first_pos + num_pos - 1 of sequence `seq` (query rows from `row0`),
 * every head. For each KV head h, row r = position p * group + head g. Blocks outside,
 * heads inside: a block's K (then V) rows of all heads are one run of memory, streamed
 * once (decode steps are bound by reading the cache: ~300 MB a step for SmolLM2 at 64
 * sequences of ~110 tokens), and the next block is fetched while this one is used. */
static inline __attribute__((always_inline)) void run_tile_d(const attn_t *job, int seq,
                                                             int row0, int first_pos,
                                                             int num_pos, const int d,
                                                             const int bf16) {
    const int bs = job->block_size, heads = job->num_heads, kv_heads = job->num_kv_heads;
    const int group = heads / kv_heads, stride = kv_heads * d;
    const int rows = num_pos * group, last_pos = first_pos + num_pos - 1;
    const int32_t *table = job->block_tables + (int64_t)seq * job->max_blocks;
    /* Score rows padded to whole groups of 4 keys: qk_2x4 writes them. */
    float q[kv_heads][rows][d], acc[kv_heads][rows][d], scores[rows][(bs + 3) & ~3];
    float row_max[kv_heads][rows], row_sum[kv_heads][rows];
    /* One head's block of K and V widened from bf16 (unused for float32). */
    float kbuf[bf16 ? bs : 1][d], vbuf[bf16 ? bs : 1][d];
    const int elem = bf16 ? 2 : 4;
    for (int h = 0; h < kv_heads; h++) {
        for (int r = 0; r < rows; r++) {
            const int p = r / group, g = r % group;
            const int64_t off = ((int64_t)(row0 + p) * heads + h * group + g) * d;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)job->query + off;
                for (int i = 0; i < d; i++) q[h][r][i] = bf16_to_f32(src[i]) * job->scale;
            } else {
                const float *src = (const float *)job->query + off;
                for (int i = 0; i < d; i++) q[h][r][i] = src[i] * job->scale;
            }
            for (int i = 0; i < d; i++) acc[h][r][i] = 0.f;
            row_max[h][r] = -1e30f;  /* finite, so the build may use fast-math */
            row_sum[h][r] = 0.f;
        }
    }
    const float *kp[MAX_BLOCK + 3], *vp[MAX_BLOCK];
    /* A row's lowest key (0 without a window); the tile's first row has the lowest. */
    const int window = job->window;
#define LOWEST(pos) (window > 0 && (pos) >= window ? (pos) - window + 1 : 0)
    const float cap = job->soft_cap;
    for (int start = LOWEST(first_pos) / bs * bs; start <= last_pos; start += bs) {
        const int n = (last_pos + 1 - start < bs) ? last_pos + 1 - start : bs;
        const int64_t block = (int64_t)table[start / bs] * bs * stride;
        if (start + bs <= last_pos) {
            /* Blocks sit anywhere in a pool far larger than the caches: fetch the next
             * block's K and V while this one is computed (as decode_attention.c). */
            const int64_t next = (int64_t)table[start / bs + 1] * bs * stride * elem;
            const char *next_k = (const char *)job->key_cache + next;
            const char *next_v = (const char *)job->value_cache + next;
            for (int64_t off = 0; off < (int64_t)bs * stride * elem; off += 64) {
                __builtin_prefetch(next_k + off, 0, 1);
                __builtin_prefetch(next_v + off, 0, 1);
            }
        }
        for (int h = 0; h < kv_heads; h++) {
            if (bf16) {
                const uint16_t *ks = (const uint16_t *)job->key_cache + block + h * d;
                const uint16_t *vs = (const uint16_t *)job->value_cache + block + h * d;
                for (int t = 0; t < n; t++) {
                    for (int i = 0; i < d; i++) {
                        kbuf[t][i] = bf16_to_f32(ks[(int64_t)t * stride + i]);
                        vbuf[t][i] = bf16_to_f32(vs[(int64_t)t * stride + i]);
                    }
                    kp[t] = kbuf[t];
                    vp[t] = vbuf[t];
                }
            } else {
                for (int t = 0; t < n; t++) {
                    kp[t] = (const float *)job->key_cache + block + (int64_t)t * stride + h * d;
                    vp[t] = (const float *)job->value_cache + block + (int64_t)t * stride + h * d;
                }
            }
            for (int t = n; t < n + 3; t++) kp[t] = kp[0];  /* scores past n are dropped */
            for (int r = 0; r < rows; r += 2) {
                const int r1 = r + 1 < rows ? r + 1 : r;
                const int p0 = first_pos + r / group, p1 = first_pos + r1 / group;
                /* Keys a row sees in this block: l .. m - 1, from its window's start (0
                 * without one) up to its own position. */
                const int m0 = p0 - start + 1 < n ? p0 - start + 1 : n;
                const int m1 = p1 - start + 1 < n ? p1 - start + 1 : n;
                const int lo0 = LOWEST(p0), lo1 = LOWEST(p1);
                const int l0 = lo0 > start ? lo0 - start : 0, l1 = lo1 > start ? lo1 - start : 0;
                const int has0 = m0 > l0, has1 = r1 != r && m1 > l1;
                if (!has0 && !has1) continue;  /* neither row sees a key of this block */
                /* From the first key either row sees, in the score groups of 4. */
                const int from = (has0 ? l0 : l1) & ~3, to = has1 ? m1 : m0;
                for (int t = from; t < to; t += 4)
                    qk_2x4(q[h][r], q[h][r1], kp + t, d, scores[r] + t, scores[r1] + t);
                /* Each row's first block (the one holding its lowest key) has nothing to
                 * rescale. */
                const int first0 = lo0 >= start, first1 = lo1 >= start;
                if (has0) {
                    const float c0 = softmax_block(scores[r] + l0, m0 - l0, first0, cap,
                                                   &row_max[h][r], &row_sum[h][r]);
                    if (!first0) for (int i = 0; i < d; i++) acc[h][r][i] *= c0;
                }
                if (has1) {
                    const float c1 = softmax_block(scores[r1] + l1, m1 - l1, first1, cap,
                                                   &row_max[h][r1], &row_sum[h][r1]);
                    if (!first1) for (int i = 0; i < d; i++) acc[h][r1][i] *= c1;
                }
                if (!has1) {
                    pv_2(acc[h][r], NULL, scores[r] + l0, NULL, vp + l0, m0 - l0, d);
                } else if (!has0) {
                    pv_2(acc[h][r1], NULL, scores[r1] + l1, NULL, vp + l1, m1 - l1, d);
                } else {
                    /* Together over r's keys (l0 <= l1 and m0 <= m1: r1 is no earlier),
                     * r1 weighing its keys before l1 by exact zeros; then r1's rest. */
                    for (int t = l0; t < l1 && t < m0; t++) scores[r1][t] = 0.f;
                    pv_2(acc[h][r], acc[h][r1], scores[r] + l0, scores[r1] + l0, vp + l0,
                         m0 - l0, d);
                    const int rest = m0 > l1 ? m0 : l1;
                    if (m1 > rest)
                        pv_2(acc[h][r1], NULL, scores[r1] + rest, NULL, vp + rest, m1 - rest, d);
                }
            }
        }
    }
#undef LOWEST
    for (int h = 0; h < kv_heads; h++) {
        for (int r = 0; r < rows; r++) {
            const int p = r / group, g = r % group;
            const float inv = 1.f / row_sum[h][r];
            const int64_t off = ((int64_t)(row0 + p) * heads + h * group + g) * d;
            if (bf16) {
                uint16_t *dst = (uint16_t *)job->out + off;
                for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[h][r][i] * inv);
            } else {
                float *dst = (float *)job->out + off;
                for (int i = 0; i < d; i++) dst[i] = acc[h][r][i] * inv;
            }
        }
    }
}

static void run_tile(const attn_t *job, int seq, int row0, int first_pos, int num_pos) {
    switch (job->head_dim) {
        case 64: run_tile_d(job, seq, row0, first_pos, num_pos, 64, 0); break;
        case 128: run_tile_d(job, seq, row0, first_pos, num_pos, 128, 0); break;
        default: run_tile_d(job, seq, row0, first_pos, num_pos, job->head_dim, 0);
    }
}

static void run_tile_bf16(const attn_t *job, int seq, int row0, int first_pos, int num_pos) {
    switch (job->head_dim) {
        case 64: run_tile_d(job, seq, row0, first_pos, num_pos, 64, 1); break;
        case 128: run_tile_d(job, seq, row0, first_pos, num_pos, 128, 1); break;
        default: run_tile_d(job, seq, row0, first_pos, num_pos, job->head_dim, 1);
    }
}

static inline int chunk_start(const int32_t *query_start_loc, int s) {
    return query_start_loc[s];
}

/* Returns 0 on success, a negative code for shapes this kernel does not handle (the
 * caller then runs another path): -1 shape limits, -2 bad lengths, -3 no memory. */
static int paged_attention(const void *query, const void *key_cache, const void *value_cache,
                           void *out, const int32_t *block_tables,
                           const int32_t *query_start_loc, const int32_t *seq_lens,
                           int num_seqs, int num_tokens, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks, float scale,
                           int window, float soft_cap, int num_threads, int is_bf16) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 8 || block_size > MAX_BLOCK
            || num_heads > MAX_HEADS || num_kv_heads < 1 || num_heads % num_kv_heads
            || window < 0 || !(soft_cap >= 0.f))
        return -1;
    const int group = num_heads / num_kv_heads;
    const int tile = group >= TILE_ROWS ? 1 : TILE_ROWS / group;  /* positions per item */
    if (num_seqs < 0 || chunk_start(query_start_loc, 0) < 0
            || chunk_start(query_start_loc, num_seqs) > num_tokens)
        return -2;
    int64_t num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int qlen = chunk_start(query_start_loc, s + 1) - chunk_start(query_start_loc, s);
        if (qlen < 0 || seq_lens[s] < qlen || seq_lens[s] > max_blocks * block_size) return -2;
        if (qlen > 0 && seq_lens[s] < 1) return -2;
        num_items += (qlen + tile - 1) / tile;
    }
    /* Each item: a sequence and the first query row of its tile (within the chunk). */
    int32_t *items = malloc((size_t)(num_items > 0 ? num_items : 1) * 2 * sizeof(int32_t));
    if (!items) return -3;
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int qlen = chunk_start(query_start_loc, s + 1) - chunk_start(query_start_loc, s);
        /* Last tiles first: they see the most keys, so the dynamic schedule ends even. */
        for (int j = ((qlen + tile - 1) / tile - 1) * tile; j >= 0; j -= tile) {
            items[2 * k] = s;
            items[2 * k + 1] = j;
            k++;
        }
    }
    const attn_t job = {query, key_cache, value_cache, out, block_tables, seq_lens,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, window,
                        scale, soft_cap};
    /* One sequence's decode (a single stream) runs on this thread: waking the pool for
     * it cost more than its attention (decode_attention.c). */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (num_items > 1)
    for (int64_t i = 0; i < num_items; i++) {
        const int s = items[2 * i], j = items[2 * i + 1];
        const int qlen = chunk_start(query_start_loc, s + 1) - chunk_start(query_start_loc, s);
        const int num_pos = qlen - j < tile ? qlen - j : tile;
        (is_bf16 ? run_tile_bf16 : run_tile)(&job, s, chunk_start(query_start_loc, s) + j,
                                             seq_lens[s] - qlen + j, num_pos);
    }
    free(items);
    return 0;
}

int paged_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                        float *out, const int32_t *block_tables,
                        const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
                        int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale, int window,
                        float soft_cap, int num_threads) {
    return paged_attention(query, key_cache, value_cache, out, block_tables, query_start_loc,
                           seq_lens, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                           block_size, max_blocks, scale, window, soft_cap, num_threads, 0);
}

/* query/caches/out bf16 (uint16_t bits), the same arguments otherwise. */
int paged_attention_bf16(const uint16_t *query, const uint16_t *key_cache,
                         const uint16_t *value_cache, uint16_t *out,
                         const int32_t *block_tables, const int32_t *query_start_loc,
                         const int32_t *seq_lens, int num_seqs, int num_tokens, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, int max_blocks,
                         float scale, int window, float soft_cap, int num_threads) {
    return paged_attention(query, key_cache, value_cache, out, block_tables, query_start_loc,
                           seq_lens, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim,
                           block_size, max_blocks, scale, window, soft_cap, num_threads, 1);
}
