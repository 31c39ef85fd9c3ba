"""Launchers for the Triton kernels, with the same signatures as kernels.torch_ops.

Only shapes and the host-side ints (max_query_len, max_seq_len) steer the launch, so
nothing here syncs with the GPU. Decode-only batches (max_query_len == 1) take the
split-K decode kernel; anything with a longer chunk takes the prefill kernel, which
also handles the decode rows mixed into that batch.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from kernels.triton.cache import reshape_and_cache_kernel
from kernels.triton.decode import decode_partition_kernel, decode_reduce_kernel
from kernels.triton.prefill import prefill_attention_kernel
from kernels.validation import MAX_WINDOW


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Tile sizes; defaults are for GPUs, tests shrink them to exercise edge cases."""
    block_n: int = 64           # keys per inner-loop iteration (>= 16, power of two)
    block_m: int = 64           # query rows (tokens x group heads) per prefill program
    # Context per decode program; more than that means a split-K reduce. 0: chosen per
    # batch from the device's SM count (decode_partition_size).
    partition_size: int = 0
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {value}")
        if self.partition_size < 0 or self.partition_size % self.block_n:
            raise ValueError(f"partition_size: must be 0 (auto) or a multiple of block_n "
                             f"({self.block_n}), got {self.partition_size}")


# Fewer keys than this per decode program and the split's merge costs more than the
# extra parallelism gives back (flash-decoding kernels use 256-512).
MIN_PARTITION_SIZE = 256
# Programs per SM the split aims for, so one program's tail does not idle an SM.
PROGRAMS_PER_SM = 2


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          block_n: int) -> int:
    """Keys per decode program: the (sequence, KV head) grid is split along the context
    only while it leaves SMs idle. Batch 64 x 8 KV heads fills an H200's 132 SMs
    unsplit; one sequence at 32k context splits 32 ways (1,024 keys each)."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    size = triton.next_power_of_2(max(1, -(-max_seq_len // wanted)))
    return max(size, MIN_PARTITION_SIZE, block_n)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the tensors' device; 1 under the interpreter (CPU)."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True, slots=True)
class DecodePlan:
    partition_size: int
    num_partitions: int

    @property
    def parts_p2(self) -> int:
        """The reduce kernel's compiled bucket (0: no split, no reduce)."""
        return triton.next_power_of_2(self.num_partitions) if self.num_partitions > 1 else 0


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int,
                tiles: AttentionTiles) -> DecodePlan:
    size = tiles.partition_size or decode_partition_size(num_seqs, num_kv_heads, max_seq_len,
                                                         sms, tiles.block_n)
    return DecodePlan(size, max(1, triton.cdiv(max_seq_len, size)))


def prefill_block_q(group: int, max_query_len: int, tiles: AttentionTiles) -> int:
    """Query tokens per prefill program (BLOCK_Q, compiled in): a power of two whose
    row count BLOCK_Q x GROUP_P2 is >= 16 (tl.dot's minimum) and at most block_m."""
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, tiles.block_m // group_p2)
    block_q = min(block_q, triton.next_power_of_2(max_query_len))
    return max(block_q, triton.cdiv(16, group_p2))


DEFAULT_TILES = AttentionTiles()


@functools.cache
def _no_sinks(device: torch.device, num_heads: int) -> torch.Tensor:
    return torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads), DIM_P2=triton.next_power_of_2(head_dim))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int, max_seq_len: int,
                    tiles: AttentionTiles = DEFAULT_TILES, *, sliding_window: int | None = None,
                    soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    # Rows past query_start_loc[-1] (e.g. padding) stay zero, as on the CPU path.
    out = torch.zeros_like(query)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out
    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    # q @ k^T contracts over the padded head_dim, and tl.dot on a GPU needs K >= 16; the
    # padding dims are masked off, so head_dim 8 (or 4) just pays for 16.
    shape = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
                 HEAD_DIM=head_dim, DIM_P2=max(16, triton.next_power_of_2(head_dim)),
                 BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n,
                 FP32_DOT=_interpreted() or query.dtype == torch.float32)
    common = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    scale_log2 = scale * math.log2(math.e)
    # Runtime values, 0 for off (one compiled variant whatever the layer); the kernels'
    # logits are in log2 units, so is the cap.
    features = (min(sliding_window or 0, MAX_WINDOW),
                float(soft_cap or 0.0) * math.log2(math.e))
    # Sinks [H] float32 (gpt-oss); without them -inf for every head, which adds nothing:
    # one pointer type either way, so no variant to compile beyond today's.
    sinks = _no_sinks(query.device, num_heads) if sinks is None else sinks

    if max_query_len == 1:
        plan = plan_decode(num_seqs, num_kv_heads, max_seq_len, num_sms(query.device), tiles)
        num_partitions = plan.num_partitions
        if num_partitions == 1:
            part_out = part_max = part_sum = out  # unused placeholders
        else:
            part_out = torch.empty(num_seqs, num_heads, num_partitions, head_dim,
                                   dtype=torch.float32, device=query.device)
            part_max = torch.empty(num_seqs, num_heads, num_partitions,
                                   dtype=torch.float32, device=query.device)
            part_sum = torch.empty_like(part_max)
        # tl.dot needs at least 16 rows; the padding heads are masked off.
        decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
            *common, out, part_out, part_max, part_sum, scale_log2,
            query.stride(0), query.stride(1), block_tables.stride(0), num_partitions,
            plan.partition_size, *features, sinks,
            GROUP_P2=max(16, triton.next_power_of_2(group)),
            SPLIT=num_partitions > 1, num_warps=tiles.num_warps, **shape)
        if num_partitions > 1:
            decode_reduce_kernel[(num_seqs, num_heads)](
                out, part_out, part_max, part_sum, query_start_loc, seq_lens, num_partitions,
                plan.partition_size, features[0], sinks, NUM_HEADS=num_heads,
                HEAD_DIM=head_dim, DIM_P2=shape["DIM_P2"], PARTS_P2=plan.parts_p2,
                num_warps=tiles.num_warps)
        return out

    block_q = prefill_block_q(group, max_query_len, tiles)
    prefill_attention_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        *common, out, scale_log2, query.stride(0), query.stride(1), block_tables.stride(0),
        *features, sinks, GROUP_P2=triton.next_power_of_2(group), BLOCK_Q=block_q,
        num_warps=tiles.num_warps, **shape)
    return out
