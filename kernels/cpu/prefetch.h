/* Software prefetch for the row kernels that stream W once per call (a decode step's
 * matmuls at one or a few rows: linear_f32.c, linear_bf16.c, and linear_quant.c's GGUF
 * rows, which fetch whole rows ahead in a burst).
 *
 * Why: those kernels read four rows of W side by side, four streams a core, and the
 * hardware prefetchers alone kept only ~10 GB/s in flight per core on a 2-core Zen 4
 * EPYC (19 GB/s at 2 threads over SmolLM2's layers at bf16, where a plain sequential
 * read gets 26-32). Asking for each line ROW_PREFETCH_AHEAD rows ahead, into L2
 * (prefetcht1), took the same pass to 31.5 GB/s (1.68x); into L1 (prefetcht0) it gained
 * only 5-10%, and 16 rows ahead was no better than 8. A prefetch never faults, so
 * addresses past the end of W are harmless.
 */
#ifndef TLE_PREFETCH_H
#define TLE_PREFETCH_H

#define ROW_PREFETCH_AHEAD 8

static inline void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

#endif
