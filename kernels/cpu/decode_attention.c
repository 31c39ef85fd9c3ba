/* Paged decode attention for the CPU: one query token per sequence, K/V read in place
 * through the block table (no gathered copy), online softmax in float32.
 *
 * Work item = one sequence; sequences are spread over OpenMP threads. libgomp's
 * soname matches the copy torch ships, so the loader reuses
 * torch's runtime and thread pool instead of starting a second one that would fight
 * it for the cores.
 *
 * Layouts (docs/CONTRACTS.md): query/out [S, H, D]; caches [blocks, block_size, KVH, D];
 * block_tables [S, max_blocks] int32; seq_lens [S] int32. dtype: bf16 (1) or fp32 (0).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_HEADS 128

typedef struct {
    const void *query, *key_cache, *value_cache;
    void *out;
    const int32_t *block_tables, *seq_lens;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16;
    float scale;
} job_t;

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
    for (int start = 0; start < len; start += bs) {
        const int n = (len - start < bs) ? len - start : bs;
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
        load_row(job->key_cache, base, job->is_bf16, n * row, &kv[0][0]);
        for (int h = 0; h < heads; h++) {
            const float *qh = q[h];
            const int off = (h / group) * d;
            float m = row_max[h];
            for (int t = 0; t < n; t++) {
                float s = 0.f;
                for (int i = 0; i < d; i++) s += qh[i] * kv[t][off + i];
                scores[h][t] = s;
                m = s > m ? s : m;
            }
            /* Nothing to correct on the first block (and expf's underflow path is slow). */
            const float correction = start == 0 ? 0.f : expf(row_max[h] - m);
            float sum = row_sum[h] * correction;
            for (int t = 0; t < n; t++) { scores[h][t] = expf(scores[h][t] - m); sum += scores[h][t]; }
            row_max[h] = m;
            row_sum[h] = sum;
            for (int i = 0; i < d; i++) acc[h][i] *= correction;
        }
        load_row(job->value_cache, base, job->is_bf16, n * row, &kv[0][0]);
        for (int h = 0; h < heads; h++) {
            const int off = (h / group) * d;
            float *ah = acc[h];
            for (int t = 0; t < n; t++) {
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

static void run_item(const job_t *job, int64_t seq) {
    switch (job->head_dim) {
        case 64: run_item_d(job, seq, 64); break;
        case 128: run_item_d(job, seq, 128); break;
        default: run_item_d(job, seq, job->head_dim);
    }
}

/* Returns 0 on success, a negative code for shapes this kernel does not handle. */
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           void *out, const int32_t *block_tables, const int32_t *seq_lens,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16,
                           int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_HEADS || block_size > 128) return -1;
    const job_t job = {query, key_cache, value_cache, out, block_tables, seq_lens, num_heads,
                       num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale};
    /* Dynamic chunks: sequences have very different lengths. One sequence (a single
     * stream) runs on this thread: waking the pool for it cost more than its attention. */
    #pragma omp parallel for schedule(dynamic, 2) num_threads(num_threads < 1 ? 1 : num_threads) \
        if (num_seqs > 1)
    for (int64_t seq = 0; seq < num_seqs; seq++) run_item(&job, seq);
    return 0;
}
