"""The prepacked (oneDNN) linear path must see a bounded set of row counts.

oneDNN JITs one primitive (~0.5 MB) per weight shape and row count and keeps up to 1024
of them in each of two caches (ideep's LRU_CACHE_CAPACITY and ONEDNN_PRIMITIVE_CACHE_CAPACITY).
A served engine's steps see nearly every token count up to max_num_batched_tokens as
requests arrive over time, which grew the Triton stub by ~30 MB per burst of 100
requests, to 1-2 GB; kernels/cpu/onednn.py pads rows to a few buckets instead."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import LinearWeight, dispatch
from kernels.cpu.onednn import can_prepack

pytestmark = pytest.mark.timeout(300)


def test_prepacked_linear_sees_few_row_counts_and_keeps_results(monkeypatch):
    seen: set[int] = set()

    def fake_pointwise(x, packed, bias, attr, scalars, algorithm):
        seen.add(x.shape[0])
        return F.linear(x, packed, bias)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake_pointwise, raising=False)
    weight, bias = torch.randn(24, 16), torch.randn(24)
    for rows in range(1, 1025):
        x = torch.randn(rows, 16)
        # "packed": the fake takes a plain weight
        out = dispatch.linear(x, LinearWeight(weight, bias, packed=weight))
        assert out.shape == (rows, 24)
        torch.testing.assert_close(out, F.linear(x, weight, bias))
    assert len(seen) <= 64, f"{len(seen)} distinct row counts reached oneDNN for 1..1024 rows"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_prepacked_linear_memory_stays_bounded_over_many_row_counts():
    weight = torch.randn(40, 24)  # a shape no other test packs: every primitive is new here
    if not can_prepack(weight):
        pytest.skip("no oneDNN prepacking on this CPU")
    prepared = dispatch.prepare_linear(weight, None)

    def anon_mib() -> float:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("RssAnon"))
        return int(line.split()[1]) / 1024

    before = anon_mib()
    with torch.inference_mode():
        for rows in range(1, 513):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(dispatch.linear(x, prepared), F.linear(x, weight),
                                       atol=1e-4, rtol=1e-4)
    grown = anon_mib() - before
    # Unbucketed: ~512 primitives, ~250 MB here; bucketed: ~56, ~30 MB.
    assert grown < 100, f"512 row counts grew the process by {grown:.0f} MiB"
