"""The native LoRA update (kernels/cpu/lora_sgmv.c) at two revisions side by side, one
process, alternated:

  python -m bench.bench_lora_ab --old REV [--threads 1 2] [--rows 16 64] [--repeats 5]

Builds the source as it was at --old and as it is in the working tree (bench/native_ab.py)
and times a decoder layer's four wrapped projections (qkv, o, gate_up, down) as the
adapter loader builds them, over --layers decoder layers' weights of their own (the
model's layer count by default, so that they stream from memory as in a step; 1: in cache): a fused layer's A stacks its parts' A rows and its B is
block-diagonal over the parts. A decode batch of --rows rows is spread round-robin over 4
adapters and the base model (row i: adapter i mod 5, the fifth the base), as mixed-adapter
steps hand the layers. Shapes: SmolLM2-135M and Llama-3.2-1B (--skip-1b leaves it out).
Prints us a layer for each side, old / new, and the largest difference between the two
sides' outputs relative to the update's size.

Each side is called with the arguments its source takes (`signature`): before the
outer-product kernel, A row-major and no rank spans; then A^T and spans; then also the
bf16 pairs (kernels/cpu/lora.py pack_pairs), packed where this host's build runs them."""
from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch

from bench.native_ab import ROOT, best_alternated, build, report, source_at
from kernels import dispatch
from kernels.cpu import features as cpu_features
from kernels.lora_ops import LoRAWeights, make_segments

SOURCE = "kernels/cpu/lora_sgmv.c"
MODELS = {  # name -> (hidden, q, kv, intermediate, decoder layers)
    "SmolLM2-135M": (576, 576, 192, 1536, 30),
    "Llama-3.2-1B": (2048, 2048, 512, 8192, 16),
}
ADAPTERS = 4


def layer_shapes(model: str) -> list[tuple[int, tuple[int, ...]]]:
    """(in, the output sizes of the parts fused into it) of each wrapped layer."""
    hidden, q, kv, inter, _ = MODELS[model]
    return [(hidden, (q, kv, kv)), (q, (hidden,)), (hidden, (inter, inter)), (inter, (hidden,))]


def fused_weights(in_features: int, parts: tuple[int, ...], rank: int, dtype: torch.dtype,
                  gen: torch.Generator) -> LoRAWeights:
    """One adapter's layer as engine/lora/adapter.py stacks it."""
    a = torch.randn(rank * len(parts), in_features, generator=gen) / in_features ** 0.5
    b = torch.zeros(sum(parts), rank * len(parts))
    start = 0
    for i, size in enumerate(parts):
        b[start:start + size, i * rank:(i + 1) * rank] = torch.randn(size, rank, generator=gen)
        start += size
    return dispatch.prepare_lora(a.to(dtype), b.to(dtype))


def signature(source_text: str) -> int:
    """The per-segment weight arguments a lora_sgmv source takes: 2 (A, B^T), 3 (A^T, B^T,
    rank spans) or 5 (and the bf16 pairs of A^T and B^T)."""
    return 5 if "at_pairs" in source_text else 3 if "*spans" in source_text else 2


def bind(library: ctypes.CDLL, weight_args: int):
    fn = library.lora_sgmv
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.restype = i32
    fn.argtypes = [i32, p, i64, p, i64, p, p, i32] + [p] * weight_args + [p, i64, i64, i32]
    return fn


class Layer:
    """One wrapped layer's inputs, weights and the pointer arrays each side is called with."""

    def __init__(self, in_features, parts, rows, rank, dtype, gen):
        self.x = torch.randn(rows, in_features, generator=gen).to(dtype)
        self.y0 = torch.randn(rows, sum(parts), generator=gen).to(dtype)
        self.y = {side: self.y0.clone() for side in ("old", "new")}
        self.weights = [fused_weights(in_features, parts, rank, dtype, gen)
                        for _ in range(ADAPTERS)]
        # the old kernel's A row-major (kept alive here); the new one's A column-major
        self.a_rows = [w.a.contiguous() for w in self.weights]
        ptrs = lambda ts: (ctypes.c_void_p * ADAPTERS)(*[t.data_ptr() for t in ts])  # noqa: E731
        plain = [ptrs([w.a for w in self.weights]), ptrs([w.b for w in self.weights]),
                 ptrs([w.rank_spans for w in self.weights])]
        pairs = [w.pairs for w in self.weights]
        none = (ctypes.c_void_p * ADAPTERS)()
        self.pointers = {  # by signature()
            2: [ptrs(self.a_rows), ptrs([w.b for w in self.weights])],
            3: plain,
            5: plain + ([ptrs([pa for pa, _ in pairs]), ptrs([pb for _, pb in pairs])]
                        if all(pairs) else [none, none]),
        }
        self.ranks = (ctypes.c_int32 * ADAPTERS)(*[w.rank for w in self.weights])

    def run(self, fn, side: str, weight_args: int, segments, threads: int) -> None:
        x, y = self.x, self.y[side]
        status = fn(int(x.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), y.data_ptr(),
                    y.stride(0), segments.rows.data_ptr(), segments.starts.data_ptr(),
                    ADAPTERS, *self.pointers[weight_args], self.ranks, x.shape[1],
                    y.shape[1], threads)
        assert status == 0


def run_case(fns: dict, weight_args: dict, model: str, dtype: torch.dtype, rows: int,
             rank: int, threads: int, repeats: int, decoder_layers: int = 1) -> str:
    gen = torch.Generator().manual_seed(rows * 7 + rank)
    segments = make_segments([[(i, i + 1) for i in range(g, rows, ADAPTERS + 1)]
                              for g in range(ADAPTERS)])
    layers = [Layer(k, parts, rows, rank, dtype, gen) for _ in range(decoder_layers)
              for k, parts in layer_shapes(model)]

    def one_layer(side: str) -> None:
        for layer in layers:
            layer.run(fns[side], side, weight_args[side], segments, threads)

    one_layer("old"), one_layer("new")  # one call from y0 on each side, to compare
    diffs = []
    for layer in layers:
        got = {side: layer.y[side].double() - layer.y0.double() for side in fns}
        scale = got["old"].abs().max().item() or 1.0
        diffs.append((got["old"] - got["new"]).abs().max().item() / scale)
    best = best_alternated(one_layer, repeats, calls=max(1, 20 // decoder_layers))
    best = {side: seconds / decoder_layers for side, seconds in best.items()}
    nbytes = sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                 for layer in layers for w in layer.weights) / decoder_layers
    label = (f"{model:13s} {str(dtype).removeprefix('torch.'):8s} rows {rows:3d} "
             f"rank {rank:3d} thr {threads}")
    return report(label, best, nbytes, "us", f"max diff / max update {max(diffs):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=0,
                        help="decoder layers' weights to cycle through (0: the model's count)")
    parser.add_argument("--skip-1b", action="store_true")
    args = parser.parse_args()
    print(f"host ISA: {cpu_features.detect().describe()}; best of {args.repeats}, alternated; "
          f"old = {args.old}, new = working tree; us for one layer's qkv + o + gate_up + down")
    texts = {"old": source_at(args.old, SOURCE), "new": (ROOT / SOURCE).read_text()}
    weight_args = {side: signature(text) for side, text in texts.items()}
    with tempfile.TemporaryDirectory() as tmp:
        fns = {side: bind(build(text, Path(tmp), f"{side}_lora_sgmv"), weight_args[side])
               for side, text in texts.items()}
        for model in MODELS:
            if model == "Llama-3.2-1B" and args.skip_1b:
                continue
            for name in args.dtypes:
                for rows in args.rows:
                    for rank in args.ranks:
                        for threads in args.threads:
                            print(run_case(fns, weight_args, model, getattr(torch, name), rows,
                                           rank, threads, args.repeats,
                                           args.layers or MODELS[model][4]), flush=True)


if __name__ == "__main__":
    main()
