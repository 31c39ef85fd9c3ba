"""bf16 matmuls over a whole model's layer weights, as a decode step meets them: the native
bf16 GEMM on its panels (kernels/cpu/gemm_bf16.c, AVX-512 BF16 builds) against oneDNN's
prepacked bf16 GEMM, on AMX builds the same panels on tiles (gemm_bf16_amx) too, and at
1-4 rows against the dense row kernel (linear_bf16.c).

    PYTHONPATH=. python -m bench.bench_bf16_gemm [--shape smollm2 llama-3.2-1b]
        [--rows 1 2 4 8 16 32 64 128 256] [--threads 2] [--rounds 3] [--lm-head]

Every layer gets its own random weights (SmolLM2: 30 layers, ~212 MB; Llama-3.2-1B: 16,
~1.9 GB), so each pass streams them from memory as serving does; a kernel warm in cache
would hide what that costs. One pass runs every layer's four matmuls in order; the sides
alternate pass by pass, and each side's figure is its best pass. The ratio columns are
the other side's time over the panels': > 1 means the panels are faster.
"""
from __future__ import annotations

import argparse
import time

import torch

from kernels.cpu import features as cpu_features

cpu_features.detect()  # before the first tensor op (the caps reach oneDNN at its first use)

from bench.bench_gguf_kernels import SHAPES  # noqa: E402
from kernels.cpu import gemm as cpu_gemm  # noqa: E402
from kernels.cpu import linear as cpu_linear  # noqa: E402
from kernels.cpu import onednn as cpu_onednn  # noqa: E402

LAYERS = {"smollm2": 30, "llama-3.2-1b": 16}
LM_HEAD = {"smollm2": (49152, 576), "llama-3.2-1b": (128256, 2048)}
ROW_KERNEL_MAX = 4


def _weights(shapes: list[tuple[int, int]], layers: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        for n, k in shapes:
            dense = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            out.append((n, k, dense, cpu_gemm.pack_bf16(dense), cpu_onednn.prepack(dense)))
    return out


def _sides(weights: list[tuple], rows: int) -> dict:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k, *_ in weights}}
    sides = {"panels": lambda: [cpu_gemm.gemm_bf16(xs[k], p, n, None)
                                for n, k, _, p, _ in weights],
             "onednn": lambda: [cpu_onednn.linear(xs[k], packed, None)
                                for _, k, _, _, packed in weights]}
    if cpu_gemm.bf16_amx_built():
        sides["tiles"] = lambda: [cpu_gemm.gemm_bf16(xs[k], p, n, None, tiles=True)
                                  for n, k, _, p, _ in weights]
    if rows <= ROW_KERNEL_MAX:
        sides["rows"] = lambda: [cpu_linear.linear_bf16_rows(xs[k], dense, None)
                                 for _, k, dense, _, _ in weights]
    return sides


def _report(label: str, weights: list[tuple], rows: int, rounds: int) -> None:
    sides = _sides(weights, rows)
    best = {name: float("inf") for name in sides}
    for name, run in sides.items():
        run()  # oneDNN builds its primitive for this row count on first use
    for _ in range(rounds):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2 * rows * sum(n * k for n, k, *_ in weights)
    nbytes = sum(n * k * 2 for n, k, *_ in weights)
    line = f"{label:13s} m {rows:5d} |"
    for name, t in best.items():
        line += f" {name} {t * 1e3:8.2f} ms"
    panels = best["panels"]
    line += (f" | panels {flops / panels / 1e9:5.0f} GFLOP/s {nbytes / panels / 1e9:5.1f} GB/s |"
             f" onednn/panels {best['onednn'] / panels:.2f}")
    for other in ("tiles", "rows"):
        if other in best:
            line += f" {other}/panels {best[other] / panels:.2f}"
    if "tiles" in best:
        line += f" onednn/tiles {best['onednn'] / best['tiles']:.2f}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["smollm2"])
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lm-head", action="store_true",
                        help="also the tied embedding table as the lm_head")
    args = parser.parse_args()
    if not cpu_gemm.bf16_built():
        raise SystemExit("this host's native build has no AVX-512 BF16 GEMM (gemm_bf16.c)")
    torch.set_num_threads(args.threads)
    features = cpu_features.detect()
    print(f"host: {features.isa} (detected {features.detected_isa}), {args.threads} threads; "
          f"best of {args.rounds} alternated passes")
    for shape in args.shape:
        weights = _weights(SHAPES[shape], LAYERS[shape], seed=1)
        label = f"{shape} x{LAYERS[shape]}"
        for rows in args.rows:
            _report(label, weights, rows, args.rounds)
        del weights
        if args.lm_head:
            head = _weights([LM_HEAD[shape]], 1, seed=2)
            for rows in args.rows:
                _report(f"{shape} head", head, rows, args.rounds)


if __name__ == "__main__":
    main()
