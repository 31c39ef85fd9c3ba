/* One decode step of one sequence through every decoder layer, in one call from Python.
 *
 * A single stream's token runs ~10 small kernels a layer; called one by one from Python
 * each costs 6-12 us of argument checks, ctypes conversion and tensor allocation, ~4 ms
 * of a 12 ms token on SmolLM2 (30 layers, 2-core AVX2 EPYC), a third of the step. Here
 * the same kernels run in the same order on the same inputs, so the result is bit-equal
 * to the layer-by-layer path (engine/models/llama.py), which stays the reference and
 * serves every other case (batches, prefill, GPUs).
 *
 * Activations are float32 or bf16 (the model's dtype, one for the whole step); each
 * matmul is dense in that dtype (linear_f32_rows, linear_bf16_rows), GEMM panels in that
 * dtype (gemm_f32, gemm_bf16, where those replace the dense copy) or GGUF blocks
 * (linear_gguf). The caller keeps the descriptors and the scratch buffer.
 *
 * Beyond Llama's layer: per-head RMSNorms of q and k before RoPE (Qwen3), run as the
 * layer path runs them (add_rms_norm over the heads as rows), and each layer's own
 * sliding window (Mistral, Phi-3, windowed Qwen), through the decode kernel's windowed
 * entry point, which never reads block-table entries wholly behind the window.
 */
#include <stdint.h>
#include <string.h>

/* The chained kernels, from the other sources of this library. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads);
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t hidden, float eps, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int num_threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads);
void rope_f32(const float *qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
              int64_t rot_half, const int64_t *positions, const float *cos_table,
              const float *sin_table, float *out, int num_threads);
void rope_bf16(const uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t heads,
               int64_t dim, int64_t rot_half, const int64_t *positions, const uint16_t *cos_table,
               const uint16_t *sin_table, uint16_t *out, int num_threads);
void reshape_and_cache_32(const uint32_t *key, int64_t key_stride, const uint32_t *value,
                          int64_t value_stride, uint32_t *key_cache, uint32_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);
void reshape_and_cache_16(const uint16_t *key, int64_t key_stride, const uint16_t *value,
                          int64_t value_stride, uint16_t *key_cache, uint16_t *value_cache,
                          const int64_t *slots, int64_t tokens, int64_t row, int num_threads);
int paged_decode_attention_windowed(const void *query, const void *key_cache,
                                    const void *value_cache, void *out,
                                    const int32_t *block_tables, const int32_t *seq_lens,
                                    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, int max_blocks, float scale, int window,
                                    float soft_cap, int is_bf16, int num_threads);
int linear_gguf(int type, const uint8_t *qs, const float *d, const float *offset, int64_t n,
                int64_t k, const void *x, int x_bf16, int64_t m, const float *bias, void *y,
                int out_bf16, int num_threads);
void linear_f32_rows(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k, int num_threads);
void gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
              const float *bias, float *y, int num_threads);
int linear_bf16_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int num_threads);
int gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels, int64_t n,
              const uint16_t *bias, uint16_t *y, int num_threads);

#define DENSE_F32 (-1)
#define DENSE_BF16 (-2)
#define PANELS_F32 (-3)
#define PANELS_BF16 (-4)

/* Field order and types must match kernels/cpu/decode_step.py. */
typedef struct {
    int64_t type;          /* DENSE_F32, DENSE_BF16 ([n, k], the step's dtype), PANELS_F32,
                              PANELS_BF16 (gemm_f32's, gemm_bf16's panels), else a GGUF id */
    const void *weight;    /* dense weights, panels, or the GGUF codes */
    const float *scales;   /* GGUF only */
    const float *offsets;  /* GGUF Q4_1 only, else NULL */
    const void *bias;      /* [n] or NULL: the step's dtype, float32 beside GGUF blocks */
    int64_t n, k;
} linear_t;

typedef struct {
    linear_t qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    void *key_cache, *value_cache;
    const void *q_norm, *k_norm;  /* [head_dim] each, or both NULL: no q/k norm */
    int64_t window;               /* keys a row sees (itself included), 0: all */
} layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, rot_half, inter;
    int64_t block_size;
    int64_t is_bf16;       /* activations, norms, rope tables and KV cache: bf16, else float32 */
    double eps, scale;
    double qk_eps;         /* the q/k norms' epsilon (layers that have them) */
    const void *cos_table, *sin_table, *final_norm;
    const layer_t *layers;
} model_t;

static int run_linear(const linear_t *lin, const void *x, void *y, int bf16, int num_threads) {
    if (lin->type == DENSE_F32) {
        linear_f32_rows(x, lin->weight, lin->bias, y, 1, lin->n, lin->k, num_threads);
        return 0;
    }
    if (lin->type == PANELS_F32) {
        gemm_f32(x, 1, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
        return 0;
    }
    if (lin->type == PANELS_BF16)
        return gemm_bf16(x, 1, lin->k, lin->weight, lin->n, lin->bias, y, num_threads);
    if (lin->type == DENSE_BF16)
        return linear_bf16_rows(x, lin->weight, lin->bias, y, 1, lin->n, lin->k, num_threads);
    return linear_gguf((int)lin->type, (const uint8_t *)lin->weight, lin->scales, lin->offsets,
                       lin->n, lin->k, x, bf16, 1, lin->bias, y, bf16, num_threads);
}

static void norm(int bf16, const void *x, void *residual, const void *weight, void *out,
                 int64_t hidden, float eps, int num_threads) {
    if (bf16) add_rms_norm_bf16(x, residual, weight, out, 1, hidden, eps, num_threads);
    else add_rms_norm_f32(x, residual, weight, out, 1, hidden, eps, num_threads);
}

/* rms_norm of each of `rows` rows of x (read only: no residual add) into out. */
static void norm_rows(int bf16, const void *x, const void *weight, void *out, int64_t rows,
                      int64_t width, float eps, int num_threads) {
    if (bf16)
        add_rms_norm_bf16(NULL, (uint16_t *)x, weight, out, rows, width, eps, num_threads);
    else
        add_rms_norm_f32(NULL, (float *)x, weight, out, rows, width, eps, num_threads);
}

int64_t decode_step_scratch_floats(const model_t *m) {
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    /* twice (heads + kv_heads) * head_dim: the rotated q|k, and q|k after their norms */
    return 3 * m->hidden + qkv + 2 * (m->num_heads + m->num_kv_heads) * m->head_dim
           + m->num_heads * m->head_dim + 3 * m->inter;
}

/* x: the token's embedding [hidden]; out: the final norm's output [hidden], both in the
 * step's dtype. scratch holds decode_step_scratch_floats(m) floats. Returns 0, or a
 * kernel's error code (nothing is left half-done that a rerun of the layer-by-layer path
 * would not redo identically: the K/V written so far are the same values). */
int decode_step(const model_t *m, const void *x, void *out, void *scratch, int64_t position,
                int64_t slot, const int32_t *block_table, int32_t max_blocks, int32_t seq_len,
                int num_threads) {
    const int bf16 = m->is_bf16 != 0;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t hidden = m->hidden, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int64_t dim = m->head_dim, qkv_width = (heads + 2 * kv_heads) * dim;
    const float eps = (float)m->eps;
    char *residual = scratch, *normed = residual + hidden * elem;
    char *layer_out = normed + hidden * elem, *qkv = layer_out + hidden * elem;
    char *rotated = qkv + qkv_width * elem, *attn = rotated + (heads + kv_heads) * dim * elem;
    char *gate_up = attn + heads * dim * elem, *act = gate_up + 2 * m->inter * elem;
    char *normed_qk = act + m->inter * elem;
    memcpy(residual, x, (size_t)hidden * elem);
    const void *layer_in = NULL;  /* the first layer's residual is the embedding itself */
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer_t *layer = &m->layers[l];
        int status;
        norm(bf16, layer_in, residual, layer->input_norm, normed, hidden, eps, num_threads);
        if ((status = run_linear(&layer->qkv, normed, qkv, bf16, num_threads)) != 0) return status;
        /* q and k rotated side by side; v read in place from the projection */
        char *value = qkv + (heads + kv_heads) * dim * elem, *key = rotated + heads * dim * elem;
        const char *rope_in = qkv;
        int64_t rope_stride = qkv_width;
        if (layer->q_norm != NULL) {
            /* The layer path's _normed_qk: one norm call over the q heads as rows, one over
             * the k heads, into a packed q|k row that RoPE then reads. */
            const float qk_eps = (float)m->qk_eps;
            norm_rows(bf16, qkv, layer->q_norm, normed_qk, heads, dim, qk_eps, num_threads);
            norm_rows(bf16, qkv + heads * dim * elem, layer->k_norm,
                      normed_qk + heads * dim * elem, kv_heads, dim, qk_eps, num_threads);
            rope_in = normed_qk;
            rope_stride = (heads + kv_heads) * dim;
        }
        if (bf16) {
            rope_bf16((const uint16_t *)rope_in, rope_stride, 1, heads + kv_heads, dim,
                      m->rot_half, &position, m->cos_table, m->sin_table, (uint16_t *)rotated,
                      num_threads);
            reshape_and_cache_16((const uint16_t *)key, (heads + kv_heads) * dim,
                                 (const uint16_t *)value, qkv_width, layer->key_cache,
                                 layer->value_cache, &slot, 1, kv_heads * dim, num_threads);
        } else {
            rope_f32((const float *)rope_in, rope_stride, 1, heads + kv_heads, dim, m->rot_half,
                     &position, m->cos_table, m->sin_table, (float *)rotated, num_threads);
            reshape_and_cache_32((const uint32_t *)key, (heads + kv_heads) * dim,
                                 (const uint32_t *)value, qkv_width, layer->key_cache,
                                 layer->value_cache, &slot, 1, kv_heads * dim, num_threads);
        }
        status = paged_decode_attention_windowed(
            rotated, layer->key_cache, layer->value_cache, attn, block_table, &seq_len, 1,
            (int)heads, (int)kv_heads, (int)dim, (int)m->block_size, max_blocks,
            (float)m->scale, (int)layer->window, 0.f, bf16, num_threads);
        if (status != 0) return status;
        if ((status = run_linear(&layer->o, attn, layer_out, bf16, num_threads)) != 0)
            return status;
        norm(bf16, layer_out, residual, layer->post_norm, normed, hidden, eps, num_threads);
        if ((status = run_linear(&layer->gate_up, normed, gate_up, bf16, num_threads)) != 0)
            return status;
        if (bf16)
            silu_mul_bf16((const uint16_t *)gate_up, (uint16_t *)act, 1, m->inter, num_threads);
        else
            silu_mul_f32((const float *)gate_up, (float *)act, 1, m->inter, num_threads);
        if ((status = run_linear(&layer->down, act, layer_out, bf16, num_threads)) != 0)
            return status;
        layer_in = layer_out;
    }
    norm(bf16, layer_in, residual, m->final_norm, out, hidden, eps, num_threads);
    return 0;
}
