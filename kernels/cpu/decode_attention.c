/* Paged decode attention for the CPU: one query token per sequence, K/V read in place
 * through the block table (no gathered copy), online softmax in float32.
 *
 * Work item = (sequence, KV head): the `group` query heads that share a KV head are
 * scored together, so every K/V row is loaded once per item. Items are spread over
 * OpenMP threads. libgomp's soname matches the copy torch ships, so the loader reuses
 * torch's runtime and thread pool instead of starting a second one that would fight
 * it for the cores.
 *
 * Layouts (docs/CONTRACTS.md): query/out [S, H, D]; caches [blocks, block_size, KVH, D];
 * block_tables [S, max_blocks] int32; seq_lens [S] int32. dtype: bf16 (1) or fp32 (0).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

typedef struct {
    const void *query, *key_cache, *value_cache;
    void *out;
    const int32_t *block_tables, *seq_lens;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16;
    float scale;
} job_t;

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    /* round to nearest even, as torch does */
    return (uint16_t)((x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16);
}

static inline void load_row(const void *base, int64_t offset, int is_bf16, int n, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

/* Inlined with a constant head_dim by run_item so the inner loops unroll into a few
 * vector instructions and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void run_item_d(const job_t *job, int64_t item,
                                                             const int d) {
    const int kvh = job->num_kv_heads, bs = job->block_size;
    const int group = job->num_heads / kvh;
    const int64_t seq = item / kvh;
    const int kv_head = (int)(item % kvh);
    const int len = job->seq_lens[seq];
    const int32_t *table = job->block_tables + seq * job->max_blocks;

    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    float k[MAX_HEAD_DIM], v[MAX_HEAD_DIM], scores[MAX_GROUP][128];
    for (int g = 0; g < group; g++) {
        int64_t head = (int64_t)kv_head * group + g;
        load_row(job->query, (seq * job->num_heads + head) * d, job->is_bf16, d, q[g]);
        for (int i = 0; i < d; i++) { q[g][i] *= job->scale; acc[g][i] = 0.f; }
        row_max[g] = -1e30f;  /* finite, so the build may use fast-math */
        row_sum[g] = 0.f;
    }
    for (int start = 0; start < len; start += bs) {
        const int n = (len - start < bs) ? len - start : bs;
        const int64_t block = table[start / bs];
        const int64_t row0 = (block * bs * kvh + kv_head) * d;  /* token 0 of this block */
        for (int t = 0; t < n; t++) {
            load_row(job->key_cache, row0 + (int64_t)t * kvh * d, job->is_bf16, d, k);
            for (int g = 0; g < group; g++) {
                float s = 0.f;
                for (int i = 0; i < d; i++) s += q[g][i] * k[i];
                scores[g][t] = s;
            }
        }
        for (int g = 0; g < group; g++) {
            float m = row_max[g];
            for (int t = 0; t < n; t++) m = scores[g][t] > m ? scores[g][t] : m;
            const float correction = expf(row_max[g] - m);
            float sum = row_sum[g] * correction;
            for (int t = 0; t < n; t++) { scores[g][t] = expf(scores[g][t] - m); sum += scores[g][t]; }
            row_max[g] = m;
            row_sum[g] = sum;
            for (int i = 0; i < d; i++) acc[g][i] *= correction;
        }
        for (int t = 0; t < n; t++) {
            load_row(job->value_cache, row0 + (int64_t)t * kvh * d, job->is_bf16, d, v);
            for (int g = 0; g < group; g++) {
                const float p = scores[g][t];
                for (int i = 0; i < d; i++) acc[g][i] += p * v[i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.f / row_sum[g];
        const int64_t head = (int64_t)kv_head * group + g;
        const int64_t offset = (seq * job->num_heads + head) * d;
        if (job->is_bf16) {
            uint16_t *dst = (uint16_t *)job->out + offset;
            for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[g][i] * inv);
        } else {
            float *dst = (float *)job->out + offset;
            for (int i = 0; i < d; i++) dst[i] = acc[g][i] * inv;
        }
    }
}

static void run_item(const job_t *job, int64_t item) {
    switch (job->head_dim) {
        case 64: run_item_d(job, item, 64); break;
        case 128: run_item_d(job, item, 128); break;
        default: run_item_d(job, item, job->head_dim);
    }
}

/* Returns 0 on success, a negative code for shapes this kernel does not handle. */
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           void *out, const int32_t *block_tables, const int32_t *seq_lens,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16,
                           int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads / num_kv_heads > MAX_GROUP || block_size > 128)
        return -1;
    const job_t job = {query, key_cache, value_cache, out, block_tables, seq_lens, num_heads,
                       num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale};
    const int64_t items = (int64_t)num_seqs * num_kv_heads;
    /* Dynamic chunks: sequences have very different lengths. */
    #pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t item = 0; item < items; item++) run_item(&job, item);
    return 0;
}
