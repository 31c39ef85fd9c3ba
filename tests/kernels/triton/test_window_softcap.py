"""The Triton attention kernels with a sliding window, a soft cap (issue 44) and attention
sinks (gpt-oss, issue 45), against the
dense float64 reference of tests/kernels/window_reference.py, under the interpreter where
there is no GPU (as test_kernels.py: TRITON_INTERPRET=1 is set before triton is imported).
Blocks before every query's window, and table padding, name a block of NaN: a kernel that
loads one fails."""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

from kernels.triton import ops as triton_ops  # noqa: E402
from tests.kernels.window_reference import assert_matches, windowed_batch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TOLERANCE = {torch.float32: dict(atol=5e-5, rtol=5e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Tiles of 16 keys, decode partitions of 32: windows start inside tiles, partitions wholly
# before a window are skipped and some partitions hold only part of one.
SMALL_TILES = triton_ops.AttentionTiles(block_n=16, block_m=16, partition_size=32)
SCALE, CAP = 0.11, 2.0
# (heads, KV heads, head_dim, block_size): GQA at Gemma's 256, MQA, MHA.
SHAPES = [(4, 2, 256, 16), (4, 1, 64, 8), (2, 2, 128, 16)]
MIXED = ([1, 37, 40, 100, 29, 5, 3], [1, 1, 40, 23, 1, 0, 3])
DECODE = ([1, 37, 40, 100, 29, 64], [1] * 6)


def _run(lens, shape, dtype, window, cap, tiles, sinks=False):
    heads, kv_heads, head_dim, block_size = shape
    batch = windowed_batch(*lens, heads, kv_heads, head_dim, block_size, window, dtype=dtype,
                           seed=head_dim + heads, scale=SCALE, query_gain=3.0, device=DEVICE)
    head_sinks = None
    if sinks:  # per head, of the logits' size, in no order (a head reading another's shows)
        gen = torch.Generator().manual_seed(heads)
        head_sinks = (torch.randn(heads, generator=gen) * 2.0 + 1.0).to(DEVICE)
    got = triton_ops.paged_attention(*batch.attention_args(), tiles=tiles,
                                     sliding_window=window, soft_cap=cap, sinks=head_sinks)
    assert_matches(got, batch, window, cap, sinks=head_sinks, **TOLERANCE[dtype])


FEATURES = [(7, None), (29, None), (1, None), (1000, None), (None, CAP), (16, CAP)]


@pytest.mark.parametrize("window,cap", FEATURES)
@pytest.mark.parametrize("shape,dtype", [(SHAPES[0], torch.bfloat16), (SHAPES[1], torch.float32),
                                         (SHAPES[2], torch.bfloat16)])
@pytest.mark.parametrize("tiles", [SMALL_TILES, triton_ops.DEFAULT_TILES], ids=["split", "single"])
def test_decode_kernel(window, cap, shape, dtype, tiles):
    _run(DECODE, shape, dtype, window, cap, tiles)


@pytest.mark.parametrize("window,cap", FEATURES)
@pytest.mark.parametrize("shape,dtype", [(SHAPES[0], torch.float32), (SHAPES[1], torch.bfloat16),
                                         (SHAPES[2], torch.float32)])
def test_prefill_kernel_with_decode_rows(window, cap, shape, dtype):
    _run(MIXED, shape, dtype, window, cap, SMALL_TILES)


def test_a_long_decode_reads_only_its_window():
    """300 positions, window 40: the first 8 partitions of 32 are wholly before it and
    their blocks are NaN; the reduce must leave them out too."""
    _run(([300, 260], [1, 1]), SHAPES[1], torch.float32, 40, CAP, SMALL_TILES)


SINK_FEATURES = [(None, None), (7, None), (1, None), (16, CAP)]


@pytest.mark.parametrize("window,cap", SINK_FEATURES)
@pytest.mark.parametrize("shape,dtype", [(SHAPES[0], torch.bfloat16), (SHAPES[1], torch.float32),
                                         (SHAPES[2], torch.float32)])
@pytest.mark.parametrize("tiles", [SMALL_TILES, triton_ops.DEFAULT_TILES], ids=["split", "single"])
def test_decode_kernel_with_sinks(window, cap, shape, dtype, tiles):
    """Unsplit the program starts from the sink; split, the reduce adds it once (a
    partition that added it too, or none, would be off by a sink)."""
    _run(DECODE, shape, dtype, window, cap, tiles, sinks=True)


@pytest.mark.parametrize("window,cap", SINK_FEATURES)
@pytest.mark.parametrize("shape,dtype", [(SHAPES[0], torch.float32), (SHAPES[1], torch.bfloat16),
                                         (SHAPES[2], torch.float32)])
def test_prefill_kernel_with_decode_rows_and_sinks(window, cap, shape, dtype):
    _run(MIXED, shape, dtype, window, cap, SMALL_TILES, sinks=True)


def test_a_long_decode_with_sinks_skips_partitions_before_its_window():
    """The partitions the window skips hold no sink either: the reduce adds it itself."""
    _run(([300, 260], [1, 1]), SHAPES[1], torch.float32, 40, None, SMALL_TILES, sinks=True)
