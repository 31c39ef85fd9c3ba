"""GGUF matmul on AMX tiles (kernels/cpu/linear_gguf_amx.c) against the int8 kernel
(linear_gguf) and a dense bf16 matmul on a oneDNN-prepacked weight, side by side, for
SmolLM2-135M's layer shapes, bf16 activations.

    PYTHONPATH=. python -m bench.bench_gguf_amx [--threads 1 2] [--rows 1 8 16 64 256]

Times are the median of interleaved repeats (the three kernels alternate, so a noisy
neighbour slows them alike); ratios > 1 mean the AMX kernel is faster.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.cpu import features as cpu_features

cpu_features.detect()  # before the first tensor op (the caps reach oneDNN at its first use)

from kernels.cpu import linear as cpu_linear  # noqa: E402
from kernels.cpu import onednn as cpu_onednn  # noqa: E402
from testing.gguf_weights import gguf_weight  # noqa: E402

# (out, in): q/o projection, fused gate_up, down
SHAPES = [(576, 576), (3072, 576), (576, 1536)]


def _time(fn, budget_s: float = 0.05) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / max(calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not cpu_linear.gguf_amx_available():
        raise SystemExit("the AMX GGUF kernel is not available on this host/build")
    print(f"{'type':5} {'thr':>3} {'N x K':>10} {'M':>4} {'amx us':>9} {'int8 us':>9} "
          f"{'bf16 us':>9} {'amx/int8':>9} {'amx/bf16':>9}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for type_name in args.types:
            for n, k in SHAPES:
                weight, _ = gguf_weight(type_name, n, k, seed=n + k)
                dense = weight.dequantize().bfloat16()
                packed = cpu_onednn.prepack(dense)
                for m in args.rows:
                    x = torch.randn(m, k).bfloat16()
                    kernels = {
                        "amx": lambda: cpu_linear.linear_gguf_amx(x, weight, None),
                        "int8": lambda: cpu_linear.linear_gguf(x, weight, None),
                        "bf16": (lambda: cpu_onednn.linear(x, packed, None)) if packed is not None
                        else (lambda: torch.nn.functional.linear(x, dense)),
                    }
                    samples = {name: [] for name in kernels}
                    for _ in range(args.repeats):
                        for name, fn in kernels.items():
                            samples[name].append(_time(fn))
                    t = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
                    print(f"{type_name:5} {threads:>3} {f'{n}x{k}':>10} {m:>4} {t['amx']:9.1f} "
                          f"{t['int8']:9.1f} {t['bf16']:9.1f} {t['int8'] / t['amx']:9.2f} "
                          f"{t['bf16'] / t['amx']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
