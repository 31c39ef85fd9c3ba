"""The dense row matmuls of a single stream's decode step (kernels/cpu/linear_f32.c,
linear_bf16.c) at two revisions side by side, one process, alternated:

  python -m bench.bench_row_kernels_ab --old be697bf [--threads 2] [--repeats 4]

Builds each source as it was at --old and as it is in the working tree (bench/native_ab.py)
and times one token's matmuls at one row: every layer's qkv, o, gate_up and down and the
lm_head, with each layer's weights of its own, so the pass streams the model's bytes from
DRAM as a decode step does. Shapes: SmolLM2-135M (269 MB at bf16) and Llama-3.2-1B
(2.5 GB at bf16; --skip-1b leaves it out). Prints ms a pass, weight GB/s, old / new, and
whether both sides' outputs are bit-equal (the change under test should keep them).
"""
from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch

from bench.native_ab import ROOT, best_alternated, build, report, source_at
from kernels.cpu import features as cpu_features

KERNELS = {  # dtype -> (source, symbol)
    torch.bfloat16: ("kernels/cpu/linear_bf16.c", "linear_bf16_rows"),
    torch.float32: ("kernels/cpu/linear_f32.c", "linear_f32_rows"),
}
MODELS = {  # name -> (layers, hidden, qkv rows, intermediate, vocab)
    "SmolLM2-135M": (30, 576, 960, 1536, 49152),
    "Llama-3.2-1B": (16, 2048, 3072, 8192, 128256),
}


def token_shapes(model: str) -> list[tuple[int, int]]:
    layers, hidden, qkv, inter, vocab = MODELS[model]
    per_layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return per_layer * layers + [(vocab, hidden)]


def run_pass(fn, weights, inputs, outputs, threads: int) -> None:
    for w, y in zip(weights, outputs):
        n, k = w.shape
        fn(inputs[k].data_ptr(), w.data_ptr(), None, y.data_ptr(), 1, n, k, threads)


def bind(library: ctypes.CDLL, symbol: str, dtype: torch.dtype):
    fn = getattr(library, symbol)
    fn.restype = ctypes.c_int if dtype == torch.bfloat16 else None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return fn


def run_case(fns: dict, model: str, dtype: torch.dtype, threads: int, repeats: int) -> str:
    gen = torch.Generator().manual_seed(0)
    shapes = token_shapes(model)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes]
    inputs = {k: torch.randn(1, k, generator=gen).to(dtype) for _, k in shapes}
    outs = {side: [torch.empty(1, n, dtype=dtype) for n, _ in shapes] for side in fns}
    best = best_alternated(lambda side: run_pass(fns[side], weights, inputs, outs[side], threads),
                           repeats, calls=3)
    total = sum(w.numel() * w.element_size() for w in weights)
    equal = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    label = f"{model:13s} {str(dtype).removeprefix('torch.'):8s} {total / 1e6:6.0f} MB"
    return report(label, best, total, "ms", f"bit-equal {equal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--skip-1b", action="store_true")
    args = parser.parse_args()
    print(f"host ISA: {cpu_features.detect().describe()}; {args.threads} thread(s); "
          f"best of {args.repeats}, alternated; old = {args.old}, new = working tree")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, (source, symbol) in KERNELS.items():
            fns = {}
            for side, text in (("old", source_at(args.old, source)),
                               ("new", (ROOT / source).read_text())):
                fns[side] = bind(build(text, Path(tmp), f"{side}_{symbol}"), symbol, dtype)
            for model in MODELS:
                if model == "Llama-3.2-1B" and args.skip_1b:
                    continue
                print(run_case(fns, model, dtype, args.threads, args.repeats), flush=True)


if __name__ == "__main__":
    main()
