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
 */
#include <stdint.h>
#include <string.h>

#include "decode_step.h"

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
    int64_t max_blocks, slot;    /* that row's width; where this token's K/V go */
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

static void activation(const model_t *m, const void *gate_up, void *out, int num_threads) {
    if (m->is_bf16 && m->gemma) gelu_tanh_mul_bf16(gate_up, out, 1, m->inter, num_threads);
    else if (m->is_bf16) silu_mul_bf16(gate_up, out, 1, m->inter, num_threads);
    else if (m->gemma) gelu_tanh_mul_f32(gate_up, out, 1, m->inter, num_threads);
    else silu_mul_f32(gate_up, out, 1, m->inter, num_threads);
}

int64_t decode_step_scratch_floats(const model_t *m) {
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    /* twice (heads + kv_heads) * head_dim: the rotated q|k, and q|k after their norms */
    return 4 * m->hidden + qkv + 2 * (m->num_heads + m->num_kv_heads) * m->head_dim
           + m->num_heads * m->head_dim + 3 * m->inter;
}

/* The attention of one layer, from its qkv projection to the heads' outputs in attn:
 * q/k norms, RoPE, this token's K/V into the group's slot, paged decode attention.
 * rotated and normed_qk are (heads + kv_heads) * head_dim scratch each. */
static int attend(const model_t *m, const layer_t *layer, const kv_group_t *group,
                  int64_t position, int32_t seq_len, char *qkv, char *rotated, char *normed_qk,
                  char *attn, int num_threads) {
    const int bf16 = m->is_bf16 != 0;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t heads = m->num_heads, kv_heads = m->num_kv_heads, dim = m->head_dim;
    const int64_t qkv_width = (heads + 2 * kv_heads) * dim;
    /* q and k rotated side by side; v read in place from the projection */
    char *value = qkv + (heads + kv_heads) * dim * elem, *key = rotated + heads * dim * elem;
    const char *rope_in = qkv;
    int64_t rope_stride = qkv_width;
    if (layer->q_norm != NULL) {
        /* The layer path's _normed_qk: one norm call over the q heads as rows, one over
         * the k heads, into a packed q|k row that RoPE then reads. */
        const float qk_eps = (float)m->qk_eps;
        norm(m, NULL, qkv, layer->q_norm, normed_qk, heads, dim, qk_eps, num_threads);
        norm(m, NULL, qkv + heads * dim * elem, layer->k_norm, normed_qk + heads * dim * elem,
             kv_heads, dim, qk_eps, num_threads);
        rope_in = normed_qk;
        rope_stride = (heads + kv_heads) * dim;
    }
    if (bf16) {
        rope_bf16((const uint16_t *)rope_in, rope_stride, 1, heads + kv_heads, dim,
                  m->rot_half, &position, layer->cos_table, layer->sin_table,
                  (uint16_t *)rotated, num_threads);
        reshape_and_cache_16((const uint16_t *)key, (heads + kv_heads) * dim,
                             (const uint16_t *)value, qkv_width, layer->key_cache,
                             layer->value_cache, &group->slot, 1, kv_heads * dim, num_threads);
    } else {
        rope_f32((const float *)rope_in, rope_stride, 1, heads + kv_heads, dim, m->rot_half,
                 &position, layer->cos_table, layer->sin_table, (float *)rotated, num_threads);
        reshape_and_cache_32((const uint32_t *)key, (heads + kv_heads) * dim,
                             (const uint32_t *)value, qkv_width, layer->key_cache,
                             layer->value_cache, &group->slot, 1, kv_heads * dim, num_threads);
    }
    return paged_decode_attention_windowed(
        rotated, layer->key_cache, layer->value_cache, attn, group->block_table, &seq_len, 1,
        (int)heads, (int)kv_heads, (int)dim, (int)m->block_size, (int)group->max_blocks,
        (float)m->scale, (int)layer->window, (float)layer->soft_cap, bf16, num_threads);
}

/* x: the token's embedding [hidden] (Gemma's already scaled); out: the final norm's output
 * [hidden], both in the step's dtype. groups: one entry per KV group (layer_t.group
 * indexes it); seq_len counts this token. scratch holds decode_step_scratch_floats(m)
 * floats. Returns 0, or a kernel's error code (nothing is left half-done that a rerun of
 * the layer-by-layer path would not redo identically: the K/V written so far are the same
 * values). */
int decode_step(const model_t *m, const void *x, void *out, void *scratch, int64_t position,
                const kv_group_t *groups, int32_t seq_len, int num_threads) {
    const size_t elem = m->is_bf16 ? 2 : 4;
    const int64_t hidden = m->hidden, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int64_t dim = m->head_dim, qkv_width = (heads + 2 * kv_heads) * dim;
    const float eps = (float)m->eps;
    char *residual = scratch, *normed = residual + hidden * elem;
    char *layer_out = normed + hidden * elem, *branch = layer_out + hidden * elem;
    char *qkv = branch + hidden * elem, *rotated = qkv + qkv_width * elem;
    char *attn = rotated + (heads + kv_heads) * dim * elem, *gate_up = attn + heads * dim * elem;
    char *act = gate_up + 2 * m->inter * elem, *normed_qk = act + m->inter * elem;
    memcpy(residual, x, (size_t)hidden * elem);
    const void *layer_in = NULL;  /* the first layer's residual is the embedding itself */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer_t *layer = &m->layers[l];
        int status;
        norm(m, layer_in, residual, layer->input_norm, normed, 1, hidden, eps, num_threads);
        if ((status = run_linear(&layer->qkv, normed, qkv, m->is_bf16, num_threads)) != 0)
            return status;
        status = attend(m, layer, &groups[layer->group], position, seq_len, qkv, rotated,
                        normed_qk, attn, num_threads);
        if (status != 0) return status;
        if ((status = run_linear(&layer->o, attn, layer_out, m->is_bf16, num_threads)) != 0)
            return status;
        if (m->gemma) {  /* the attention branch is normed before it joins the stream */
            norm(m, NULL, layer_out, layer->post_norm, branch, 1, hidden, eps, num_threads);
            norm(m, branch, residual, layer->pre_ff_norm, normed, 1, hidden, eps, num_threads);
        } else {
            norm(m, layer_out, residual, layer->post_norm, normed, 1, hidden, eps, num_threads);
        }
        if ((status = run_linear(&layer->gate_up, normed, gate_up, m->is_bf16, num_threads)) != 0)
            return status;
        activation(m, gate_up, act, num_threads);
        if ((status = run_linear(&layer->down, act, layer_out, m->is_bf16, num_threads)) != 0)
            return status;
        layer_in = layer_out;
        if (m->gemma) {  /* and so is the MLP's; the next norm adds it to the stream */
            norm(m, NULL, layer_out, layer->post_ff_norm, branch, 1, hidden, eps, num_threads);
            layer_in = branch;
        }
    }
    norm(m, layer_in, residual, m->final_norm, out, 1, hidden, eps, num_threads);
    return 0;
}
