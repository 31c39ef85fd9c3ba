"""Microbenchmark of the CPU kernels as the engine calls them (kernels.dispatch: native C
where it applies, else torch): python -m bench.bench_kernels_cpu

Shapes follow the default model (bf16, 9 query / 3 KV heads, head_dim 64, block 16,
hidden 576, intermediate 1536, vocab 49152). TLE_DISABLE_NATIVE_CPU_KERNELS=1 times the
torch path alone.
"""
from __future__ import annotations

import argparse
import time

import torch

from kernels import (add_rms_norm, argmax_rows, paged_attention, reshape_and_cache, rope,
                     silu_mul)
from testing.paged_batch import make_paged_batch


def microseconds_per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: keep default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    print(f"torch threads: {torch.get_num_threads()}")

    decode = make_paged_batch([args.context] * args.batch, [1] * args.batch, heads, kv_heads,
                              head_dim, block, dtype=torch.bfloat16)
    us = microseconds_per_call(lambda: paged_attention(*decode.attention_args()), args.repeats)
    kv_bytes = 2 * args.batch * args.context * kv_heads * head_dim * 2
    print(f"decode attention  batch {args.batch} x ctx {args.context}: {us:9.0f} us/call "
          f"({kv_bytes / us / 1e3:.1f} GB/s of K/V)")

    seqs = args.batch // 2
    mixed = make_paged_batch([args.context] * seqs + [args.context] * 2, [1] * seqs + [128, 256],
                             heads, kv_heads, head_dim, block, dtype=torch.bfloat16)
    us = microseconds_per_call(lambda: paged_attention(*mixed.attention_args()), args.repeats)
    print(f"mixed attention   {seqs} decodes + chunks 128/256 at ctx {args.context}: {us:9.0f} us/call")

    tokens = args.batch
    key = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16)
    slots = torch.randperm(decode.key_cache.shape[0] * block)[:tokens]
    us = microseconds_per_call(lambda: reshape_and_cache(key, key, decode.key_cache,
                                                         decode.value_cache, slots), args.repeats)
    print(f"reshape_and_cache {tokens} tokens: {us:9.0f} us/call")

    # The per-layer element-wise ops: at decode batch sizes their dispatch overhead is a
    # visible share of the call.
    hidden, inter, vocab, rot_half = 576, 1536, 49152, head_dim // 2
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    residual, weight = x.clone(), torch.ones(hidden, dtype=torch.bfloat16)
    us = microseconds_per_call(lambda: add_rms_norm(x, residual, weight, 1e-5), args.repeats)
    print(f"add_rms_norm      {tokens} x {hidden}: {us:9.1f} us/call")
    gate_up = torch.randn(tokens, 2 * inter).to(torch.bfloat16)
    us = microseconds_per_call(lambda: silu_mul(gate_up), args.repeats)
    print(f"silu_mul          {tokens} x {inter}: {us:9.1f} us/call")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    cos_table = torch.randn(2048, rot_half).to(torch.bfloat16)
    sin_table = torch.randn(2048, rot_half).to(torch.bfloat16)
    positions = torch.full((tokens,), args.context, dtype=torch.int64)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    us = microseconds_per_call(lambda: rope(qkv, heads + kv_heads, head_dim, rot_half, positions,
                                            cos_table, sin_table, cos, sin), args.repeats)
    print(f"rope              {tokens} x {heads + kv_heads} heads: {us:9.1f} us/call")
    logits = torch.randn(tokens, vocab).to(torch.bfloat16)
    us = microseconds_per_call(lambda: argmax_rows(logits), args.repeats)
    print(f"argmax_rows       {tokens} x {vocab}: {us:9.1f} us/call")


if __name__ == "__main__":
    main()
