/* The mixture-of-experts op (kernels/torch_moe.py defines it) in one call: every routed
 * token through its experts' gate_up projection, activation and down projection, summed
 * with its routing weights. x, weights and biases are all float32 or all bf16 (float32
 * sums either way), weights dense [E, 2I, H] and [E, H, I] rows.
 *
 * Why: the torch op runs two matmuls per active expert plus gathers and index_adds from
 * Python. At one Qwen3-30B-A3B token (top-8 of 128 experts, 75 MB of bf16 weights) it
 * ran 2.2-8x slower than this kernel, which reads those weights at about a plain read's
 * speed, and 3.4-9x slower at 64 tokens (bench/bench_moe_kernel.py; 1 and 2 threads of
 * a shared 2-core Sapphire Rapids). The layer is a stream over the active experts'
 * weights, so (the code is moe.h's, shared with the MXFP4 kernel, moe_mxfp4.c):
 * - the (token, slot) pairs are grouped by expert here (count, prefix sum, fill in pair
 *   order), and only experts with a pair are read, each weight once per call for all of
 *   its pairs (per token chunk: see CHUNK_BYTES);
 * - threads take (expert, block of outputs) work items, so one token's 8 experts and a
 *   batch's 128 both spread over every core; dynamic scheduling evens out experts that
 *   received more tokens than others;
 * - the inner loop is row_dot.h's 4-row dot product (vdpbf16ps, or widened float32 FMA),
 *   the one the decode-step matmuls stream W with; x rows are read in place through
 *   each pair's token index (no gathered copy), activations and outputs go to per-pair
 *   scratch, and each block of outputs is summed over the slots as soon as its last
 *   expert is done.
 *
 * Rounding follows torch_moe in bf16: h = x W13^T rounded to bf16 (then + bias, rounded
 * again), the activation computed in float32 and rounded once, y = a W2^T rounded (then
 * + bias, rounded), and out = sum over slots j = 0..k-1 in that order of w_j * y_j in
 * float32, rounded at the end. Every value of a pair is one fixed chain of operations
 * that does not depend on the other pairs, so a token's result is the same bits alone or
 * in any batch (the tests check it), though not torch's bits: sums run in another order.
 */
#include <stdint.h>

#include "moe.h"

/* Dense rows are read where they are. */
static const void *dense_rows(const moe_t *m, int down, int64_t e, int64_t r0, int n,
                              void *buf) {
    (void)n, (void)buf;
    const int64_t wsize = m->bf16 ? 2 : 4;
    return down ? (const char *)m->w2 + (e * m->H + r0) * m->I * wsize
                : (const char *)m->w13 + (e * 2 * m->I + r0) * m->H * wsize;
}

/* x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k]
 * int64 (ids_64) or int32, ids outside [0, E) skipped; b13 [E, 2I] / b2 [E, H] or NULL;
 * out [T, H]. All activations, weights and biases bf16 when is_bf16, else float32.
 * Returns 0, or -1 when scratch could not be allocated (nothing written). */
int fused_moe_rows(const void *x, int is_bf16, int64_t T, int64_t H, const void *w13,
                   const void *w2, int64_t E, int64_t I, const float *topk_weights,
                   const void *topk_ids, int ids_64, int64_t k, const void *b13, const void *b2,
                   int activation, float alpha, float limit, void *out, int num_threads) {
    const moe_t m = {.bf16 = is_bf16 != 0, .act = activation, .alpha = alpha, .limit = limit,
                     .H = H, .I = I, .k = k, .w13 = w13, .w2 = w2, .b13 = b13, .b2 = b2,
                     .rows = dense_rows, .w_bf16 = is_bf16 != 0};
    return moe_run(&m, x, T, E, topk_weights, topk_ids, ids_64, out, num_threads);
}
