"""The batched LoRA update's data and its torch reference: a step's token rows grouped
into segments, one per adapter, and y[rows of g] += (x[rows of g] A_g^T) B_g^T.

The native CPU kernel (kernels/cpu/lora.py) and the Triton one (kernels/triton/lora.py)
compute the same; kernels.dispatch.lora_add picks among them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# One segment's weights: A [rank, in], B [out, rank], or None where that adapter has no
# update for the layer. The kernels take A row-major and B column-major (B^T's rows
# contiguous, as `lora_layout` stores them): the expand then runs along `out`.
SegmentWeights = Sequence["tuple[torch.Tensor, torch.Tensor] | None"]


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


def lora_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as the kernels read them (see SegmentWeights); same values."""
    return a.contiguous(), b.t().contiguous().t()


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
    for rows, ab in zip(segments.row_sets, weights):
        if ab is None:
            continue
        a, b = ab
        if isinstance(rows, slice):
            # Into y's rows in place: a [rows, out] temporary (50 MB for SmolLM2's gate_up
            # at 4096 rows) made it 1.5-3.6x slower there (64-4096 rows, avx2, 1 thread).
            y[rows].addmm_(x[rows] @ a.t(), b.t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
