/* One decode step of one sequence through every decoder layer, in one call from Python.
 *
 * A single stream's token runs ~10 small kernels a layer; called one by one from Python
 * each costs 6-12 us of argument checks, ctypes conversion and tensor allocation, ~4 ms
 * of a 12 ms token on SmolLM2 (30 layers, 2-core AVX2 EPYC), a third of the step. Here
 * the same kernels run in the same order on the same inputs, so the result is bit-equal
 * to the layer-by-layer path (engine/models/llama.py, gemma.py), which stays the
 * reference and serves every other case (batches, prefill, GPUs).
 *
 * Activations are float32 or bf16 (the model's dtype, one for the whole step); each
 * matmul is dense in that dtype, GEMM panels in that dtype or GGUF blocks (decode_step.h's
 * run_linear). The caller keeps the descriptors and the scratch buffer.
 *
 * Beyond Llama's layer: per-head RMSNorms of q and k before RoPE (Qwen3, Gemma 3), run as
 * the layer path runs them (the norm over the heads as rows); each layer's own sliding
 * window (Mistral, Phi-3, windowed Qwen, Gemma), through the decode kernel's windowed
 * entry point, which never reads block-table entries wholly behind the window; its own
 * RoPE tables (Gemma 3's local layers) and logit soft cap (Gemma 2); its own KV group
 * (the KV manager's groups of full and windowed layers each keep their own block table
 * and slot); and Gemma's layer: (1 + w) norms, a post-norm on each branch's output before
 * it joins the residual stream, and GeGLU with tanh GELU.
 *
 * Rows: a step takes T >= 1 tokens of the one sequence at consecutive positions (a
 * speculative verification: the last token and k drafts), row t at position p0 + t, its
 * K/V at slot t of each KV group, attending causally to the context up to itself. Every
 * kernel runs once over the T rows, and each computes a row as it computes a lone row:
 * the norms, RoPE, activations and KV writes loop rows independently; the attention runs
 * one work item per row (each row its own seq_len, every row reading the sequence's one
 * block-table row); the dense row kernels (linear_f32_rows, linear_bf16_rows) and the
 * panel GEMMs (gemm_f32, gemm_bf16: one chain of FMAs / vdpbf16ps over k per output,
 * whichever rows share its tile) are M-independent by construction; GGUF blocks run
 * linear_gguf_rows, one row's arithmetic for every row (linear_gguf's multi-row tiles
 * round differently), and their VNNI panels are M-independent already. So row t of a
 * T-row step is bit-equal to the one-row step of that token after rows 0..t-1 were
 * decoded one at a time, K/V cache included, for every weight format and both dtypes
 * (tests/engine/models/test_single_decode_rows.py): greedy speculative decoding of one
 * stream yields plain decoding's tokens exactly. T = 1 is the plain decode step. (A
 * T-row step is not bit-equal to the layer-by-layer path at T rows, which may pick
 * multi-row kernels: AMX tiles, linear_gguf's tiles. Over bf16 panels on AMX hosts those
 * tiles win past ~5 rows, so there the plan takes at most AMX_PANEL_ROWS rows and longer
 * verifications keep the layer path: decode_step.py.)
 */
#include <stdint.h>
#include <string.h>

#include "decode_step.h"

/* The most rows a step takes (its seq_lens live on the stack). */
#define MAX_ROWS 64

/* Field order and types must match kernels/cpu/decode_step.py. */
typedef struct {
    linear_t qkv, o, gate_up, down;
    const void *input_norm, *post_norm;     /* Gemma: post_norm is the post-attention one */
    const void *pre_ff_norm, *post_ff_norm; /* Gemma's MLP norms, else NULL */
    void *key_cache, *value_cache;
    const void *q_norm, *k_norm;  /* [head_dim] each, or both NULL: no q/k norm */
    const void *cos_table, *sin_table;  /* this layer's RoPE, [max_pos, rot_half] each */
    int64_t window;               /* keys a row sees (itself included), 0: all */
    int64_t group;                /* its KV group: which of the step's tables and slots */
    double soft_cap;              /* attention logits -> cap * tanh(logit / cap), 0: off */
} layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, rot_half, inter;
    int64_t block_size;
    int64_t is_bf16;       /* activations, norms, rope tables and KV cache: bf16, else float32 */
    int64_t gemma;         /* Gemma's layer (above), else Llama's */
    double eps, scale;
    double qk_eps;         /* the q/k norms' epsilon (layers that have them) */
    const void *final_norm;
    const layer_t *layers;
} model_t;

/* One KV group's part of a step. */
typedef struct {
    const int32_t *block_table;  /* the sequence's row of the group's block table */
    const int64_t *slots;        /* [rows]: where each row's K/V go */
} kv_group_t;

/* residual += x (when x is not NULL), out = norm(residual), over `rows` rows of `width`:
 * the model's RMSNorm (Gemma's (1 + w) one, or Llama's). With x NULL residual is only
 * read, so a read-only row may stand there. */
static void norm(const model_t *m, const void *x, const void *residual, const void *weight,
                 void *out, int64_t rows, int64_t width, float eps, int num_threads) {
    void *res = (void *)residual;
    if (m->is_bf16 && m->gemma)
        gemma_rms_norm_bf16(x, res, weight, out, rows, width, eps, num_threads);
    else if (m->is_bf16)
        add_rms_norm_bf16(x, res, weight, out, rows, width, eps, num_threads);
    else if (m->gemma)
        gemma_rms_norm_f32(x, res, weight, out, rows, width, eps, num_threads);
    else
        add_rms_norm_f32(x, res, weight, out, rows, width, eps, num_threads);
}

static void activation(const model_t *m, const void *gate_up, void *out, int64_t rows,
                       int num_threads) {
    if (m->is_bf16 && m->gemma) gelu_tanh_mul_bf16(gate_up, out, rows, m->inter, num_threads);
    else if (m->is_bf16) silu_mul_bf16(gate_up, out, rows, m->inter, num_threads);
    else if (m->gemma) gelu_tanh_mul_f32(gate_up, out, rows, m->inter, num_threads);
    else silu_mul_f32(gate_up, out, rows, m->inter, num_threads);
}

/* A row's share of the scratch; a step of T rows needs T times it. */
int64_t decode_step_scratch_floats(const model_t *m) {
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    /* twice (heads + kv_heads) * head_dim: the rotated q and k, and q|k after their norms */
    return 4 * m->hidden + qkv + 2 * (m->num_heads + m->num_kv_heads) * m->head_dim
           + m->num_heads * m->head_dim + 3 * m->inter;
}

/* The attention of one layer over `rows` rows, from their qkv projections to the heads'
 * outputs in attn: q/k norms, RoPE, the rows' K/V into the group's slots, paged decode
 * attention (row t with seq_lens[t]). query [rows, heads * dim], key [rows, kv_heads * dim]
 * and normed_qk [rows, (heads + kv_heads) * dim] are scratch. */
static int attend(const model_t *m, const layer_t *layer, const kv_group_t *group,
                  int64_t rows, const int64_t *positions, const int32_t *seq_lens, char *qkv,
                  char *query, char *key, char *normed_qk, char *attn, int num_threads) {
    const int bf16 = m->is_bf16 != 0;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t heads = m->num_heads, kv_heads = m->num_kv_heads, dim = m->head_dim;
    const int64_t qkv_width = (heads + 2 * kv_heads) * dim;
    /* q and k rotated into their own packed rows; v read in place from the projection */
    const char *value = qkv + (heads + kv_heads) * dim * elem;
    const char *rope_in = qkv;
    int64_t rope_stride = qkv_width;
    if (layer->q_norm != NULL) {
        /* The layer path's _normed_qk: per row, one norm call over the q heads as rows, one
         * over the k heads, into a packed q|k row that RoPE then reads. */
        const float qk_eps = (float)m->qk_eps;
        const int64_t width = (heads + kv_heads) * dim;
        for (int64_t t = 0; t < rows; t++) {
            const char *in = qkv + t * qkv_width * elem;
            char *normed = normed_qk + t * width * elem;
            norm(m, NULL, in, layer->q_norm, normed, heads, dim, qk_eps, num_threads);
            norm(m, NULL, in + heads * dim * elem, layer->k_norm, normed + heads * dim * elem,
                 kv_heads, dim, qk_eps, num_threads);
        }
        rope_in = normed_qk;
        rope_stride = width;
    }
    /* RoPE is per head and element, so q and k rotated apart equal them rotated together. */
    const char *k_in = rope_in + heads * dim * elem;
    if (bf16) {
        rope_bf16((const uint16_t *)rope_in, rope_stride, rows, heads, dim, m->rot_half,
                  positions, layer->cos_table, layer->sin_table, (uint16_t *)query, num_threads);
        rope_bf16((const uint16_t *)k_in, rope_stride, rows, kv_heads, dim, m->rot_half,
                  positions, layer->cos_table, layer->sin_table, (uint16_t *)key, num_threads);
        reshape_and_cache_16((const uint16_t *)key, kv_heads * dim, (const uint16_t *)value,
                             qkv_width, layer->key_cache, layer->value_cache, group->slots,
                             rows, kv_heads * dim, num_threads);
    } else {
        rope_f32((const float *)rope_in, rope_stride, rows, heads, dim, m->rot_half, positions,
                 layer->cos_table, layer->sin_table, (float *)query, num_threads);
        rope_f32((const float *)k_in, rope_stride, rows, kv_heads, dim, m->rot_half, positions,
                 layer->cos_table, layer->sin_table, (float *)key, num_threads);
        reshape_and_cache_32((const uint32_t *)key, kv_heads * dim, (const uint32_t *)value,
                             qkv_width, layer->key_cache, layer->value_cache, group->slots,
                             rows, kv_heads * dim, num_threads);
    }
    /* The kernel reads row t's table at block_table + t * max_blocks (a stride, nothing
     * else): 0 gives every row the sequence's one row. */
    return paged_decode_attention_windowed(
        query, layer->key_cache, layer->value_cache, attn, group->block_table, seq_lens,
        (int)rows, (int)heads, (int)kv_heads, (int)dim, (int)m->block_size, 0, (float)m->scale,
        (int)layer->window, (float)layer->soft_cap, bf16, num_threads);
}

/* x: the rows' embeddings [rows, hidden] (Gemma's already scaled); out: the final norm's
 * outputs [rows, hidden], both in the step's dtype. Row t is the token at positions[t],
 * consecutive (positions[t] = positions[0] + t), and seq_len counts the context up to and
 * including row 0 (row t attends over seq_len + t keys). groups: one entry per KV group
 * (layer_t.group indexes it), each with a slot per row. scratch holds rows *
 * decode_step_scratch_floats(m) floats. Returns 0, -3 for rows outside 1..MAX_ROWS, or a
 * kernel's error code (nothing is left half-done that a rerun of the layer-by-layer path
 * would not redo identically: the K/V written so far are the same values). */
int decode_step_rows(const model_t *m, const void *x, void *out, void *scratch, int64_t rows,
                     const int64_t *positions, const kv_group_t *groups, int32_t seq_len,
                     int num_threads) {
    if (rows < 1 || rows > MAX_ROWS) return -3;
    int32_t seq_lens[MAX_ROWS];
    for (int64_t t = 0; t < rows; t++) seq_lens[t] = seq_len + (int32_t)t;
    const size_t elem = m->is_bf16 ? 2 : 4;
    const int64_t hidden = m->hidden, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int64_t dim = m->head_dim, qkv_width = (heads + 2 * kv_heads) * dim;
    const float eps = (float)m->eps;
    const size_t r = (size_t)rows * elem;  /* bytes of one element in every row */
    char *residual = scratch, *normed = residual + hidden * r;
    char *layer_out = normed + hidden * r, *branch = layer_out + hidden * r;
    char *qkv = branch + hidden * r, *query = qkv + qkv_width * r;
    char *key = query + heads * dim * r, *attn = key + kv_heads * dim * r;
    char *gate_up = attn + heads * dim * r;
    char *act = gate_up + 2 * m->inter * r, *normed_qk = act + m->inter * r;
    memcpy(residual, x, (size_t)hidden * r);
    const void *layer_in = NULL;  /* the first layer's residual is the embedding itself */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer_t *layer = &m->layers[l];
        int status;
        norm(m, layer_in, residual, layer->input_norm, normed, rows, hidden, eps, num_threads);
        if ((status = run_linear(&layer->qkv, normed, qkv, rows, m->is_bf16, num_threads)) != 0)
            return status;
        status = attend(m, layer, &groups[layer->group], rows, positions, seq_lens, qkv,
                        query, key, normed_qk, attn, num_threads);
        if (status != 0) return status;
        if ((status = run_linear(&layer->o, attn, layer_out, rows, m->is_bf16, num_threads)) != 0)
            return status;
        if (m->gemma) {  /* the attention branch is normed before it joins the stream */
            norm(m, NULL, layer_out, layer->post_norm, branch, rows, hidden, eps, num_threads);
            norm(m, branch, residual, layer->pre_ff_norm, normed, rows, hidden, eps, num_threads);
        } else {
            norm(m, layer_out, residual, layer->post_norm, normed, rows, hidden, eps,
                 num_threads);
        }
        status = run_linear(&layer->gate_up, normed, gate_up, rows, m->is_bf16, num_threads);
        if (status != 0) return status;
        activation(m, gate_up, act, rows, num_threads);
        if ((status = run_linear(&layer->down, act, layer_out, rows, m->is_bf16, num_threads)) != 0)
            return status;
        layer_in = layer_out;
        if (m->gemma) {  /* and so is the MLP's; the next norm adds it to the stream */
            norm(m, NULL, layer_out, layer->post_ff_norm, branch, rows, hidden, eps,
                 num_threads);
            layer_in = branch;
        }
    }
    norm(m, layer_in, residual, m->final_norm, out, rows, hidden, eps, num_threads);
    return 0;
}
