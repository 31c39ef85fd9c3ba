"""What one core of this host retires per second of each multiply-add instruction the CPU
kernels are built on, side by side: float32 FMA at 256 and 512 bits, bf16 pair dot
products (`vdpbf16ps`) and int8 quad dot products (`vpdpbusd`), each as 24 independent
accumulator chains (enough to hide every latency measured so far), on the calling thread.

    PYTHONPATH=. python -m bench.isa_peaks [--iters 20000000] [--rounds 3]

Built with the engine's compile flags for this host (so TLE_CPU_ISA caps it as it caps the
engine); an instruction the build lacks prints '-'. The ratio column is each figure over
the widest float32 FMA's: where `vdpbf16ps` is below 2x, widening bf16 to float32 and using
FMA does as many multiply-adds a cycle, and a capped host stands in badly for one where
it is above (2026-12-06: one Sapphire Rapids core 0.5x, one Zen 4 core 2.0x).
"""
from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

from bench.native_ab import build
from kernels.cpu import features as cpu_features

SOURCE = r"""
#include <immintrin.h>
#include <time.h>
#define CHAINS 24
volatile double sink;
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
/* The body of each function below: CHAINS accumulators of TYPE, each updated by STEP
 * `iters` times; returns the seconds that took. Operands keep every chain finite (x * 1
 * + 1, or sums of ones), so no value turns into an infinity or a denormal. */
#define TIMED(TYPE, START, STEP, FIRST)                                   \
    TYPE acc[CHAINS];                                                     \
    for (int i = 0; i < CHAINS; i++) acc[i] = START;                      \
    const double t = now();                                               \
    for (long n = 0; n < iters; n++) {                                    \
        _Pragma("GCC unroll 24")                                          \
        for (int i = 0; i < CHAINS; i++) acc[i] = STEP;                   \
    }                                                                     \
    const double s = now() - t;                                           \
    for (int i = 0; i < CHAINS; i++) sink += FIRST;                       \
    return s;
/* -1 where the build lacks the instruction */
#define ABSENT (void)iters; return -1;

double fma_256(long iters) {
#if defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    TIMED(__m256, _mm256_set1_ps((float)i), _mm256_fmadd_ps(acc[i], one, one), acc[i][0])
#else
    ABSENT
#endif
}
double fma_512(long iters) {
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    TIMED(__m512, _mm512_set1_ps((float)i), _mm512_fmadd_ps(acc[i], one, one), acc[i][0])
#else
    ABSENT
#endif
}
double dpbf16_512(long iters) {
#if defined(__AVX512BF16__)
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);  /* bf16 1.0 pairs */
    TIMED(__m512, _mm512_set1_ps((float)i), _mm512_dpbf16_ps(acc[i], ones, ones), acc[i][0])
#else
    ABSENT
#endif
}
double dpbusd_512(long iters) {
#if defined(__AVX512VNNI__)
    const __m512i ones = _mm512_set1_epi8(1);
    TIMED(__m512i, _mm512_set1_epi32(i), _mm512_dpbusd_epi32(acc[i], ones, ones),
          _mm512_cvtsi512_si32(acc[i]))
#else
    ABSENT
#endif
}
"""
CHAINS = 24
# name in the C source, label, operations one instruction does (a multiply-add is 2)
INSTRUCTIONS = (("fma_256", "vfmadd231ps ymm (float32)", 8 * 2),
                ("fma_512", "vfmadd231ps zmm (float32)", 16 * 2),
                ("dpbf16_512", "vdpbf16ps zmm (bf16 pairs)", 16 * 2 * 2),
                ("dpbusd_512", "vpdpbusd zmm (int8 quads)", 16 * 4 * 2))


def measure(lib: ctypes.CDLL, iters: int, rounds: int) -> dict[str, float | None]:
    """Each instruction's best rate over `rounds`, in G operations a second (None: not
    built). The instructions alternate within a round, so a slow minute hits them all."""
    for name, _, _ in INSTRUCTIONS:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
    best: dict[str, float | None] = {}
    for _ in range(rounds):
        for name, _, ops in INSTRUCTIONS:
            seconds = getattr(lib, name)(iters)
            rate = None if seconds < 0 else iters * CHAINS * ops / seconds / 1e9
            if rate is not None:
                rate = max(rate, best.get(name) or 0.0)
            best[name] = rate
    return best


def report(rates: dict[str, float | None]) -> list[str]:
    widest = rates.get("fma_512") or rates.get("fma_256")
    lines = []
    for name, label, _ in INSTRUCTIONS:
        rate = rates[name]
        if rate is None:
            lines.append(f"{label:30s} {'-':>9}")
            continue
        unit = "GOP/s" if name == "dpbusd_512" else "GFLOP/s"
        ratio = f"{rate / widest:6.2f}x" if widest else ""
        lines.append(f"{label:30s} {rate:9.1f} {unit:7s} {ratio}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=20_000_000, help="rounds of 24 instructions")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    features = cpu_features.detect()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(SOURCE, Path(tmp), "isa_peaks")
        rates = measure(lib, args.iters, args.rounds)
    print(f"host: {features.describe()}; one core, {CHAINS} independent chains, best of "
          f"{args.rounds}; ratio = rate / the widest float32 FMA's")
    for line in report(rates):
        print(line)


if __name__ == "__main__":
    main()
