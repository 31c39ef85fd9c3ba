"""Where the native LoRA kernel (kernels/cpu/lora_sgmv.c) stops beating torch's matmuls
(kernels/lora_ops.py) as an adapter's segment grows: python -m bench.bench_lora_dispatch

SmolLM2-135M's four wrapped layers per decoder layer (qkv 576 -> 960 with three stacked
ranks, o 576 -> 576, gate_up 576 -> 3072 with two, down 1536 -> 576; a fused layer's B
block-diagonal over its parts, as the adapter loader builds it), one segment of
1..4096 rows, ranks 8 / 16 / 64. Single-thread CPU time (time.thread_time; torch and the
kernel at one thread, so other load on a shared host does not count), the two sides
alternated within each repeat, best of --repeats. Prints, per dtype, rank and rows, the
microseconds of all four layers on each side and torch / native (> 1: native faster),
then the smallest row count from which torch is faster at every rank, and the same for
decode batches spread over several adapters (segments of a few scattered rows each): what
kernels.dispatch.LORA_TORCH_MIN_ROWS is set from."""
from __future__ import annotations

import argparse
import time

import torch

from bench.bench_lora_ab import fused_weights, layer_shapes
from kernels import lora_ops
from kernels.cpu import features as cpu_features
from kernels.cpu import lora as cpu_lora
from kernels.lora_ops import make_segments

ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def layer_cases(rows: int, rank: int, dtype: torch.dtype, scattered: bool = False):
    """One adapter's segment of `rows` rows; `scattered`: a decode batch of `rows` rows
    round-robin over 4 adapters and the base (row i: adapter i mod 5), as steps mixing
    adapters hand the layers."""
    gen = torch.Generator().manual_seed(rows * 131 + rank)
    runs = ([[(i, i + 1) for i in range(g, rows, 5)] for g in range(min(4, rows))]
            if scattered else [[(0, rows)]])
    segments = make_segments(runs)
    cases = []
    for in_features, parts in layer_shapes("SmolLM2-135M"):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        y = torch.zeros(rows, sum(parts), dtype=dtype)
        weights = [fused_weights(in_features, parts, rank, dtype, gen) for _ in runs]
        cases.append((x, y, weights))
    return segments, cases


def cpu_seconds(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def measure(rows: int, rank: int, dtype: torch.dtype, repeats: int,
            scattered: bool = False) -> tuple[float, float]:
    segments, cases = layer_cases(rows, rank, dtype, scattered)

    def native():
        for x, y, w in cases:
            assert cpu_lora.lora_add(x, y, segments, w)

    def reference():
        for x, y, w in cases:
            lora_ops.lora_add(x, y, segments, w)

    native(), reference()  # warm: the library, torch's kernels, the caches
    # Small cases repeat inside one timing so that thread_time's resolution does not show.
    inner = max(1, 2048 // (rows * rank))
    best_native = best_torch = float("inf")
    for _ in range(repeats):
        best_native = min(best_native, cpu_seconds(lambda: [native() for _ in range(inner)]))
        best_torch = min(best_torch, cpu_seconds(lambda: [reference() for _ in range(inner)]))
    return best_native / inner * 1e6, best_torch / inner * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--scattered", type=int, nargs="*", default=[10, 20, 40, 80],
                        help="decode batch sizes of the mixed-adapter table")
    args = parser.parse_args()
    if cpu_lora._library() is None:
        raise SystemExit("the native kernels did not build here (no C compiler?)")
    torch.set_num_threads(1)
    print(f"host ISA: {cpu_features.detect().describe()}; one thread; "
          f"best of {args.repeats}, alternated")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        torch_wins: dict[int, set[int]] = {}
        print(f"\n{name}: rows  rank  native us   torch us   torch/native")
        for rows in args.rows:
            for rank in args.ranks:
                native_us, torch_us = measure(rows, rank, dtype, args.repeats)
                if torch_us < native_us:
                    torch_wins.setdefault(rows, set()).add(rank)
                print(f"{'':9}{rows:5d} {rank:5d} {native_us:10.0f} {torch_us:10.0f} "
                      f"{torch_us / native_us:10.2f}")
        crossover = next((rows for rows in args.rows if all(
            torch_wins.get(r, set()) == set(args.ranks) for r in args.rows if r >= rows)), None)
        print(f"{name}: torch faster at every rank from {crossover} rows on"
              if crossover else f"{name}: native faster somewhere up to {args.rows[-1]} rows")
        print(f"{name}, a decode batch round-robin over 4 adapters + base "
              "(segments of rows / 5):\n        rows  rank  native us   torch us   torch/native")
        for rows in args.scattered:
            for rank in args.ranks:
                native_us, torch_us = measure(rows, rank, dtype, args.repeats, scattered=True)
                print(f"{'':9}{rows:5d} {rank:5d} {native_us:10.0f} {torch_us:10.0f} "
                      f"{torch_us / native_us:10.2f}")


if __name__ == "__main__":
    main()
