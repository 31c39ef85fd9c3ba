"""The native decode attention of two revisions side by side, one process, alternated:

  python -m bench.bench_decode_attention_ab --old 3b8c3bf [--threads 1] [--repeats 6]

Builds `kernels/cpu/decode_attention.c` as it was at --old (git show) and as it is in the
working tree, each alone into a shared library with the engine's compile flags for this
host, loads both with ctypes and times `paged_decode_attention` on the same random paged
batches: best of --repeats rounds, the two sides in alternating order. Shapes: SmolLM2
(9 / 3 heads, head_dim 64) and Llama-3.2-1B / 8B style GQA (32 / 8 heads, head_dim 64
and 128), bf16 and float32, KV spread over a pool far larger than the caches. Prints
microseconds, the KV bytes read per second, and old / new; the outputs' largest
difference is printed too (summation order only).
"""
from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch

from bench.native_ab import ROOT, best_alternated, build, report, source_at
from kernels.cpu import features as cpu_features

SOURCE = "kernels/cpu/decode_attention.c"
CASES = (  # seqs, context, heads, kv heads, head_dim, dtype
    (64, 320, 9, 3, 64, torch.bfloat16),
    (64, 64, 9, 3, 64, torch.bfloat16),
    (64, 320, 9, 3, 64, torch.float32),
    (16, 1024, 32, 8, 64, torch.bfloat16),
    (16, 512, 32, 8, 128, torch.bfloat16),
)
BLOCK = 16


def run_case(libs: dict[str, ctypes.CDLL], case, threads: int, repeats: int) -> str:
    seqs, context, heads, kv_heads, head_dim, dtype = case
    gen = torch.Generator().manual_seed(seqs * context)
    blocks = seqs * (context // BLOCK + 1)
    key_cache = torch.randn(blocks + 8, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(blocks + 8, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks + 8, generator=gen)[:blocks].to(torch.int32).view(seqs, -1)
    tables = tables.contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    outs = {side: torch.empty_like(query) for side in libs}

    def call(side: str) -> None:
        status = libs[side].paged_decode_attention(
            *(ctypes.c_void_p(t.data_ptr()) for t in (query, key_cache, value_cache,
                                                       outs[side], tables, lens)),
            seqs, heads, kv_heads, head_dim, BLOCK, tables.shape[1],
            ctypes.c_float(head_dim ** -0.5), int(dtype == torch.bfloat16), threads)
        assert status == 0, status

    best = best_alternated(call, repeats, calls=5)
    kv_bytes = 2 * seqs * context * kv_heads * head_dim * query.element_size()
    diff = (outs["old"].float() - outs["new"].float()).abs().max().item()
    label = f"{seqs:3d} x {context:4d}, {heads:2d}/{kv_heads} heads, d {head_dim:3d}, " \
            f"{str(dtype).removeprefix('torch.'):8s}"
    return report(label, best, kv_bytes, "us", f"max diff {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": build(source_at(args.old, SOURCE), Path(tmp), "old"),
                "new": build((ROOT / SOURCE).read_text(), Path(tmp), "new")}
        for library in libs.values():
            library.paged_decode_attention.restype = ctypes.c_int
        print(f"host ISA: {cpu_features.detect().describe()}; {args.threads} thread(s); "
              f"best of {args.repeats}, alternated; old = {args.old}, new = working tree")
        for case in CASES:
            print(run_case(libs, case, args.threads, args.repeats), flush=True)


if __name__ == "__main__":
    main()
