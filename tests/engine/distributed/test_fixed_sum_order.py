"""batch_invariant's all-reduce with 3 ranks (real gloo processes): an element's sum must
not depend on the tensor's size, which is the batch's. With 2 ranks any order gives the
same bits (a + b == b + a), so only 3 or more ranks can tell a fixed order from gloo's
ring, which starts each chunk's sum at another rank and cuts the chunks by the size."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine.distributed.group import GroupAddress, ParallelGroup

pytestmark = pytest.mark.timeout(120)

WORLD = 3
ROWS = (1, 3, 7, 16, 29)  # batch sizes; the chunk an element falls in moves with them
COLS = 48


def _partial(rank: int, rows: int) -> torch.Tensor:
    # Row r of every size holds the same values, so a row's sum can be compared across
    # sizes; magnitudes spread over 1e-3..1e3 make the order of the adds show in the bits.
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    base = torch.randn(max(ROWS), COLS, generator=gen) * 10.0 ** torch.randint(
        -3, 4, (max(ROWS), COLS), generator=gen)
    return base[:rows].clone()


def _rank_main(address: GroupAddress, rank: int, fixed: bool, results) -> None:
    group = ParallelGroup(address, rank, compute_timeout_s=60.0, fixed_sum_order=fixed)
    try:
        results.put((rank, fixed, {rows: group.all_reduce(_partial(rank, rows))
                                   for rows in ROWS}))
    finally:
        group.close()


def _all_reduce_on_every_rank(tmp_path, fixed: bool) -> dict[int, dict[int, torch.Tensor]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    address = GroupAddress(str(tmp_path / f"rendezvous-{fixed}"), WORLD, "cpu")
    ranks = [context.Process(target=_rank_main, args=(address, r, fixed, results))
             for r in range(WORLD)]
    for process in ranks:
        process.start()
    try:
        got = {}
        for _ in range(WORLD):
            rank, _, sums = results.get(timeout=90)
            got[rank] = sums
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(p.exitcode == 0 for p in ranks), [p.exitcode for p in ranks]
    return got


def _rank_order_sum(rows: int) -> torch.Tensor:
    total = _partial(0, rows)
    for rank in range(1, WORLD):
        total = total + _partial(rank, rows)
    return total


def test_three_ranks_sum_each_element_in_rank_order_whatever_the_batch(tmp_path):
    got = _all_reduce_on_every_rank(tmp_path, fixed=True)
    for rank in range(WORLD):
        for rows in ROWS:
            assert torch.equal(got[rank][rows], _rank_order_sum(rows)), (rank, rows)
    # so row r has the same bits in every batch it is part of
    largest = got[0][max(ROWS)]
    for rows in ROWS:
        assert torch.equal(got[0][rows], largest[:rows]), rows


def test_gloos_ring_would_not_keep_a_rows_bits_across_batches(tmp_path):
    """Why the fixed order exists: the default all-reduce gives the same row other bits
    in another batch size (if this ever passes with equal bits, the ring changed and the
    test above no longer proves anything on its own)."""
    got = _all_reduce_on_every_rank(tmp_path, fixed=False)
    largest = got[0][max(ROWS)]
    differs = [rows for rows in ROWS if not torch.equal(got[0][rows], largest[:rows])]
    assert differs, "gloo's ring summed every row in one order for every batch size"
    # the ranks still agree with each other (an all-reduce, whatever its order)
    for rank in range(1, WORLD):
        for rows in ROWS:
            assert torch.equal(got[rank][rows], got[0][rows]), (rank, rows)
