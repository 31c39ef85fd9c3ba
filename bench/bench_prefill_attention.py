"""Prefill attention on the CPU: the AMX kernel (kernels/cpu/prefill_attention_amx.c)
against torch's SDPA per chunk (what bf16 chunks ran before on AMX hosts) and the native
tile kernel (kernels/cpu/paged_attention_f32.c), side by side in one run.

  python -m bench.bench_prefill_attention [--shape smollm2 llama-3.2-1b] [--threads 1 2]

Each case is one layer's attention over paged bf16 K/V: fresh prompts (a step of the
variable workload's lengths, one 2,048-token prompt), and chunks after cached context.
The sides are alternated, best of --repeat each. Without an AMX build the AMX column is
'-' (without the native library the tile kernel's too) and the rest still runs."""
from __future__ import annotations

import argparse
import time

import torch

from kernels import torch_ops
from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native
from kernels.cpu import paged_attention as cpu_attention
from testing.paged_batch import make_paged_batch
from testing.threads import torch_threads

SHAPES = {"smollm2": (9, 3, 64), "llama-3.2-1b": (32, 8, 64)}
# (label, seq_lens, query_lens)
CASES = [
    ("1 x 128 fresh", [128], [128]),
    ("1 x 512 fresh", [512], [512]),
    ("7 x 64-512 fresh", [64, 128, 256, 512, 300, 200, 500], [64, 128, 256, 512, 300, 200, 500]),
    ("1 x 2048 fresh", [2048], [2048]),
    ("4 x 64 after 448", [512] * 4, [64] * 4),
    ("16 x 16 after 48", [64] * 16, [16] * 16),
]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _sides(batch):
    q, kc, vc, tables, qsl, lens, scale = batch.attention_args()[:7]
    starts, chunk_lens = qsl[:-1], qsl[1:] - qsl[:-1]
    out = torch.empty_like(q)

    def amx():
        assert cpu_attention.prefill_attention_amx(q, kc, vc, tables, starts, chunk_lens, lens,
                                                   scale, out)

    def sdpa():
        for i, (s, n) in enumerate(zip(starts.tolist(), chunk_lens.tolist())):
            out[s:s + n] = torch_ops.prefill_attention(q[s:s + n], kc, vc, tables[i],
                                                       int(lens[i]), scale)

    def tiles():
        assert cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, scale) is not None

    sides = {"sdpa": sdpa}
    if cpu_native.load_library() is not None:
        sides["tiles"] = tiles
    if cpu_attention.prefill_amx_built():
        sides["amx"] = amx
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["smollm2"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"host: {cpu_features.detect().describe()}; bf16, block_size 16, one layer, "
          f"best of {args.repeat} alternated; GFLOP/s counts the causal half")
    for shape in args.shape:
        heads, kv_heads, head_dim = SHAPES[shape]
        for threads in args.threads:
            for label, seq_lens, query_lens in CASES:
                batch = make_paged_batch(seq_lens, query_lens, heads, kv_heads, head_dim, 16,
                                         dtype=torch.bfloat16, seed=len(seq_lens),
                                         spare_blocks=64)
                flops = sum(4 * q * (s - q / 2) * heads * head_dim
                            for s, q in zip(seq_lens, query_lens))
                sides = _sides(batch)
                times = {name: float("inf") for name in sides}
                with torch_threads(threads):
                    for fn in sides.values():
                        fn()  # warm: the build, the pages
                    for _ in range(args.repeat):
                        for name, fn in sides.items():
                            times[name] = min(times[name], _best(fn, 1))
                amx = times.get("amx")
                cells = " ".join(f"{name} {ms:7.2f} ms" for name, ms in times.items())
                ratio = "amx -"
                if amx:
                    ratio = " ".join(f"{name}/amx {ms / amx:.2f}" for name, ms in times.items()
                                     if name != "amx") + f" amx {flops / amx / 1e6:.0f} GFLOP/s"
                print(f"{shape:<13} t{threads} {label:<18} | {cells} | {ratio}")


if __name__ == "__main__":
    main()
