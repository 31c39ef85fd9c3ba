"""Decode attention bandwidth: bytes of K/V (and queries) a decode step must read, per
second, as a share of the device's peak. Batch 64 at contexts 8k and 32k: at 2k a call
moves so little that launch overhead (allocations and two launches from Python) dominates
and the share would measure the launcher, not the kernel.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.gpu_report import Case, Outcome

# Published HBM bandwidth (TB/s) by device-name substring; the first match wins.
PEAK_TBPS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("H20", 4.0), ("GH200", 4.0),
             ("B200", 8.0), ("A100", 2.0), ("L40S", 0.864), ("L4", 0.3))
REHEARSAL_PEAK_TBPS = 0.05  # nominal for a CPU: the rehearsal's percentages mean nothing


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.num_heads}/{self.num_kv_heads}/{self.head_dim}"


# SmolLM2-135M's and Llama-3.2-1B's attention
GPU_LAYOUTS = (AttentionLayout(9, 3, 64), AttentionLayout(32, 8, 128))
REHEARSAL_LAYOUTS = (AttentionLayout(4, 2, 32),)


def peak_tbps(device_name: str) -> tuple[float, bool]:
    """(peak TB/s, whether the name was known); unknown devices assume an H200."""
    for key, value in PEAK_TBPS:
        if key in device_name:
            return value, True
    return 4.8, False


def random_decode_batch(num_seqs: int, context: int, layout: AttentionLayout, block_size: int,
                        dtype: torch.dtype, device: str) -> tuple:
    """paged_attention arguments built straight on the device (make_paged_batch fills
    the cache on the host, far too slow for gigabytes)."""
    blocks_per_seq = -(-context // block_size)
    shape = (num_seqs * blocks_per_seq + 1, block_size, layout.num_kv_heads, layout.head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device, dtype=torch.int32)
    query_start_loc = torch.arange(num_seqs + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), context, device=device, dtype=torch.int32)
    query = torch.randn(num_seqs, layout.num_heads, layout.head_dim, device=device, dtype=dtype)
    return (query, key_cache, value_cache, tables.view(num_seqs, -1), query_start_loc, seq_lens,
            layout.head_dim ** -0.5, 1, context)


def seconds_per_call(fn, device: str, min_seconds: float) -> float:
    fn()  # compiles this specialization
    if not device.startswith("cuda"):
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 5
    while True:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        if seconds >= min_seconds or calls >= 2000:
            return seconds / calls
        calls *= 4


def decode_bandwidth(context: int, device: str, peak: float, rehearse: bool) -> Outcome:
    from kernels.triton import ops as triton_ops
    num_seqs, layouts = (2, REHEARSAL_LAYOUTS) if rehearse else (64, GPU_LAYOUTS)
    dtype = torch.bfloat16
    parts = []
    for layout in layouts:
        args = random_decode_batch(num_seqs, context, layout, 16, dtype, device)
        kv_bytes = 2 * num_seqs * context * layout.num_kv_heads * layout.head_dim * dtype.itemsize
        query_bytes = 2 * num_seqs * layout.num_heads * layout.head_dim * dtype.itemsize
        seconds = seconds_per_call(lambda: triton_ops.paged_attention(*args), device, 0.2)
        rate = (kv_bytes + query_bytes) / seconds
        parts.append(f"{layout}: {seconds * 1e6:,.0f} us {rate / 1e12:.2f} TB/s "
                     f"{rate / peak:.0%}")
        del args
    scale = f" [rehearsal: B={num_seqs} ctx {context}]" if rehearse else ""
    return Outcome("OK", "; ".join(parts) + f" of {peak / 1e12:g} TB/s{scale}")


def bandwidth_cases(device: str, peak_bytes_per_s: float, rehearse: bool) -> list[Case]:
    contexts = {"8k": 8192, "32k": 32768}
    if rehearse:
        contexts = {"8k": 64, "32k": 128}
    return [Case(f"decode bandwidth B=64 ctx {label}",
                 lambda ctx=ctx: decode_bandwidth(ctx, device, peak_bytes_per_s, rehearse))
            for label, ctx in contexts.items()]
