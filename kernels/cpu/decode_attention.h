/* Decode attention over the paged KV cache (decode_attention.c): one query row per
 * sequence, K/V read in place through the block table. */
#ifndef TLE_DECODE_ATTENTION_H
#define TLE_DECODE_ATTENTION_H
#include <stdint.h>

int paged_decode_attention_windowed(const void *query, const void *key_cache,
                                    const void *value_cache, void *out,
                                    const int32_t *block_tables, const int32_t *seq_lens,
                                    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, int max_blocks, float scale, int window,
                                    float soft_cap, int is_bf16, int num_threads);
int paged_decode_attention(const void *query, const void *key_cache, const void *value_cache,
                           void *out, const int32_t *block_tables, const int32_t *seq_lens,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int is_bf16,
                           int num_threads);

#endif
