/* Causal attention of bf16 prefill chunks on AMX tiles (flash attention: blocks of keys,
 * online softmax), every chunk of a step in one call, K/V read through the block table.
 *
 * Why: on AMX hosts bf16 chunks past a few thousand query x key pairs went to torch's SDPA
 * one sequence at a time (kernels.dispatch), 111-160 GFLOP/s at one thread for 128-512-
 * token prompts: 229 ms of a ~1,950-token prefill step of SmolLM2 (2-core Sapphire
 * Rapids). Here QK^T and PV are tile dot products, and the softmax between them, which
 * costs more than both at head_dim 64, runs lane-wise on AVX-512.
 *
 * A work item is a sequence, a KV head and 16 query rows (positions x the heads of the
 * group: lane r = position r / group, head r % group), and everything is transposed so
 * that the 16 rows are the 16 lanes of a vector: S^T = K Q^T, with A tiles of 16 keys x 32
 * dims loaded in place from the cache (block_size a multiple of 16) and Q^T packed once
 * an item as B tiles; per key the scores of the 16 rows are one vector, so the running
 * max, exp and sum are vertical operations, no reduction across lanes. Then O^T += V^T P^T:
 * P^T rounded to bf16 as pairs of keys is the B tile, V^T the A tiles, packed once a call
 * per chunk and KV head as [context / 64][head_dim][64] (rows 128 bytes apart; a V^T row
 * per dim of the whole context put a 2,048-token context's tile rows on few L1 sets).
 * Keys go in blocks of BLOCK_KEYS from position 0 up to the item's last position.
 *
 * A row's arithmetic depends on its position and the context alone: blocks start at key
 * 0 whatever the chunk, and a block past the row's position adds exact zeros, so its bits
 * do not depend on the chunking, on which rows share its tile or on the thread count.
 *
 * Sliding window W (0: none): the row at position p sees keys p - W + 1 .. p. An item's
 * key blocks start at the one holding its first row's lowest key, and neither K (16-key
 * groups) nor V (the pack) is read where a whole cache block lies before every query's
 * window: such blocks may be freed, their entries naming a placeholder of garbage. Soft
 * cap (0: none): each scaled score s becomes cap * tanh(s / cap) before the softmax.
 *
 * Layouts (docs/CONTRACTS.md): query/out [T, H, D] bf16; caches [blocks, block_size,
 * KVH, D] bf16; block_tables [S, max_blocks] int32. Chunk s: query rows
 * chunk_starts[s] .. + chunk_lens[s], the last chunk_lens[s] of its seq_lens[s] positions.
 *
 * Over 300 lines: AMX tile set-up, the Q.K and P.V tile loops and the online softmax
 * between them are one kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) \
    && defined(__AVX512BW__)
#define ATTN_AMX 1
#include "amx.h"
#else
#define ATTN_AMX 0
#endif

enum { ROWS = 16, BLOCK_KEYS = 64, TILE_K = 32, MAX_HEAD_DIM = 256, PACK_KEYS = 256 };

/* 1 when this build carries the kernel (compiled for AMX-BF16 and AVX-512 BF16). */
int prefill_attention_amx_built(void) { return ATTN_AMX; }

#if ATTN_AMX
typedef struct {
    const uint16_t *query, *key_cache, *value_cache;
    uint16_t *out;
    const int32_t *block_tables, *chunk_starts, *chunk_lens, *seq_lens;
    const int64_t *packed;  /* per chunk: the offset of its V^T pack in vt */
    uint16_t *vt;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale, soft_cap;
} job_t;

static inline int64_t padded(int64_t n) { return (n + BLOCK_KEYS - 1) / BLOCK_KEYS * BLOCK_KEYS; }

/* The lowest key the row at `pos` sees (0 without a window). */
static inline int lowest_key(int window, int pos) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* Chunk s's lowest key (its first row's), and the first key of its V^T pack: that one
 * rounded down to BLOCK_KEYS, so pack blocks line up with the items' key blocks. */
static inline int chunk_lowest(const job_t *job, int s) {
    return lowest_key(job->window, job->seq_lens[s] - job->chunk_lens[s]);
}
static inline int64_t pack_base(const job_t *job, int s) {
    return chunk_lowest(job, s) / BLOCK_KEYS * BLOCK_KEYS;
}

/* V^T of chunk s, KV head h, keys k0 .. k1 - 1 (k0 a multiple of BLOCK_KEYS) into its
 * pack [context / 64][head_dim][64] from pack_base (the pads past seq_len and before the
 * chunk's lowest key stay zero from the caller's calloc: P is 0 there, and 0 x a stale
 * cache value could be NaN). */
static void pack_v(const job_t *job, int s, int h, int64_t k0, int64_t k1) {
    const int d = job->head_dim, bs = job->block_size, kvh = job->num_kv_heads;
    const int64_t base = pack_base(job, s), ctx = padded(job->seq_lens[s]) - base;
    const int32_t *table = job->block_tables + (int64_t)s * job->max_blocks;
    uint16_t *vt = job->vt + job->packed[s] + (int64_t)h * ctx * d;
    const int64_t lowest = chunk_lowest(job, s);
    for (int64_t n = k0 > lowest ? k0 : lowest; n < k1; n++) {
        const int64_t row = ((int64_t)table[n / bs] * bs + n % bs) * kvh + h;
        const uint16_t *v = job->value_cache + row * d;
        uint16_t *dst = vt + ((n - base) / BLOCK_KEYS) * d * BLOCK_KEYS + n % BLOCK_KEYS;
        for (int c = 0; c < d; c++) dst[c * BLOCK_KEYS] = v[c];
    }
}

/* 2^x for x <= 0: 2^n * 2^f with f in [-1/2, 1/2], 2^f by the Taylor series of
 * exp(f ln 2) to the 5th power (relative error under 2e-6; P is then rounded to bf16).
 * Very negative x (masked scores, the first block's old max) gives exactly 0. */
static inline __m512 exp2_512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-03f);               /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* cap * tanh(s / cap) = cap * sign(s) (1 - e) / (1 + e), e = exp(-2 |s| / cap) <= 1 (so
 * exp2_512's range; it gives 0 for huge |s|, where tanh is 1). Absolute error ~1e-6 of
 * cap in the logit; P is then rounded to bf16. */
static inline __m512 soft_cap_512(__m512 s, __m512 cap, __m512 minus_two_log2e_over_cap) {
    const __m512 sign = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32((int)0x80000000u)));
    const __m512 e = exp2_512(_mm512_mul_ps(_mm512_abs_ps(s), minus_two_log2e_over_cap));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(cap, _mm512_or_ps(t, sign));
}

/* One work item: chunk s, KV head h, the positions first .. first + num_pos - 1 (query
 * rows from row0), as the 16 lanes of every vector below (lane r = position r / group,
 * head r % group). Everything is transposed so that a row's softmax is lane-wise:
 * S^T = K Q^T (A tiles: 16 keys x 32 dims read in place from the cache; B tile: Q^T
 * packed as pairs of dims), and O^T = V^T P^T (A: the V^T pack; B: P^T as pairs of keys).
 * d a multiple of 64 (the tiles take 64 dims of O^T at a time). */
static void attend(const job_t *job, int s, int h, int row0, int first, int num_pos) {
    const int d = job->head_dim, heads = job->num_heads, kvh = job->num_kv_heads;
    const int group = heads / kvh, rows = num_pos * group, last = first + num_pos - 1;
    const int bs = job->block_size;
    const int64_t base = pack_base(job, s), ctx = padded(job->seq_lens[s]) - base;
    const int32_t *table = job->block_tables + (int64_t)s * job->max_blocks;
    const uint16_t *vt = job->vt + job->packed[s] + (int64_t)h * ctx * d;
    const int window = job->window, low_first = lowest_key(window, first);
    /* Q^T as B tiles: [d/2][16 lanes][2]. */
    uint16_t qt[MAX_HEAD_DIM / 2][ROWS][2] __attribute__((aligned(64)));
    /* P^T as B tiles: [64 keys / 2][16 lanes][2]. */
    uint16_t pt[BLOCK_KEYS / 2][ROWS][2] __attribute__((aligned(64)));
    float ot[MAX_HEAD_DIM][ROWS] __attribute__((aligned(64)));  /* O^T */
    float st[BLOCK_KEYS][ROWS] __attribute__((aligned(64)));    /* S^T */
    static const uint16_t zeros[32] __attribute__((aligned(64)));
    int32_t pos[ROWS] __attribute__((aligned(64))), low[ROWS] __attribute__((aligned(64)));
    const uint16_t *qrow[ROWS];
    for (int r = 0; r < ROWS; r++) {
        /* A pad lane (past the item's rows) is masked near the diagonal and never
         * written out; what it sums elsewhere is unused. */
        pos[r] = r < rows ? first + r / group : -1;
        low[r] = lowest_key(window, pos[r] > 0 ? pos[r] : 0);
        qrow[r] = job->query + ((int64_t)(row0 + r / group) * heads + h * group + r % group) * d;
    }
    /* Q^T: pairs of dims move as 32-bit words, 16 x 16 at a time. */
    for (int i0 = 0; i0 < d / 2; i0 += 16) {
        __m512i v[16];
        for (int r = 0; r < ROWS; r++)
            v[r] = r < rows ? _mm512_loadu_si512(qrow[r] + 2 * i0) : _mm512_setzero_si512();
        transpose16(v);
        for (int i = 0; i < 16; i++) _mm512_store_si512(qt[i0 + i], v[i]);
    }
    memset(ot, 0, (size_t)d * sizeof ot[0]);
    const __m512i lane_pos = _mm512_load_si512(pos), lane_low = _mm512_load_si512(low);
    const __m512i pair_order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    /* Scores go to base 2 at once: one multiply, and exp becomes 2^x. */
    const __m512 scale = _mm512_set1_ps(job->scale * 1.44269504088896341f);
    const __m512 lowest = _mm512_set1_ps(-1e30f);  /* finite: the build uses fast-math */
    const int capped = job->soft_cap > 0.f;
    const __m512 raw_scale = _mm512_set1_ps(job->scale), cap = _mm512_set1_ps(job->soft_cap);
    const __m512 cap_exp = _mm512_set1_ps(capped ? -2.f * 1.44269504088896341f / job->soft_cap
                                                 : 0.f);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    __m512 row_max = lowest, row_sum = _mm512_setzero_ps();
    const int64_t k_stride = (int64_t)kvh * d * sizeof(uint16_t);
    /* A block starting before the last row's lowest key holds keys some lanes do not
     * see: it needs the mask (only with a window; without, low_last is 0). */
    const int low_last = lowest_key(window, last);
    for (int k0 = low_first / BLOCK_KEYS * BLOCK_KEYS; k0 <= last; k0 += BLOCK_KEYS) {
        /* A tiles of 16 keys straight from the cache (block_size is a multiple of 16);
         * groups past the item's last position, or wholly before its first row's window,
         * read zeros (their blocks may not exist, or be freed). */
        const uint16_t *krow[4];
        int64_t kst[4];
        for (int g = 0; g < 4; g++) {
            const int n = k0 + 16 * g, used = n <= last && n + 15 >= low_first;
            const int64_t row = ((int64_t)table[used ? n / bs : 0] * bs + n % bs) * kvh + h;
            krow[g] = used ? job->key_cache + row * d : zeros;
            kst[g] = used ? k_stride : 0;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int ks = 0; ks < d / TILE_K; ks++) {
            _tile_loadd(4, &qt[ks * 16][0][0], ROWS * 2 * sizeof(uint16_t));
            _tile_loadd(6, krow[0] + (kst[0] ? ks * TILE_K : 0), kst[0]);
            _tile_loadd(7, krow[1] + (kst[1] ? ks * TILE_K : 0), kst[1]);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 7, 4);
            _tile_loadd(6, krow[2] + (kst[2] ? ks * TILE_K : 0), kst[2]);
            _tile_loadd(7, krow[3] + (kst[3] ? ks * TILE_K : 0), kst[3]);
            _tile_dpbf16ps(2, 6, 4);
            _tile_dpbf16ps(3, 7, 4);
        }
        _tile_stored(0, &st[0][0], ROWS * sizeof(float));
        _tile_stored(1, &st[16][0], ROWS * sizeof(float));
        _tile_stored(2, &st[32][0], ROWS * sizeof(float));
        _tile_stored(3, &st[48][0], ROWS * sizeof(float));
        /* Keys a lane does not see: past its position (only near the diagonal), or
         * before its window. */
        const int masked = k0 + BLOCK_KEYS - 1 > first || k0 < low_last;
        __m512 x[BLOCK_KEYS];
        __mmask16 keep[BLOCK_KEYS];
        __m512 m0 = lowest, m1 = lowest;
        const __m512i one = _mm512_set1_epi32(1);
        for (int t = 0; t < BLOCK_KEYS; t += 2) {
            const __m512i key = _mm512_set1_epi32(k0 + t), key1 = _mm512_add_epi32(key, one);
            keep[t] = masked ? _mm512_cmp_epi32_mask(key, lane_pos, _MM_CMPINT_LE)
                                   & _mm512_cmp_epi32_mask(key, lane_low, _MM_CMPINT_NLT)
                             : 0xFFFF;
            keep[t + 1] = masked ? _mm512_cmp_epi32_mask(key1, lane_pos, _MM_CMPINT_LE)
                                       & _mm512_cmp_epi32_mask(key1, lane_low, _MM_CMPINT_NLT)
                                 : 0xFFFF;
            if (capped) {
                const __m512 s0 = soft_cap_512(_mm512_mul_ps(_mm512_load_ps(st[t]), raw_scale),
                                               cap, cap_exp);
                const __m512 s1 = soft_cap_512(
                    _mm512_mul_ps(_mm512_load_ps(st[t + 1]), raw_scale), cap, cap_exp);
                x[t] = _mm512_mask_mul_ps(lowest, keep[t], s0, log2e);
                x[t + 1] = _mm512_mask_mul_ps(lowest, keep[t + 1], s1, log2e);
            } else {
                x[t] = _mm512_mask_mul_ps(lowest, keep[t], _mm512_load_ps(st[t]), scale);
                x[t + 1] = _mm512_mask_mul_ps(lowest, keep[t + 1], _mm512_load_ps(st[t + 1]),
                                              scale);
            }
            m0 = _mm512_max_ps(m0, x[t]);
            m1 = _mm512_max_ps(m1, x[t + 1]);
        }
        const __m512 new_max = _mm512_max_ps(row_max, _mm512_max_ps(m0, m1));
        const __m512 correction = exp2_512(_mm512_sub_ps(row_max, new_max));
        row_max = new_max;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int t = 0; t < BLOCK_KEYS; t += 2) {
            const __m512 e0 = _mm512_maskz_mov_ps(keep[t], exp2_512(_mm512_sub_ps(x[t], new_max)));
            const __m512 e1 = _mm512_maskz_mov_ps(keep[t + 1],
                                                  exp2_512(_mm512_sub_ps(x[t + 1], new_max)));
            s0 = _mm512_add_ps(s0, e0);
            s1 = _mm512_add_ps(s1, e1);
            const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
            _mm512_store_si512(pt[t / 2], _mm512_permutexvar_epi16(pair_order, pair));
        }
        row_sum = _mm512_fmadd_ps(row_sum, correction, _mm512_add_ps(s0, s1));
        /* The first block's correction is 0 on an all-zero O^T; later ones are mostly 1. */
        if (k0 > 0 && _mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
            for (int c = 0; c < d; c++)
                _mm512_store_ps(ot[c], _mm512_mul_ps(_mm512_load_ps(ot[c]), correction));
        const uint16_t *vb = vt + (int64_t)(k0 - base) * d;  /* this block: [d][64] */
        for (int c0 = 0; c0 < d; c0 += 64) {
            _tile_loadd(0, ot[c0], ROWS * sizeof(float));
            _tile_loadd(1, ot[c0 + 16], ROWS * sizeof(float));
            _tile_loadd(2, ot[c0 + 32], ROWS * sizeof(float));
            _tile_loadd(3, ot[c0 + 48], ROWS * sizeof(float));
            for (int kk = 0; kk < BLOCK_KEYS / TILE_K; kk++) {
                const uint16_t *a = vb + (int64_t)c0 * BLOCK_KEYS + kk * TILE_K;
                const int64_t a_stride = BLOCK_KEYS * sizeof(uint16_t);
                _tile_loadd(4, pt[kk * 16], ROWS * 2 * sizeof(uint16_t));
                _tile_loadd(6, a, a_stride);
                _tile_loadd(7, a + 16 * BLOCK_KEYS, a_stride);
                _tile_dpbf16ps(0, 6, 4);
                _tile_dpbf16ps(1, 7, 4);
                _tile_loadd(6, a + 32 * BLOCK_KEYS, a_stride);
                _tile_loadd(7, a + 48 * BLOCK_KEYS, a_stride);
                _tile_dpbf16ps(2, 6, 4);
                _tile_dpbf16ps(3, 7, 4);
            }
            _tile_stored(0, ot[c0], ROWS * sizeof(float));
            _tile_stored(1, ot[c0 + 16], ROWS * sizeof(float));
            _tile_stored(2, ot[c0 + 32], ROWS * sizeof(float));
            _tile_stored(3, ot[c0 + 48], ROWS * sizeof(float));
        }
    }
    /* O = O^T's lanes over their sums, back to rows 16 dims at a time, rounded to bf16. */
    float inv[ROWS] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), row_sum));
    for (int c0 = 0; c0 < d; c0 += 16) {
        __m512i v[16];
        for (int c = 0; c < 16; c++) v[c] = _mm512_load_si512(ot[c0 + c]);
        transpose16(v);
        for (int r = 0; r < rows; r++) {
            const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(v[r]), _mm512_set1_ps(inv[r]));
            uint16_t *dst = job->out + (qrow[r] - job->query) + c0;  /* the row's own place */
            _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}
#endif

/* Returns 0 on success; -1 where the build has no AMX, Linux refused the tile state or a
 * shape is outside the kernel (head_dim not a multiple of 64 or over 256, a group of more
 * than 16 heads, block_size not a multiple of 16); -2 bad lengths; -3 no memory. The
 * caller then runs another path. */
int prefill_attention_amx(const uint16_t *query, const uint16_t *key_cache,
                          const uint16_t *value_cache, uint16_t *out,
                          const int32_t *block_tables, const int32_t *chunk_starts,
                          const int32_t *chunk_lens, const int32_t *seq_lens, int num_chunks,
                          int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                          int block_size, int max_blocks, float scale, int window,
                          float soft_cap, int num_threads) {
#if ATTN_AMX
    if (head_dim % 64 || head_dim > MAX_HEAD_DIM || num_kv_heads < 1
            || num_heads % num_kv_heads || num_heads / num_kv_heads > ROWS
            || block_size < 16 || block_size % 16 || window < 0 || !(soft_cap >= 0.f))
        return -1;
    if (amx_permission() != 0) return -1;
    const int group = num_heads / num_kv_heads, tile = ROWS / group;  /* positions an item */
    int64_t *packed = malloc((size_t)(num_chunks + 1) * sizeof(int64_t));
    if (!packed) return -3;
    int64_t num_items = 0, num_packs = 0, total = 0;
    for (int s = 0; s < num_chunks; s++) {
        const int qlen = chunk_lens[s];
        if (qlen < 0 || chunk_starts[s] < 0 || chunk_starts[s] + qlen > num_tokens
                || seq_lens[s] < qlen || seq_lens[s] > (int64_t)max_blocks * block_size) {
            free(packed);
            return -2;
        }
        const int64_t base = lowest_key(window, seq_lens[s] - qlen) / BLOCK_KEYS * BLOCK_KEYS;
        packed[s] = total;
        total += (padded(seq_lens[s]) - base) * num_kv_heads * head_dim;
        num_items += (int64_t)num_kv_heads * ((qlen + tile - 1) / tile);
        num_packs += (int64_t)num_kv_heads * ((seq_lens[s] - base + PACK_KEYS - 1) / PACK_KEYS);
    }
    uint16_t *vt = calloc((size_t)(total > 0 ? total : 1), sizeof(uint16_t));
    int32_t *items = malloc((size_t)(num_items + num_packs + 1) * 3 * sizeof(int32_t));
    if (!vt || !items) {
        free(vt); free(items); free(packed);
        return -3;
    }
    int32_t *packs = items + 3 * num_items;
    int64_t i = 0, j = 0;
    for (int s = 0; s < num_chunks; s++) {
        const int qlen = chunk_lens[s];
        for (int h = 0; h < num_kv_heads; h++) {
            /* Last tiles first: they see the most keys, so the dynamic schedule ends even. */
            for (int t = ((qlen + tile - 1) / tile - 1) * tile; t >= 0; t -= tile) {
                items[3 * i] = s; items[3 * i + 1] = h; items[3 * i + 2] = t;
                i++;
            }
            /* the pack's keys, in pieces from its base (a multiple of BLOCK_KEYS) */
            const int base = lowest_key(window, seq_lens[s] - qlen) / BLOCK_KEYS * BLOCK_KEYS;
            for (int k0 = base; k0 < seq_lens[s]; k0 += PACK_KEYS) {
                packs[3 * j] = s; packs[3 * j + 1] = h; packs[3 * j + 2] = k0;
                j++;
            }
        }
    }
    const job_t job = {query, key_cache, value_cache, out, block_tables, chunk_starts,
                       chunk_lens, seq_lens, packed, vt, num_heads, num_kv_heads,
                       head_dim, block_size, max_blocks, window, scale, soft_cap};
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads) if (num_items > 1)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_packs; n++) {
            const int s = packs[3 * n], h = packs[3 * n + 1], k0 = packs[3 * n + 2];
            const int k1 = k0 + PACK_KEYS < seq_lens[s] ? k0 + PACK_KEYS : seq_lens[s];
            pack_v(&job, s, h, k0, k1);
        }
        amx_configure_full_tiles();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_items; n++) {
            const int s = items[3 * n], h = items[3 * n + 1], t = items[3 * n + 2];
            const int qlen = chunk_lens[s];
            const int num_pos = qlen - t < tile ? qlen - t : tile;
            attend(&job, s, h, chunk_starts[s] + t, seq_lens[s] - qlen + t, num_pos);
        }
        _tile_release();
    }
    free(items);
    free(vt);
    free(packed);
    return 0;
#else
    (void)query; (void)key_cache; (void)value_cache; (void)out; (void)block_tables;
    (void)chunk_starts; (void)chunk_lens; (void)seq_lens; (void)num_chunks; (void)num_tokens;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)max_blocks;
    (void)scale; (void)window; (void)soft_cap; (void)num_threads;
    return -1;
#endif
}
