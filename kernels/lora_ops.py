"""The batched LoRA update's data and its torch reference: a step's token rows grouped
into segments, one per adapter, and y[rows of g] += (x[rows of g] A_g^T) B_g^T.

The native CPU kernel (kernels/cpu/lora.py) and the Triton one (kernels/triton/lora.py)
compute the same; kernels.dispatch.lora_add picks among them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# Output columns per entry of LoRAWeights.rank_spans (kernels/cpu/lora_sgmv.c reads them
# a vector of 8 or 16 columns at a time).
SPAN_COLUMNS = 16


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapter's update for one layer, y += (x A^T) B^T, as the kernels read it.

    A [rank, in] and B [out, rank] are both column-major (A^T's and B^T's rows
    contiguous), so that the shrink runs along the ranks and the expand along the outputs.
    `rank_spans` (int32 [ceil(out / SPAN_COLUMNS), 2], CPU) holds, for each SPAN_COLUMNS
    output columns, the ranks [lo, hi) whose B entries there are not all zero ([0, 0) for
    none): a fused layer's B is block-diagonal over its parts, and the expand skips the
    other parts' ranks. `pairs`: the same A^T and B^T packed for the native kernel's
    bf16 dot products (kernels/cpu/lora.py pack_pairs), where kernels.dispatch.prepare_lora
    found that it runs them; None elsewhere."""
    a: torch.Tensor
    b: torch.Tensor
    rank_spans: torch.Tensor
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor) -> "LoRAWeights":
        """From A [rank, in] and B [out, rank] in any layout; the same values."""
        b = b.t().contiguous().t()
        return cls(a.t().contiguous().t(), b, rank_spans(b))

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def in_kernel_layout(self) -> bool:
        """A and B column-major as `of` lays them out (the kernels check it each call)."""
        return _column_major(self.a) and _column_major(self.b)


def _column_major(t: torch.Tensor) -> bool:
    """Element (r, c) of the 2-D `t` at c * rows + r: t.t().is_contiguous(), told by the
    strides alone; it runs for every wrapped layer of every step, and a view costs more."""
    rows, cols = t.shape
    row_step, col_step = t.stride()
    return (t.numel() == 0 or ((rows == 1 or row_step == 1)
                               and (cols == 1 or col_step == rows)))


def rank_spans(b: torch.Tensor) -> torch.Tensor:
    """LoRAWeights.rank_spans of B [out, rank]."""
    out, rank = b.shape
    blocks = -(-out // SPAN_COLUMNS)
    if rank == 0:
        return torch.zeros(blocks, 2, dtype=torch.int32)
    used = torch.zeros(blocks * SPAN_COLUMNS, rank, dtype=torch.bool)
    used[:out] = b.detach().cpu() != 0
    used = used.view(blocks, SPAN_COLUMNS, rank).any(1)  # [blocks, rank]
    ranks = torch.arange(rank)
    lo = torch.where(used, ranks, rank).amin(1)
    hi = torch.where(used, ranks + 1, 0).amax(1)
    lo = torch.where(hi > 0, lo, 0)
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


# One segment's weights each, None where that adapter has no update for the layer.
SegmentWeights = Sequence["LoRAWeights | None"]


@dataclass(frozen=True, slots=True)
class LoRASegments:
    """`rows` (int64) lists each segment's row indices, segment g at
    rows[starts[g]:starts[g + 1]]; `row_sets` is the same per segment as torch indexes
    best (a slice for one contiguous run)."""
    rows: torch.Tensor
    starts: torch.Tensor  # int64 [num_segments + 1], on the CPU
    row_sets: tuple[slice | torch.Tensor, ...]
    max_rows: int  # of one segment (the Triton launch's grid)

    @property
    def num_segments(self) -> int:
        return len(self.row_sets)


def make_segments(runs: Sequence[Sequence[tuple[int, int]]],
                  device: torch.device | str = "cpu") -> LoRASegments:
    """Segments from each adapter's runs of rows [(start, end), ...]."""
    row_sets: list[slice | torch.Tensor] = []
    pieces, starts = [], [0]
    for group in runs:
        index = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in group])
        pieces.append(index)
        starts.append(starts[-1] + index.numel())
        row_sets.append(slice(group[0][0], group[0][1]) if len(group) == 1
                        else index.to(device))
    rows = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    max_rows = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    return LoRASegments(rows.to(device), torch.tensor(starts, dtype=torch.int64),
                        tuple(row_sets), max_rows)


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights) -> None:
    """y += the update of each segment's rows, in place: one shrink and one expand per
    segment, in x's dtype."""
    for rows, w in zip(segments.row_sets, weights):
        if w is None:
            continue
        a, b = w.a, w.b
        if isinstance(rows, slice):
            # Into y's rows in place: a [rows, out] temporary (50 MB for SmolLM2's gate_up
            # at 4096 rows) made it 1.5-3.6x slower there (64-4096 rows, avx2, 1 thread).
            y[rows].addmm_(x[rows] @ a.t(), b.t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
