"""GGUF matmul kernels side by side against a dense bf16 matmul on a oneDNN-prepacked copy
of the same weights, bf16 activations: the row kernel (linear_quant.c, the file's rows),
the VNNI panel kernel (linear_gguf_vnni.c) and the AMX tile kernel (linear_gguf_amx.c),
each where this host's build has it.

    PYTHONPATH=. python -m bench.bench_gguf_kernels [--shape smollm2 llama-3.2-1b]
        [--threads 1 2] [--rows 1 4 16 64 256]

Each kernel's time is the median of interleaved repeats (the kernels alternate, so a
noisy neighbour slows them alike). Every column after the times is dense bf16's time over
that kernel's: > 1 means the GGUF kernel is faster than the dense matmul.
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

# (out, in): fused qkv, o projection, fused gate_up, down
SHAPES = {"smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]}


def _time(fn, budget_s: float = 0.05) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / max(calls, 1)


def _kernels(weight, x, packed, dense) -> dict:
    kernels = {"rows": lambda: cpu_linear.linear_gguf(x, weight, None)}
    if cpu_linear.gguf_vnni_built():
        panels = weight.to_panels()
        kernels["vnni"] = lambda: cpu_linear.linear_gguf(x, panels, None)
    if cpu_linear.gguf_amx_available():
        kernels["amx"] = lambda: cpu_linear.linear_gguf_amx(x, weight, None)
    kernels["bf16"] = ((lambda: cpu_onednn.linear(x, packed, None)) if packed is not None
                       else (lambda: torch.nn.functional.linear(x, dense)))
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["smollm2"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not cpu_linear.available():
        raise SystemExit("the native kernels are not available on this host")
    features = cpu_features.detect()
    print(f"host: {features.isa} (detected {features.detected_isa}); kernels: rows"
          f"{', vnni' if cpu_linear.gguf_vnni_built() else ''}"
          f"{', amx' if cpu_linear.gguf_amx_available() else ''}; times in us")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shape:
            for type_name in args.types:
                for n, k in SHAPES[shape]:
                    weight, _ = gguf_weight(type_name, n, k, seed=n + k)
                    dense = weight.dequantize().bfloat16()
                    packed = cpu_onednn.prepack(dense)
                    for m in args.rows:
                        x = torch.randn(m, k).bfloat16()
                        kernels = _kernels(weight, x, packed, dense)
                        samples = {name: [] for name in kernels}
                        for _ in range(args.repeats):
                            for name, fn in kernels.items():
                                samples[name].append(_time(fn))
                        t = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
                        times = " ".join(f"{name} {t[name]:9.1f}" for name in kernels)
                        ratios = " ".join(f"bf16/{name} {t['bf16'] / t[name]:5.2f}"
                                          for name in kernels if name != "bf16")
                        print(f"{type_name:5} thr {threads} {f'{n}x{k}':>10} m {m:>4} | {times} "
                              f"| {ratios}", flush=True)


if __name__ == "__main__":
    main()
